"""Prebuilt, relocatable bundles: what ``kiln compile --out DIR`` writes and
``Runtime.load(DIR)`` warm-starts from.

Layout::

    DIR/kiln-bundle.json   manifest: key factors, compilation config, file checksums
    DIR/compiled/          the compiled entry (split graph, artifacts, its manifest)
    DIR/inductor/          the Inductor cache the artifacts need (compiled kernels)
    DIR/model/             config.json, generation config, tokenizer, and with
                           --include-weights the safetensors files

Every path inside is relative, so the directory can be moved, copied or mounted
read-only; whatever loading must write goes to a temporary directory.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.cache.store import atomic_write_json, checksum_tree
from kiln.runtime.loader import INDEX_NAME, checkpoint_files
from kiln.runtime.model_config import CheckpointError

if TYPE_CHECKING:
    from kiln.runtime.runtime import Runtime

__all__ = [
    "BUNDLE_MANIFEST", "BUNDLE_COMPILED_DIR", "BUNDLE_INDUCTOR_DIR", "read_bundle", "bundle_model_dirs",
    "private_inductor_copy", "write_bundle",
]

logger = logging.getLogger(__name__)

BUNDLE_MANIFEST = "kiln-bundle.json"
BUNDLE_COMPILED_DIR = "compiled"
BUNDLE_INDUCTOR_DIR = "inductor"
BUNDLE_MODEL_DIR = "model"
BUNDLE_FORMAT = 1
_MODEL_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
    "chat_template.jinja",
)


def read_bundle(path: Path) -> dict[str, Any] | None:
    """The bundle manifest of ``path``, or None when it is not a bundle."""
    f = path / BUNDLE_MANIFEST
    if not f.is_file():
        return None
    try:
        manifest = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f} is not a readable bundle manifest: {e}") from e
    if manifest.get("format") != BUNDLE_FORMAT:
        raise CheckpointError(f"{f}: bundle format {manifest.get('format')!r}, this kiln reads {BUNDLE_FORMAT}")
    return manifest


def bundle_model_dirs(path: Path, manifest: dict[str, Any], weights_path: "str | Path | None") -> tuple[Path, Path]:
    """(directory with config and tokenizer, directory with the weights)."""
    model_dir = path / BUNDLE_MODEL_DIR
    if manifest["model"]["includes_weights"]:
        return model_dir, model_dir
    candidates = [Path(weights_path)] if weights_path else []
    if manifest["model"].get("source"):
        candidates.append(Path(manifest["model"]["source"]))
    for c in candidates:
        if c.is_dir() and (any(c.glob("*.safetensors"))):
            return model_dir, c
    tried = ", ".join(str(c) for c in candidates) or "nothing"
    raise CheckpointError(
        f"bundle {path} was built without weights and none were found (tried {tried}); "
        "pass weights_path= to Runtime.load, or rebuild with `kiln compile --include-weights`"
    )


def private_inductor_copy(bundle: Path) -> Path:
    """A writable copy of the bundle's Inductor cache, removed at exit: loading an
    artifact writes into the cache it reads, and the bundle may be read-only."""
    dest = Path(tempfile.mkdtemp(prefix="kiln-inductor-"))
    shutil.copytree(bundle / BUNDLE_INDUCTOR_DIR, dest, dirs_exist_ok=True)
    atexit.register(shutil.rmtree, dest, True)
    return dest


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def write_bundle(rt: "Runtime", out: Path, include_weights: bool) -> dict[str, Any]:
    """Write the compiled runtime ``rt`` as a bundle at ``out`` (which must not
    exist or be empty). ``rt`` must have been compiled into a cache directory of
    its own, whose Inductor cache is then exactly what the bundle needs. Returns a
    summary (sizes in bytes, seconds)."""
    t0 = time.perf_counter()
    if rt.cache_entry is None:
        raise ValueError("a bundle needs a compiled runtime: use -O1 or above")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not empty; choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        shutil.copytree(rt.cache_entry, tmp / BUNDLE_COMPILED_DIR, ignore=shutil.ignore_patterns("*.lock"))
        shutil.copytree(rt.cache_root / "inductor", tmp / BUNDLE_INDUCTOR_DIR,
                        ignore=shutil.ignore_patterns("*.lock", "locks"))
        model_dir = tmp / BUNDLE_MODEL_DIR
        model_dir.mkdir()
        for name in _MODEL_FILES:
            if (rt.model_path / name).is_file():
                shutil.copy2(rt.model_path / name, model_dir / name)
        if include_weights:
            for f in checkpoint_files(rt.weights_path):
                shutil.copy2(f, model_dir / f.name)
            if (rt.weights_path / INDEX_NAME).is_file():
                shutil.copy2(rt.weights_path / INDEX_NAME, model_dir / INDEX_NAME)
        from kiln import __version__

        manifest = {
            "format": BUNDLE_FORMAT,
            "kiln_version": __version__,
            "created": time.time(),
            "factors": rt.cache_factors(),
            "compilation": rt.compilation_config.to_dict(),
            "dtype": str(rt.dtype).removeprefix("torch."),
            "engine": {"max_num_batched_tokens": rt.engine_config.max_num_batched_tokens},
            "model": {
                "architecture": rt.model_config.architecture,
                "includes_weights": include_weights,
                "source": str(rt.weights_path.resolve()),
            },
            "files": checksum_tree(tmp, skip=(BUNDLE_MANIFEST,)),
        }
        atomic_write_json(tmp / BUNDLE_MANIFEST, manifest)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "path": str(out),
        "compiled_bytes": _dir_size(out / BUNDLE_COMPILED_DIR) + _dir_size(out / BUNDLE_INDUCTOR_DIR),
        "model_bytes": _dir_size(out / BUNDLE_MODEL_DIR),
        "total_bytes": _dir_size(out),
        "seconds": round(time.perf_counter() - t0, 3),
    }
