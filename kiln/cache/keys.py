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
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["cache_factors", "cache_key", "diff_factors", "kiln_source_hash", "environment_factors"]


# The sources that shape compiled code: the model, its attention op, the compiler
# and what they read. The CLI, scheduler or sampler can change without
# invalidating every compiled entry.
_COMPILED_SOURCES = ("config.py", "forward_context.py", "runtime/model.py", "kernels", "compiler")


@functools.lru_cache(maxsize=1)
def kiln_source_hash() -> str:
    """sha256 over the kiln sources that compiled code depends on."""
    root = Path(__file__).resolve().parent.parent
    files: list[Path] = []
    for name in _COMPILED_SOURCES:
        p = root / name
        files.extend(sorted(p.rglob("*.py")) if p.is_dir() else [p])
    h = hashlib.sha256()
    for path in files:
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _triton_version() -> str | None:
    try:
        import triton
    except Exception:  # not installed, or broken on this platform
        return None
    return str(triton.__version__)


def environment_factors(device: torch.device) -> dict[str, Any]:
    from kiln import __version__

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        device_factors = {"kind": "cuda", "name": props.name, "capability": f"{props.major}.{props.minor}",
                          "cuda": torch.version.cuda}
    else:
        device_factors = {"kind": "cpu", "isa": torch.backends.cpu.get_cpu_capability(), "machine": platform.machine()}
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
