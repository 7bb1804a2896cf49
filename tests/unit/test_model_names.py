"""What a model name resolves to: paths, the demo names, and Hugging Face repo
ids from the local cache only (kiln never downloads a model on its own)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.checkpoint import CheckpointError
from kiln.checkpoint.names import resolve_model_name


@pytest.fixture()
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Hugging Face cache holding ``org/tiny`` at one snapshot, as
    ``hf download`` leaves it."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    commit = "0" * 40
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snapshot


def test_repo_ids_resolve_from_the_local_cache(hub_cache: Path, tmp_path: Path) -> None:
    assert resolve_model_name("org/tiny", tmp_path) == hub_cache
    with pytest.raises(CheckpointError, match=r"'org/missing' is neither a path nor in the local Hugging Face cache.*"
                                              r"`hf download org/missing`"):
        resolve_model_name("org/missing", tmp_path)


def test_paths_and_demo_names(tmp_path: Path) -> None:
    local = tmp_path / "org" / "name"
    local.mkdir(parents=True)
    assert resolve_model_name(str(local), tmp_path) == local  # an existing path wins over a repo id
    assert resolve_model_name("./not-there", tmp_path) == Path("./not-there")  # the loader reports it missing
    with pytest.raises(CheckpointError, match=r"the demo model is not in .*run `kiln fetch-demo`"):
        resolve_model_name("demo", tmp_path)
