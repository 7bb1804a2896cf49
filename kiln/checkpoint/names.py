"""What a model name means: a path, a demo name, or a Hugging Face repo id found
in the local Hugging Face cache. Nothing here downloads."""

from __future__ import annotations

import re
from pathlib import Path

from kiln.checkpoint.demo import chat_model_path, ensure_random_model
from kiln.checkpoint.reader import CheckpointError

__all__ = ["DEMO", "RANDOM_DEMO", "resolve_model_name"]

DEMO = "demo"
RANDOM_DEMO = "random-demo"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _from_hub_cache(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:  # transformers depends on it; this is a broken install
        raise CheckpointError(f"{repo_id!r} looks like a Hugging Face repo id, but huggingface_hub is missing") from None
    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError) as e:
        raise CheckpointError(
            f"model {repo_id!r} is neither a path nor in the local Hugging Face cache ({e.__class__.__name__}); "
            f"kiln never downloads models: fetch it with `hf download {repo_id}` "
            "(or `huggingface-cli download`), or pass a directory or a .gguf file"
        ) from None


def resolve_model_name(name: str, cache_dir: Path) -> Path:
    """The path ``name`` stands for: ``"demo"`` (the chat demo model, fetched by
    ``kiln fetch-demo``), ``"random-demo"`` (built here when missing), an
    existing path, or ``org/name`` from the local Hugging Face cache."""
    if name == DEMO:
        path = chat_model_path(cache_dir)
        if not path.is_file():
            raise CheckpointError(
                f"the demo model is not in {path.parent}: run `kiln fetch-demo` (or `make demo`) once to fetch it"
            )
        return path
    if name == RANDOM_DEMO:
        return ensure_random_model(cache_dir)
    path = Path(name).expanduser()
    if path.exists() or not _REPO_ID.match(name):
        return path
    return _from_hub_cache(name)
