"""What a compiled entry depends on, and the key derived from it.

A factor is anything that changes the compiled code: the model's architecture
fields and dtype, the compilation config, kiln (version and a hash of its own
source), torch (version and build), triton, the device (GPU name and compute
capability, or the CPU's vector ISA) and Python. Paths, the tokenizer and weight
values are not factors: weights are graph inputs, not constants.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch

from kiln.version import __version__

__all__ = ["cache_factors", "cache_key", "cpu_features", "diff_factors", "environment_factors", "kiln_source_hash"]


# The modules and packages whose source shapes compiled code: the models, the
# attention op they call, the compiler and what they read. The engine, the
# attention backends or the CLI can change without invalidating every entry.
_COMPILED_SOURCES = ("kiln.config", "kiln.forward_context", "kiln.models", "kiln.attention.op", "kiln.compiler")
# other files compiled into an entry: (package, file) -- the C sources of kiln's CPU kernels
_COMPILED_FILES = (("kiln.attention", "cpu_attention.c"), ("kiln.compiler", "cpu_linear.c"))


def _source_files(module_name: str) -> list[tuple[str, Path]]:
    """(name, file) for a module, or for every module of a package, found
    without importing them (``kiln.compiler`` imports Dynamo, which a cache
    lookup at an eager start must not pay for)."""
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"kiln's own module {module_name} is missing from the installation")
    if spec.submodule_search_locations is None:
        return [(module_name, Path(spec.origin))]
    out = []
    for root in map(Path, spec.submodule_search_locations):
        for f in sorted(root.rglob("*.py")):
            rel = f.relative_to(root).with_suffix("").as_posix().replace("/", ".")
            out.append((f"{module_name}.{rel}", f))
    return out


@functools.lru_cache(maxsize=1)
def kiln_source_hash() -> str:
    """sha256 over the kiln sources that compiled code depends on, named by
    module (not by path: a moved install keeps its key), and the C source of
    the decode-attention kernel an entry carries."""
    h = hashlib.sha256()
    for name in _COMPILED_SOURCES:
        for module, path in _source_files(name):
            h.update(module.encode())
            h.update(path.read_bytes())
    for package, file in _COMPILED_FILES:
        spec = importlib.util.find_spec(package)
        path = Path(next(iter(spec.submodule_search_locations or []), "")) / file if spec else Path(file)
        if not path.is_file():
            raise RuntimeError(f"kiln's own file {package}/{file} is missing from the installation")
        h.update(f"{package}/{file}".encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _x86_features() -> list[str]:
    """The x86 extensions Inductor's ISA checker looks for (its own list, read
    the same way, without importing Inductor)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    cpu = torch.cpu
    avx512 = cpu._is_avx512_supported()
    found = {"avx2": cpu._is_avx2_supported(), "avx512": avx512, "avx512_vnni": avx512 and cpu._is_vnni_supported(),
             "amx_tile": cpu._is_amx_tile_supported()}
    return sorted(name for name, present in found.items() if present)


def cpu_features() -> dict[str, Any]:
    """The CPU features Inductor's vector ISA choice depends on, read from the CPU
    without a build: an entry's recorded ISA is replayed only where they match."""
    return {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "x86": _x86_features(),
        "avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
        "amx_fp16": bool(torch.cpu._is_amx_fp16_supported()),
        "machine": platform.machine(),
    }


def _triton_version() -> str | None:
    """The installed Triton's version, read from its metadata: importing Triton
    takes a while and an eager start does not need it."""
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def environment_factors(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        device_factors = {"kind": "cuda", "name": props.name, "capability": f"{props.major}.{props.minor}",
                          "cuda": torch.version.cuda}
    else:
        device_factors = {"kind": "cpu", **cpu_features()}
    return {
        "kiln_version": __version__,
        "kiln_source": kiln_source_hash(),
        "torch_version": torch.__version__,
        "torch_build": torch.version.git_version,
        "triton_version": _triton_version(),
        "device": device_factors,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}",
    }


def cache_factors(
    model_fields: dict[str, Any], dtype: torch.dtype, compilation: dict[str, Any], device: torch.device
) -> dict[str, Any]:
    factors = {
        "model": model_fields,
        "dtype": str(dtype).removeprefix("torch."),
        # CUDA graph settings are applied at load, not compiled in
        "compilation": {k: v for k, v in compilation.items() if not k.startswith("cudagraph")},
        **environment_factors(device),
    }
    # the JSON form is the canonical one: it is what an entry stores and compares
    return json.loads(json.dumps(factors, sort_keys=True, default=str))


def cache_key(factors: dict[str, Any]) -> str:
    blob = json.dumps(factors, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: d}


def diff_factors(stored: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(factor, stored value, current value) for every factor that differs."""
    a, b = _flatten(stored), _flatten(current)
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
