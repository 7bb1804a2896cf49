"""Compile once per machine: the automatic cache and prebuilt bundle entries.

``load_or_compile`` looks the model up by the hash of its cache factors. A valid
entry is loaded (no trace, no Inductor compile, no C++ build); a missing one is
compiled under a file lock, so that N processes cold-starting together compile
once and the others load; a corrupted one is rebuilt with a warning.

Inductor's own cache (compiled ``.so`` files, Triton binaries) is shared by every
entry under ``<cache_root>/inductor``: identical pieces of different models then
compile once. Entries stay where they were built: Inductor records absolute paths
of its cache in what it saves, so a relocatable bundle needs more than a copy.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

from kiln.cache.keys import cache_key, diff_factors
from kiln.cache.store import entry_lock, read_manifest, verify_entry
from kiln.compiler.artifacts import compiler_identity, current_vec_isa, inductor_settings, load_compiled, save_compiled
from kiln.compiler.backend import CompiledModel, CompileStats, compile_model
from kiln.config import CompilationConfig

__all__ = ["FactorMismatchError", "load_or_compile", "load_entry"]

logger = logging.getLogger(__name__)


class FactorMismatchError(ValueError):
    """A compiled entry (a bundle's) made for another torch, kiln, device or config."""

    def __init__(self, where: Path, diffs: list[tuple[str, Any, Any]]) -> None:
        lines = "\n".join(f"  {k}: built with {a!r}, this runtime has {b!r}" for k, a, b in diffs)
        super().__init__(
            f"{where} was compiled for a different setup; differing factors:\n{lines}\n"
            "Rebuild it with `kiln compile`, or load with on_mismatch='recompile' to compile into the user cache."
        )
        self.diffs = diffs


def _stats_from_manifest(manifest: dict[str, Any], loaded: int, source: str) -> CompileStats:
    saved = manifest.get("stats", {})
    return CompileStats(
        dynamo_traces=0,
        inductor_compiles=0,
        pieces=saved.get("pieces", len(manifest["pieces"])),
        unique_pieces=saved.get("unique_pieces", len(manifest["backends"])),
        artifacts_loaded=loaded,
        cache=source,
    )


def load_entry(
    entry: Path, model: nn.Module, max_num_tokens: int, *, factors: dict[str, Any], source: str,
    inductor_dir: Path, strict: bool = False, eager_impls: dict[str, Any] | None = None,
) -> tuple[CompiledModel, CompileStats] | None:
    """Load a verified entry; None when it is missing, fails its checksums or was
    made for other factors (``strict``: raise FactorMismatchError instead)."""
    manifest = read_manifest(entry)
    if manifest is None:
        return None
    bad = verify_entry(entry, manifest)
    if bad:
        logger.warning("compiled entry %s is corrupted (%s); it will be rebuilt", entry, ", ".join(bad[:4]))
        return None
    diffs = diff_factors(manifest.get("factors", {}), factors)
    if diffs and strict:
        raise FactorMismatchError(entry, diffs)
    if diffs:
        logger.warning("compiled entry %s was made for other factors (%s); it will be rebuilt",
                       entry, ", ".join(k for k, _, _ in diffs[:4]))
        return None
    t0 = time.perf_counter()
    compiled, loaded = load_compiled(entry, manifest, model, max_num_tokens, inductor_dir, eager_impls)
    stats = _stats_from_manifest(manifest, loaded, source)
    stats.phases["load_artifacts"] = round(time.perf_counter() - t0, 4)
    return compiled, stats


def load_or_compile(
    model: nn.Module,
    config: CompilationConfig,
    *,
    max_num_tokens: int,
    device: torch.device,
    factors: dict[str, Any],
    cache_root: Path,
    header: dict[str, Any] | None = None,
    eager_impls: dict[str, Any] | None = None,
) -> tuple[CompiledModel, CompileStats, Path]:
    """The compiled model from the automatic cache under ``cache_root``, compiling
    (once, under a lock) when the entry is missing or corrupted. Also returns the
    entry's directory."""
    key = cache_key(factors)
    root = cache_root / "compiled"
    root.mkdir(parents=True, exist_ok=True)
    entry = root / key
    inductor_dir = cache_root / "inductor"
    with entry_lock(root, key):
        rebuilt = (entry / "manifest.json").exists()
        found = load_entry(entry, model, max_num_tokens, factors=factors, source="hit",
                           inductor_dir=inductor_dir, eager_impls=eager_impls)
        if found is not None:
            return (*found, entry)
        # Built in place; the manifest, written last, is what makes it valid.
        shutil.rmtree(entry, ignore_errors=True)
        entry.mkdir(parents=True)
        with temporary_cache_dir(str(inductor_dir)), inductor_settings():
            compiled, stats, pristine = compile_model(
                model, config, max_num_tokens=max_num_tokens, device=device, eager_impls=eager_impls
            )
        saved_stats = {"pieces": stats.pieces, "unique_pieces": stats.unique_pieces,
                       "inductor_compiles": stats.inductor_compiles, "phases": stats.phases}
        save_compiled(entry, compiled, pristine, {
            **(header or {}), "key": key, "factors": factors, "created": time.time(), "stats": saved_stats,
            "vec_isa": current_vec_isa() if device.type == "cpu" else None,
            "cxx": compiler_identity() if device.type == "cpu" else None,
        })
    stats.cache = "rebuilt" if rebuilt else "miss"
    return compiled, stats, entry
