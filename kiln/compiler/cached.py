"""Compile once per machine: the automatic cache and prebuilt bundle entries.

``load_or_compile`` looks the model up by the hash of its cache factors. A valid
entry is loaded without taking any lock (reading needs none; a read-only cache
works); a missing one is compiled under a file lock, so that N processes
cold-starting together compile once and the others load; a corrupted one is
rebuilt with a warning. A cache directory that cannot be written is used for
reading only: a miss there compiles into a private temporary cache, with a
warning, and nothing persists.

Inductor's own cache (compiled kernel libraries, Triton binaries) is shared by
every entry under ``<cache_root>/inductor``: identical pieces of different models
then compile once. Each entry's manifest lists, with checksums, the kernel
libraries it needs there; one that is missing or altered is rebuilt by Inductor
at load (which needs the C++ compiler), reported as ``kernels_rebuilt`` and a
``repaired`` cache state, and the manifest is brought up to date.
"""

from __future__ import annotations

import logging
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.attention.cpu_attention import KernelBuildError, CpuAttentionKernel, build_cpu_attention
from kiln.cache.keys import cache_key
from kiln.cache.lookup import FactorMismatchError, usable_manifest
from kiln.cache.store import (
    MANIFEST,
    atomic_write_json,
    entry_lock,
    private_copy,
    verify_kernels,
    writable,
)
from kiln.compiler import cpu_linear
from kiln.compiler.artifacts import inductor_settings, load_compiled, replay_in_place, save_compiled
from kiln.compiler.pipeline import CompiledModel, CompileStats, compile_traced, trace_model
from kiln.compiler.toolchain import (
    ToolchainWarmup, checksum_kernels, compiler_identity, kernel_files, recorded_vec_isa, trusted_prediction,
    vec_isa_record,
)
from kiln.config import CompilationConfig

__all__ = ["CompiledEntry", "FactorMismatchError", "load_entry", "load_or_compile"]

logger = logging.getLogger(__name__)


@dataclass
class CompiledEntry:
    """A compiled model and where it came from."""

    model: CompiledModel
    stats: CompileStats
    entry: Path  # the entry directory
    inductor_dir: Path  # the Inductor cache its kernels live in


def _stats_from_manifest(manifest: dict[str, Any], loaded: int, source: str) -> CompileStats:
    saved = manifest.get("stats", {})
    return CompileStats(
        pieces=saved.get("pieces", len(manifest["piece_signatures"])),
        unique_pieces=saved.get("unique_pieces", len(manifest["pieces"])),
        artifacts_loaded=loaded,
        cache=source,
    )


def load_entry(
    entry: Path, model: nn.Module, max_num_tokens: int, *, factors: dict[str, Any], source: str,
    inductor_dir: Path, strict: bool = False, eager_impls: dict[str, Any] | None = None,
    lock_free: bool = False, update_manifest: bool = False,
) -> CompiledEntry | None:
    """Load a verified entry; None when it is missing, fails its checksums or was
    made for other factors (``strict``: raise FactorMismatchError instead).

    Kernel libraries missing from ``inductor_dir`` or altered there are removed
    and rebuilt by Inductor while loading, and ``update_manifest`` records the
    rebuilt ones' checksums (the caller holds the entry's lock). ``lock_free``:
    the caller holds no lock, so return None quietly for anything that needs a
    rebuild or a repair."""
    manifest, problem = usable_manifest(entry, factors, strict)
    if manifest is None:
        if problem and not lock_free:
            logger.warning("%s", problem)
        return None
    kernels: dict[str, str] = manifest.get("kernels", {})
    damaged = verify_kernels(inductor_dir, kernels)
    if damaged and lock_free:
        return None
    if damaged:
        logger.warning(
            "%d of the %d compiled kernels entry %s needs are missing or altered in %s (%s); "
            "Inductor rebuilds them now, which needs a C++ compiler and takes a while",
            len(damaged), len(kernels), entry.name, inductor_dir, ", ".join(damaged[:3]),
        )
        for name in damaged:
            (inductor_dir / name).unlink(missing_ok=True)
    t0 = time.perf_counter()
    compiled, loaded, how = load_compiled(entry, manifest, model, max_num_tokens, inductor_dir, eager_impls,
                                          kernels_built=not damaged)
    stats = _stats_from_manifest(manifest, loaded, "repaired" if damaged else source)
    stats.kernels_rebuilt = len(damaged)
    stats.artifact_loader = how
    stats.phases["load_artifacts"] = round(time.perf_counter() - t0, 4)
    if damaged and update_manifest:
        # a library Inductor did not write again (it had it in memory) keeps its old checksum
        rebuilt = {**kernels, **checksum_kernels(inductor_dir, list(kernels))}
        atomic_write_json(entry / MANIFEST, {**manifest, "kernels": rebuilt})
    return CompiledEntry(compiled, stats, entry, inductor_dir)


class _NativeBuilds:
    """kiln's C kernels for a CPU entry, built in a thread while the model is
    traced: the attention kernels (``kiln.attention.cpu_attention``, 2 s
    of gcc here) and the small-batch linear kernel (``kiln.compiler.cpu_linear``,
    2-3 s with the kinds ``model``'s linears use, 7 s with all). On two cores
    they share the CPU with the trace, so their seconds count. A failed build
    is logged once and leaves the entry without that kernel: the torch path
    serves attention, and the few-token pieces keep Inductor's
    reductions, slower."""

    def __init__(self, inductor_dir: Path, model: nn.Module) -> None:
        self.inductor_dir = inductor_dir
        self.names: dict[str, str | None] = {"attention_kernel": None, "linear_kernel": None}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-native-build")
        self._attention = self._pool.submit(build_cpu_attention, inductor_dir)
        self._linear = self._pool.submit(cpu_linear.build, inductor_dir, cpu_linear.model_kinds(model))

    def attention(self) -> CpuAttentionKernel | None:
        name = self._wait(self._attention, "attention_kernel", "CPU attention will run on the torch path")
        return CpuAttentionKernel(self.inductor_dir / name) if name else None

    def linear(self) -> cpu_linear.CpuLinearKernel | None:
        name = self._wait(self._linear, "linear_kernel", "few-token linears will run as Inductor's reductions")
        return cpu_linear.load(self.inductor_dir / name) if name else None

    def _wait(self, future: Any, field: str, fallback: str) -> str | None:
        try:
            self.names[field] = future.result()
        except (KernelBuildError, OSError) as e:
            logger.warning("%s: %s", fallback, e)
        return self.names[field]

    def close(self) -> None:
        self._pool.shutdown()


def _vec_isa(warmup: ToolchainWarmup, linear_kernel: cpu_linear.CpuLinearKernel | None) -> dict[str, Any]:
    """The ISA record the entry is built for: the warm-up's prediction where
    the C linear kernel's build vouches for it (no probe builds: 9 CPU-seconds
    saved here, 8.5 s of a cold load on an Intel Xeon with AMX), else
    Inductor's probe."""
    kernel = ((linear_kernel.isa, linear_kernel.vnni, linear_kernel.amx_target, linear_kernel.amx_fp16_target)
              if linear_kernel is not None else (None, False, False, False))
    if warmup.predicted is not None and trusted_prediction(warmup.predicted, *kernel):
        return warmup.predicted
    logger.info("probing the C++ compiler's vector ISA (predicted %s, the C linear kernel built for %s)",
                (warmup.predicted or {}).get("name"), kernel[0])
    return vec_isa_record()


def _build_entry(
    entry: Path, key: str, model: nn.Module, config: CompilationConfig, *, max_num_tokens: int,
    device: torch.device, factors: dict[str, Any], inductor_dir: Path, header: dict[str, Any],
    eager_impls: dict[str, Any] | None,
) -> CompiledEntry:
    """Compile into ``entry`` (the caller holds its lock); the manifest, written
    last, is what makes it valid."""
    from torch._inductor import config as inductor_config
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    shutil.rmtree(entry, ignore_errors=True)
    entry.mkdir(parents=True)
    cpu = device.type == "cpu"
    # On CPU each graph is one C++ file, built in the compiling process (Inductor's
    # build threads add nothing, and would not survive the forks of parallel jobs).
    single = {"compile_threads": 1} if cpu else {}
    with temporary_cache_dir(str(inductor_dir)), inductor_settings(), inductor_config.patch(single):
        warmup = ToolchainWarmup(device.type)  # ISA predicted; C++ header built beside the trace
        native = _NativeBuilds(inductor_dir, model) if cpu else None  # beside the trace too
        try:
            traced = trace_model(model, config, device)
            t0 = time.perf_counter()
            attention_kernel = native.attention() if native else None
            linear_kernel = native.linear() if native else None
            # Asked before kernels are recorded: an ISA probe's test builds are not kernels.
            toolchain = {"vec_isa": _vec_isa(warmup, linear_kernel) if cpu else None,
                         "cxx": compiler_identity() if cpu else None}
            # the wait for kiln's C kernels and the ISA answer, between the trace and the compile
            traced.phases["toolchain"] = round(time.perf_counter() - t0, 4)
            with kernel_files(inductor_dir) as kernels, recorded_vec_isa(toolchain["vec_isa"]):
                compiled, stats = compile_traced(
                    traced, model, config, max_num_tokens=max_num_tokens, device=device, eager_impls=eager_impls,
                    attention_kernel=attention_kernel, linear_kernel=linear_kernel,
                )
        finally:
            warmup.join()
            if native:
                native.close()
        libraries = native.names if native else {}
        saved_stats = {"pieces": stats.pieces, "unique_pieces": stats.unique_pieces,
                       "inductor_compiles": stats.inductor_compiles, "phases": stats.phases,
                       "compile_seconds": stats.compile_seconds, "compile_workers": stats.compile_workers}
        # Saved with Inductor configured as for the build, ISA included: exporting the
        # CPU artifacts' code (kiln.compiler.replay) asks it for the kernel libraries it built.
        with recorded_vec_isa(toolchain["vec_isa"]):
            manifest = save_compiled(entry, compiled, traced.pristine, {
                **header, "key": key, "factors": factors, "created": time.time(), "stats": saved_stats,
                "toolchain": toolchain, **libraries,
                "kernels": checksum_kernels(inductor_dir, kernels | {n for n in libraries.values() if n}),
            }, replay_from=inductor_dir if cpu else None)
    if cpu and replay_in_place(entry, manifest, compiled, inductor_dir):
        stats.artifact_loader = "replay"
    return CompiledEntry(compiled, stats, entry, inductor_dir)


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
) -> CompiledEntry:
    """The compiled model from the automatic cache under ``cache_root``, compiling
    (once, under a lock) when the entry is missing or corrupted."""
    key = cache_key(factors)
    entry = cache_root / "compiled" / key
    load = dict(factors=factors, eager_impls=eager_impls)
    if not writable(cache_root / "compiled") or not writable(cache_root / "inductor"):
        inductor = private_copy(cache_root / "inductor", "kiln-inductor-")
        found = load_entry(entry, model, max_num_tokens, source="hit", inductor_dir=inductor, **load)
        if found is not None:
            return found
        cache_root = private_copy(None, "kiln-cache-")
        logger.warning("kiln's cache %s is read-only and holds no entry for this model: compiling into "
                       "the temporary cache %s, which is removed at exit", entry.parent.parent, cache_root)
        entry = cache_root / "compiled" / key
    inductor = cache_root / "inductor"
    found = load_entry(entry, model, max_num_tokens, source="hit", inductor_dir=inductor, lock_free=True, **load)
    if found is not None:
        return found
    with entry_lock(cache_root / "compiled", key):
        rebuilt = (entry / MANIFEST).exists()
        found = load_entry(entry, model, max_num_tokens, source="hit", inductor_dir=inductor,
                           update_manifest=True, **load)
        if found is not None:
            return found
        built = _build_entry(entry, key, model, config, max_num_tokens=max_num_tokens, device=device,
                             factors=factors, inductor_dir=inductor, header=header or {}, eager_impls=eager_impls)
    built.stats.cache = "rebuilt" if rebuilt else "miss"
    return built
