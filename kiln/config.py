"""Engine configuration: the bottom floor every other kiln module may import.

Holds the knobs a user can set (through ``Runtime.load(..., **overrides)`` or the
CLI), the optimization-level defaults, and where kiln keeps its files. It imports
nothing from the rest of kiln.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

__all__ = [
    "CUDAGraphMode",
    "CompilationConfig",
    "EngineConfig",
    "SUPPORTED_LEVELS",
    "WORKING_LEVELS",
    "default_cache_dir",
]

SUPPORTED_LEVELS = (0, 1, 2, 3)
# Levels that run today. The compiler issue turns 1..3 on.
WORKING_LEVELS = (0,)


class CUDAGraphMode(str, enum.Enum):
    """How a step may be replayed under CUDA graphs (GPU only)."""

    NONE = "NONE"
    PIECEWISE = "PIECEWISE"
    FULL = "FULL"
    FULL_DECODE_ONLY = "FULL_DECODE_ONLY"
    FULL_AND_PIECEWISE = "FULL_AND_PIECEWISE"

    @classmethod
    def parse(cls, value: "CUDAGraphMode | str") -> "CUDAGraphMode":
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).upper())
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            raise ValueError(f"cudagraph_mode={value!r} is not one of {choices}") from None


def default_cache_dir() -> Path:
    """kiln's cache directory: ``KILN_CACHE_DIR``, else ``$XDG_CACHE_HOME/kiln``,
    else ``~/.cache/kiln``."""
    env = os.environ.get("KILN_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "kiln"
    return Path.home() / ".cache" / "kiln"


@dataclass
class CompilationConfig:
    """What the compiler does at a given optimization level.

    Fields left as ``None`` take the level's default; a field the user set keeps
    the user's value whatever the level.
    """

    level: int = 0
    compile_sizes: list[int] | None = None
    splitting_ops: list[str] | None = None
    inductor_options: dict[str, Any] | None = None
    cudagraph_mode: CUDAGraphMode | None = None
    cudagraph_capture_sizes: list[int] | None = None

    def __post_init__(self) -> None:
        if self.level not in SUPPORTED_LEVELS:
            raise ValueError(
                f"optimization_level={self.level!r} is not one of {list(SUPPORTED_LEVELS)}"
            )
        if self.level not in WORKING_LEVELS:
            raise ValueError(
                f"optimization level -O{self.level} is not available yet: the compiler is not "
                "built in this version of kiln. Use -O0 (optimization_level=0), the eager "
                "runtime, which is the working level."
            )
        if self.cudagraph_mode is not None:
            self.cudagraph_mode = CUDAGraphMode.parse(self.cudagraph_mode)
        for name in ("compile_sizes", "cudagraph_capture_sizes"):
            sizes = getattr(self, name)
            if sizes is not None:
                if any(int(s) < 1 for s in sizes):
                    raise ValueError(f"{name} must hold positive token counts, got {sizes!r}")
                setattr(self, name, sorted({int(s) for s in sizes}))


@dataclass
class EngineConfig:
    """Sizes of the engine: the scheduler's budgets and the KV cache's shape.

    ``None`` means "derive at load time" (from the checkpoint and the memory
    budget); ``resolve`` fills them in.
    """

    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    seed: int = 0

    DEFAULT_MAX_NUM_SEQS = 64
    DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
    DEFAULT_BLOCK_SIZE = 16
    # CPU has no fixed accelerator memory; this is what the KV cache takes by default.
    DEFAULT_CPU_KV_BYTES = 2 << 30

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("gpu_memory_utilization", "seed") or value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{f.name} must be a positive integer, got {value!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
