"""Prebuilt, relocatable bundles: what ``kiln compile --out DIR`` writes and
``Runtime.load(DIR)`` warm-starts from.

Layout::

    DIR/kiln-bundle.json   manifest: key factors, compilation config, file checksums
    DIR/compiled/          the compiled entry (split graph, artifacts, its manifest)
    DIR/inductor/          the compiled kernels the artifacts need (on CPU exactly
                           those the entry lists; on GPU the build's Inductor cache)
    DIR/model/             config, generation config, tokenizer, and with
                           --include-weights the weights (a GGUF: with
                           --include-weights the file, which holds all of them;
                           without, the manifest records where it is)

Every path inside is relative, so the directory can be moved, copied or mounted
read-only; whatever loading must write goes to a temporary directory.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.cache.store import MANIFEST, atomic_write_json, checksum_tree
from kiln.checkpoint import Checkpoint, CheckpointError, open_checkpoint
from kiln.version import __version__

__all__ = ["BUNDLE_MANIFEST", "Bundle", "BuildRecord", "read_bundle", "write_bundle"]

logger = logging.getLogger(__name__)

BUNDLE_MANIFEST = "kiln-bundle.json"
BUNDLE_COMPILED_DIR = "compiled"
BUNDLE_INDUCTOR_DIR = "inductor"
BUNDLE_MODEL_DIR = "model"
BUNDLE_FORMAT = 1


@dataclass(frozen=True)
class BuildRecord:
    """What ``kiln compile`` built, for ``write_bundle``: no engine, no KV cache."""

    entry: Path  # the compiled entry directory
    inductor_dir: Path  # an Inductor cache holding exactly the kernels the entry needs
    factors: dict[str, Any]
    compilation: dict[str, Any]  # the resolved compilation config
    dtype: str
    max_num_batched_tokens: int
    architecture: str
    checkpoint_format: str  # "hf" or "gguf"
    metadata_files: list[Path]  # config, generation config, tokenizer
    weight_files: list[Path]  # for a GGUF: the one file, which holds the config too
    weights_source: Path  # where the weights are, recorded for a bundle without them


@dataclass(frozen=True)
class Bundle:
    """A bundle read from disk."""

    path: Path
    manifest: dict[str, Any]

    @property
    def compiled_dir(self) -> Path:
        return self.path / BUNDLE_COMPILED_DIR

    @property
    def inductor_dir(self) -> Path:
        return self.path / BUNDLE_INDUCTOR_DIR

    @property
    def model_dir(self) -> Path:
        return self.path / BUNDLE_MODEL_DIR

    def checkpoint(self, weights_path: Path | None) -> Checkpoint:
        """The bundled model: config and tokenizer from the bundle, weights from
        it too, else from ``weights_path``, else from where they were when the
        bundle was built."""
        model = self.manifest["model"]
        gguf = model.get("format") == "gguf"
        if model["includes_weights"]:
            return open_checkpoint(self.model_dir / model["file"]) if gguf else open_checkpoint(self.model_dir)
        candidates = [c for c in (weights_path, Path(model["source"]) if model.get("source") else None) if c]
        for c in candidates:
            if gguf and c.is_dir():
                c = c / model["file"]
            if (gguf and c.is_file()) or (not gguf and c.is_dir() and any(c.glob("*.safetensors"))):
                return open_checkpoint(c) if gguf else open_checkpoint(self.model_dir, weights=c)
        tried = ", ".join(str(c) for c in candidates) or "nothing"
        raise CheckpointError(
            f"bundle {self.path} was built without weights and none were found (tried {tried}); "
            "pass weights_path= to Runtime.load, or rebuild with `kiln compile --include-weights`"
        )


def read_bundle(path: Path) -> Bundle | None:
    """The bundle at ``path``, or None when it is not a bundle."""
    f = path / BUNDLE_MANIFEST
    if not f.is_file():
        return None
    try:
        manifest = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f} is not a readable bundle manifest: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != BUNDLE_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise CheckpointError(f"{f}: bundle format {found!r}, this kiln reads {BUNDLE_FORMAT}")
    return Bundle(path, manifest)


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _copy_kernels(record: BuildRecord, dest: Path) -> None:
    """The kernel libraries the entry lists as needed (CPU), else (GPU: Triton
    binaries are not listed) the whole Inductor cache of the build."""
    kernels = json.loads((record.entry / MANIFEST).read_text()).get("kernels") or {}
    if not kernels:
        shutil.copytree(record.inductor_dir, dest, ignore=shutil.ignore_patterns("*.lock", "locks"))
        return
    for name in kernels:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(record.inductor_dir / name, dest / name)


def _fill(tmp: Path, record: BuildRecord, include_weights: bool) -> None:
    shutil.copytree(record.entry, tmp / BUNDLE_COMPILED_DIR, ignore=shutil.ignore_patterns("*.lock"))
    _copy_kernels(record, tmp / BUNDLE_INDUCTOR_DIR)
    model_dir = tmp / BUNDLE_MODEL_DIR
    model_dir.mkdir()
    for f in record.metadata_files + (record.weight_files if include_weights else []):
        shutil.copy2(f, model_dir / f.name)
    atomic_write_json(tmp / BUNDLE_MANIFEST, {
        "format": BUNDLE_FORMAT,
        "kiln_version": __version__,
        "created": time.time(),
        "factors": record.factors,
        "compilation": record.compilation,
        "dtype": record.dtype,
        "engine": {"max_num_batched_tokens": record.max_num_batched_tokens},
        "model": {
            "architecture": record.architecture,
            "format": record.checkpoint_format,
            "file": record.weight_files[0].name if record.checkpoint_format == "gguf" else None,
            "includes_weights": include_weights,
            "source": str(record.weights_source.resolve()),
        },
        "files": checksum_tree(tmp, skip=(BUNDLE_MANIFEST,)),
    })


def write_bundle(record: BuildRecord, out: Path, include_weights: bool) -> dict[str, Any]:
    """Write the bundle at ``out`` (which must not exist or be empty), whole or
    not at all. Returns a summary (sizes in bytes, seconds)."""
    t0 = time.perf_counter()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not empty; choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        _fill(tmp, record, include_weights)
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
