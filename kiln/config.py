"""Engine configuration: the bottom floor every other kiln module may import.

Holds the knobs a user can set (through ``Runtime.load(..., **overrides)`` or the
CLI), the optimization-level defaults, and where kiln keeps its files. It imports
nothing from the rest of kiln.
"""

from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_LEVEL",
    "cpu_capture_sizes",
    "default_capture_sizes",
    "CUDAGraphMode",
    "CUDAGraphSupport",
    "CompilationConfig",
    "EngineConfig",
    "SpeculativeConfig",
    "SUPPORTED_LEVELS",
    "default_cache_dir",
]

SUPPORTED_LEVELS = (0, 1, 2, 3)
DEFAULT_LEVEL = 2

class CUDAGraphMode(str, enum.Enum):
    """How a step may be replayed under graphs: CUDA graphs on a GPU, CPU call
    graphs (``kiln.graphs.cpu``, FULL_DECODE_ONLY at most) on a CPU."""

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


class CUDAGraphSupport(str, enum.Enum):
    """What an attention backend allows inside a captured CUDA graph.

    A backend whose kernels read host-side values that change per step (request
    counts, sequence lengths in Python lists) cannot sit inside a FULL graph; the
    dispatcher downgrades the mode to what the backend declares.
    """

    NEVER = "never"  # attention always runs outside graphs (PIECEWISE at most)
    UNIFORM_DECODE = "uniform_decode"  # FULL graphs only for one-token-per-request batches
    ALWAYS = "always"  # FULL graphs for any batch shape


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


# What each level turns on. Fields a user sets explicitly are never replaced.
_LEVEL_DEFAULTS: dict[int, dict[str, Any]] = {
    0: {"compile_sizes": [], "inductor_options": {}, "cudagraph_mode": CUDAGraphMode.NONE},
    1: {"compile_sizes": [], "inductor_options": {}, "cudagraph_mode": CUDAGraphMode.PIECEWISE},
    2: {"compile_sizes": [1, 2, 4, 8], "inductor_options": {},
        "cudagraph_mode": CUDAGraphMode.FULL_AND_PIECEWISE},
    3: {"compile_sizes": [1, 2, 4, 8], "inductor_options": {"max_autotune": True},
        "cudagraph_mode": CUDAGraphMode.FULL_AND_PIECEWISE},
}
DEFAULT_SPLITTING_OPS = ["kiln::attention"]
# On CPU an exact size pays only where the compiler rewrites small-batch linears
# (up to 4 tokens as reductions, ``kiln.compiler.gemv``); with kiln's C linear
# kernel the sizes from 2 on are one few-row runnable for 2 to 8 tokens
# (``kiln.compiler.pipeline._piece_jobs``; bench/results/compile-sizes-cpu-latest.json).
_CPU_COMPILE_SIZES = (1, 2, 4)


# CPU call graphs (kiln.graphs.cpu) replay whole uniform decode steps. Every
# size up to CPU_CAPTURE_MAX requests gets a graph of its own (the C linear
# kernel's few-row calls, kiln.compiler.cpu_linear.MAX_ROWS). Above it, one
# graph every CPU_CAPTURE_STEP requests up to CPU_CAPTURE_LARGEST, a step padded
# up to the next: where bf16 linears run on AMX tiles of 16 rows, a padding row
# in a tile costs next to nothing and a padding request attends to nothing. 56
# requests of the 135M shape in bf16, padded to 64: 35.0-35.7 ms a decode step
# against 39.6-39.7 ms without a graph, the same tokens (2 cores of an Intel
# Xeon, scratch A/B). A graph's step intermediates, about 0.49 MB a row for that
# shape, come from one arena all the graphs share (kiln.graphs.cpu.CaptureArena):
# 33.6 MB, the graph of 64's. A step of more requests than CPU_CAPTURE_LARGEST
# (the CPU default max_num_seqs) runs without one (its Python is a smaller part
# of it). Where a size's step does torch work (quantized linears of more than
# 8 rows go through oneDNN, and so do fp32 ones of more than 16 where the C
# kernel has no fp32 panels: AVX2) its capture is refused and the size dropped
# at its first step.
CPU_CAPTURE_MAX = 8
CPU_CAPTURE_STEP = 16
CPU_CAPTURE_LARGEST = 64


def cpu_capture_sizes(max_num_seqs: int) -> list[int]:
    """1 to ``CPU_CAPTURE_MAX``, then every multiple of ``CPU_CAPTURE_STEP`` up
    to ``CPU_CAPTURE_LARGEST``, never above ``max_num_seqs``; and
    ``max_num_seqs`` itself where it falls between two of those (a padded
    decode step never has more request rows than the buffers hold)."""
    top = min(max_num_seqs, CPU_CAPTURE_LARGEST)
    sizes = list(range(1, min(top, CPU_CAPTURE_MAX) + 1))
    sizes += list(range(CPU_CAPTURE_STEP, top + 1, CPU_CAPTURE_STEP))
    if top > CPU_CAPTURE_MAX and top not in sizes:
        sizes.append(top)
    return sizes


def _cpu_graph_mode(mode: CUDAGraphMode) -> CUDAGraphMode:
    """A mode as CPU call graphs serve it: whole uniform decode steps only
    (their attention is the C decode kernel's calls; other steps' is not
    recorded), so every FULL mode is FULL_DECODE_ONLY and PIECEWISE is NONE
    (a piece's Python is a small part of what a whole step's graph saves)."""
    if mode in (CUDAGraphMode.FULL, CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY):
        return CUDAGraphMode.FULL_DECODE_ONLY
    if mode is CUDAGraphMode.PIECEWISE:
        logger.info("CPU call graphs replay whole decode steps: cudagraph_mode PIECEWISE resolves to NONE on cpu")
    return CUDAGraphMode.NONE


def default_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to ``min(2 * max_num_seqs, 512)``,
    never above the step's token budget."""
    top = min(2 * max_num_seqs, 512, max_num_batched_tokens)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    return sizes


def _sizes(name: str, sizes: Any) -> tuple[int, ...]:
    if isinstance(sizes, (str, bytes, dict, set)) or not isinstance(sizes, (list, tuple)) or any(
        isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes
    ):
        raise ValueError(f"{name} must be a list of positive token counts, got {sizes!r}")
    return tuple(sorted(set(sizes)))


@dataclass(frozen=True)
class CompilationConfig:
    """What the compiler does at a given optimization level.

    Fields left as ``None`` take the level's default when ``resolve`` runs; a
    field the user set keeps the user's value whatever the level.

    | level | compile                             | CUDA graphs (GPU)   | CPU call graphs  |
    |-------|-------------------------------------|---------------------|------------------|
    | 0     | none (eager)                        | NONE                | NONE             |
    | 1     | piecewise, dynamic range only       | PIECEWISE           | NONE             |
    | 2     | piecewise, exact sizes + range      | FULL_AND_PIECEWISE  | FULL_DECODE_ONLY |
    | 3     | as 2, plus Inductor autotuning      | FULL_AND_PIECEWISE  | FULL_DECODE_ONLY |

    On CPU the graph modes are served by CPU call graphs (``kiln.graphs.cpu``):
    decode steps replay their recorded native calls, each size up to
    ``CPU_CAPTURE_MAX`` requests on its own graph and larger steps, up to
    ``CPU_CAPTURE_LARGEST``, padded to a multiple of ``CPU_CAPTURE_STEP``
    (``cpu_capture_sizes``).
    """

    level: int = DEFAULT_LEVEL
    compile_sizes: tuple[int, ...] | None = None
    splitting_ops: tuple[str, ...] | None = None
    inductor_options: dict[str, Any] | None = None
    cudagraph_mode: CUDAGraphMode | None = None
    cudagraph_capture_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.level, bool) or self.level not in SUPPORTED_LEVELS:
            raise ValueError(
                f"optimization_level={self.level!r} is not one of {list(SUPPORTED_LEVELS)}"
            )
        # Normalised in place once, here, before anyone can see the object.
        if self.cudagraph_mode is not None:
            object.__setattr__(self, "cudagraph_mode", CUDAGraphMode.parse(self.cudagraph_mode))
        for name in ("compile_sizes", "cudagraph_capture_sizes"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _sizes(name, getattr(self, name)))
        if self.splitting_ops is not None:
            if isinstance(self.splitting_ops, str) or not all(isinstance(o, str) for o in self.splitting_ops):
                raise ValueError(f"splitting_ops must be a list of 'namespace::op' names, got {self.splitting_ops!r}")
            object.__setattr__(self, "splitting_ops", tuple(self.splitting_ops))
        if self.inductor_options is not None and not isinstance(self.inductor_options, dict):
            raise ValueError(f"inductor_options must be a dict, got {self.inductor_options!r}")

    def resolve(
        self, *, device_type: str, max_num_seqs: int, max_num_batched_tokens: int
    ) -> "CompilationConfig":
        """A copy with every field filled: the user's values, else the level's."""
        d = _LEVEL_DEFAULTS[self.level]
        compile_sizes = self.compile_sizes if self.compile_sizes is not None else d["compile_sizes"]
        if self.compile_sizes is None and device_type == "cpu":
            compile_sizes = [s for s in compile_sizes if s in _CPU_COMPILE_SIZES]
        mode = self.cudagraph_mode if self.cudagraph_mode is not None else d["cudagraph_mode"]
        capture = self.cudagraph_capture_sizes
        if device_type == "cpu":
            mode = _cpu_graph_mode(mode)
            if capture is None:
                capture = cpu_capture_sizes(max_num_seqs)
        elif device_type != "cuda" and mode is not CUDAGraphMode.NONE:
            logger.info("CUDA graphs need a GPU: cudagraph_mode %s resolves to NONE on %s", mode.value, device_type)
            mode = CUDAGraphMode.NONE
        if capture is None:
            capture = default_capture_sizes(max_num_seqs, max_num_batched_tokens)
        return CompilationConfig(
            level=self.level,
            compile_sizes=tuple(s for s in compile_sizes if s <= max_num_batched_tokens),
            splitting_ops=tuple(self.splitting_ops or DEFAULT_SPLITTING_OPS),
            inductor_options={**d["inductor_options"], **(self.inductor_options or {})},
            cudagraph_mode=mode,
            cudagraph_capture_sizes=tuple(s for s in capture if s <= max_num_batched_tokens),
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: what the startup report shows and cache keys hash."""
        def listed(v: tuple[Any, ...] | None) -> list[Any] | None:
            return None if v is None else list(v)

        return {
            "level": self.level,
            "compile_sizes": listed(self.compile_sizes),
            "splitting_ops": listed(self.splitting_ops),
            "inductor_options": self.inductor_options,
            "cudagraph_mode": self.cudagraph_mode.value if self.cudagraph_mode else None,
            "cudagraph_capture_sizes": listed(self.cudagraph_capture_sizes),
        }


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding by prompt lookup (vLLM's ``"ngram"`` method, what
    llama.cpp calls lookup decoding): after each step, the longest n-gram
    (``prompt_lookup_min`` to ``prompt_lookup_max`` tokens) that ends a
    request's tokens is looked for earlier in its prompt and output, and the
    up to ``num_speculative_tokens`` tokens that followed it there are run
    with the next step as drafts; the step's logits keep the drafts the model
    would have picked, and give one more token (``kiln.engine.speculative``).
    Greedy requests only: their tokens are the ones plain decoding gives.
    ``disable_by_batch_size``: no drafts while more requests than this are
    running or waiting (vLLM's field): a large batch's step is bound by its
    arithmetic, which every draft row adds to."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        where = "speculative_config"
        if self.method != "ngram":
            raise ValueError(f"{where}.method must be 'ngram' (prompt lookup), got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            value = getattr(self, name)
            if name == "disable_by_batch_size" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}.{name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"{where}.prompt_lookup_min={self.prompt_lookup_min} exceeds "
                             f"prompt_lookup_max={self.prompt_lookup_max}")

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """``value`` as a SpeculativeConfig: one already, a dict of its fields
        (vLLM's ``speculative_config``), its JSON text, or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict of {[f.name for f in fields(cls)]}, got {value!r}")
        unknown = set(value) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {sorted(unknown)}; known: "
                             f"{[f.name for f in fields(cls)]}")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class EngineConfig:
    """The engine sizes a user may set: the scheduler's budgets and the KV cache's
    shape. ``None`` means "derive at load time" from the checkpoint and the memory
    budget (see ``kiln.engine.config.resolve_config``)."""

    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    enable_prefix_caching: bool = True
    # SpeculativeConfig, or what SpeculativeConfig.parse takes (a dict, its JSON); None: no speculation
    speculative_config: Any = None

    DEFAULT_MAX_NUM_SEQS = 64
    DEFAULT_MAX_NUM_SEQS_CUDA = 256
    DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
    DEFAULT_BLOCK_SIZE = 16
    # CPU has no fixed accelerator memory; this is what the KV cache takes by default.
    DEFAULT_CPU_KV_BYTES = 2 << 30

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                     "num_kv_blocks", "kv_cache_memory_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        g = self.gpu_memory_utilization
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0.0 < g <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {g!r}")
