"""Greedy decode benchmark: kiln against transformers, eager and compiled.

Run from the repository root::

    python -m bench.decode                      # SmolLM2-135M shape, random fp32 weights, CPU
    python -m bench.decode --model DIR --max-tokens 64 --repeats 5 --threads 2
    python -m bench.decode --shape qwen3-0.6b --device cuda --dtype bfloat16 --levels 0,1,2
    python -m bench.decode --shape qwen3-0.6b --device cuda --throughput 64   # 64 requests at once

Two modes, on the same checkpoint, dtype and prompt(s):

**Batch 1** (the default): one greedy request at a time.

* kiln's decode rate (tokens/s, prefill excluded) at each optimization level in
  ``--levels`` (one row per level, default -O0 and -O2; a level kiln refuses to
  load is recorded as unavailable), and its cold start (load, trace and compile
  into an empty compile cache, and on CUDA the CUDA graph capture);
* each baseline's decode rate (``--baselines``: transformers ``generate`` eager,
  and with a static cache under ``torch.compile``, whose compile time is reported);
* kiln's per-step CPU time outside the model (runner prepare, sampler, and the
  rest of the engine step: scheduler, bookkeeping, streaming).

**Throughput** (``--throughput N``): N requests of ``--prompt-len`` (default 128)
prompt and ``--max-tokens`` (default 128) output tokens submitted at once: kiln
through ``Runtime.generate`` (continuous batching, ``max_num_seqs`` N), the
baselines through one batched ``generate`` with left padding. The figure is
output tokens over the wall time of the whole batch, prefill included.

Both modes record, per kiln level, the CUDA graph figures of its
``startup_report`` (``cudagraph_mode``, ``cudagraphs_captured``,
``cudagraph_capture_seconds``, ``cudagraph_memory_bytes``, when kiln reports
them) and, on CUDA, the device memory its load took.

Models (``--shape``, each built once with random weights in kiln's cache
directory, ``bench-models/``): ``smollm2-135m`` (the default; fp32),
``qwen3-0.6b`` (Qwen3-0.6B's config, q/k RMSNorm, tied embeddings; bf16) and
``qwen3-tiny`` (the same architecture, 2 layers of width 64: for smoke tests of
this script only). ``--model DIR`` runs any checkpoint instead.

It prints a table and writes JSON to ``bench/results/decode-<device>-<timestamp>.json``
and ``bench/results/decode-<device>-latest.json`` (throughput:
``decode-throughput-<device>-...``).

Adding an optimization level needs nothing here but ``--levels``. Adding a
baseline means writing an :class:`Engine` subclass (see :class:`TransformersEngine`)
and registering it in :data:`BASELINES` (batch 1) or
:data:`THROUGHPUT_BASELINES`; its ``summary`` dict becomes its entry under
``baselines`` in the JSON.

Each engine is set up in turn (loaded, then warmed up once: kiln compiles while
loading, ``torch.compile`` during the warm-up), eager engines first; then the
engines take turns (one timed run each per round) so that background load on a
shared machine hits them alike; each row also reports the spread of its runs.
An engine that fails to load, warm up or run is recorded with its error and the
others go on; ``--time-budget`` skips the set-ups, and the rounds after the
first, that would start after the budget is spent. The exit status is 1 when
any engine was not measured; the JSON is written all the same.

On CUDA the compiled transformers baseline is transformers' own GPU recipe: a
static cache, and ``generate`` compiling the decode step itself (mode
``reduce-overhead``, i.e. with CUDA graphs); see :func:`setup_static_compile`.
"""

from __future__ import annotations

import abc
import argparse
import dataclasses
import datetime as dt
import gc
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("bench.decode")

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUT_DIR = BENCH_DIR / "results"
DEFAULT_MODEL_NAME = "smollm2-135m-shape"
REFERENCE_BASELINE = "transformers"  # speedups and token checks are against this one

# The shape of HuggingFaceTB/SmolLM2-135M, with random weights: no download needed.
SMOLLM2_135M_SHAPE: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
    "hidden_act": "silu",
    "bos_token_id": 0,
    "eos_token_id": 0,
}
# The shape of Qwen/Qwen3-0.6B (its config.json), with random weights.
QWEN3_0_6B_SHAPE: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 28,
    "initializer_range": 0.02,
    "hidden_act": "silu",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
# Qwen3's architecture at a toy size: for smoke tests of this script, not for numbers.
QWEN3_TINY_SHAPE: dict[str, Any] = {
    **QWEN3_0_6B_SHAPE,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "max_window_layers": 2,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
MODEL_SEED = 0


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A benchmark model: a transformers config, built with random weights."""

    dir_name: str  # under <kiln cache>/bench-models
    config_class: str
    model_class: str
    config: dict[str, Any]
    dtype: str  # the checkpoint's dtype, and the benchmark's default
    note: str


SHAPES: dict[str, ModelShape] = {
    "smollm2-135m": ModelShape(DEFAULT_MODEL_NAME, "LlamaConfig", "LlamaForCausalLM", SMOLLM2_135M_SHAPE,
                               "float32", "the shape of HuggingFaceTB/SmolLM2-135M"),
    "qwen3-0.6b": ModelShape("qwen3-0.6b-shape", "Qwen3Config", "Qwen3ForCausalLM", QWEN3_0_6B_SHAPE,
                             "bfloat16", "the shape of Qwen/Qwen3-0.6B"),
    "qwen3-tiny": ModelShape("qwen3-tiny-shape", "Qwen3Config", "Qwen3ForCausalLM", QWEN3_TINY_SHAPE,
                             "bfloat16", "Qwen3's architecture at a toy size (smoke tests only)"),
}
DEFAULT_SHAPE = "smollm2-135m"


# --------------------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class BenchSettings:
    """What every measured engine shares."""

    max_tokens: int
    repeats: int
    device: str
    dtype: str
    attention_backend: str | None = None  # kiln's; None: its default (KILN_ATTENTION_BACKEND, else auto)
    kiln_cache_dir: Path | None = None  # None: a fresh, empty compile cache per kiln engine (cold starts)
    max_num_batched_tokens: int | None = None  # kiln's step token budget; None: its default

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


# ----------------------------------------------------------------------------- model


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """Return the directory of the SmolLM2-135M-shaped checkpoint, building it first
    if it is not there yet (see :func:`ensure_shape_model`)."""
    return ensure_shape_model(DEFAULT_SHAPE, cache_dir)


def ensure_shape_model(shape_name: str, cache_dir: Path | None = None) -> Path:
    """Return the directory of the checkpoint of ``SHAPES[shape_name]``, building
    it first (random weights, ``torch.manual_seed(MODEL_SEED)``) if it is not
    there yet.

    It lives in ``<kiln cache>/bench-models/<dir_name>``. It is built in a
    temporary sibling directory and moved into place with ``os.replace``, so a
    half-built model is never found there.
    """
    shape = SHAPES[shape_name]
    if cache_dir is None:
        from kiln.config import default_cache_dir

        cache_dir = default_cache_dir()
    target = Path(cache_dir) / "bench-models" / shape.dir_name
    if target.exists():
        if not (target / "config.json").is_file() or not any(target.glob("*.safetensors")):
            raise RuntimeError(
                f"{target} exists but holds no complete checkpoint; remove it and run again"
            )
        logger.info("reusing the benchmark model in %s", target)
        return target

    import transformers

    config_cls = getattr(transformers, shape.config_class)
    model_cls = getattr(transformers, shape.model_class)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{shape.dir_name}.tmp-", dir=target.parent))
    try:
        logger.info("building the benchmark model %s (random weights, seed %d) in %s",
                    shape_name, MODEL_SEED, target)
        t0 = time.perf_counter()
        torch.manual_seed(MODEL_SEED)
        config = config_cls(**shape.config, dtype=shape.dtype)
        config.architectures = [shape.model_class]
        # built in fp32 (the same random draws whatever the checkpoint's dtype), then cast
        model = model_cls(config).to(torch.float32).eval()
        model = model.to(getattr(torch, shape.dtype))
        model.save_pretrained(tmp, safe_serialization=True)
        del model
        verify_shape(shape, tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp made it private
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process finished first: keep its copy.
            if not (target / "config.json").is_file():
                raise
        logger.info("built %s in %.1fs", shape.dir_name, time.perf_counter() - t0)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def verify_shape(shape: ModelShape, path: Path) -> None:
    """Check that the checkpoint in ``path``, as kiln reads it, has ``shape``'s
    architecture: transformers versions spell some config fields differently
    (RoPE's), and a silently dropped field would benchmark another model."""
    from kiln.runtime.model_config import ModelConfig

    mc = ModelConfig.from_dir(path)
    c = shape.config
    expected = {
        "architecture": shape.model_class,
        "vocab_size": c["vocab_size"],
        "hidden_size": c["hidden_size"],
        "intermediate_size": c["intermediate_size"],
        "num_layers": c["num_hidden_layers"],
        "num_heads": c["num_attention_heads"],
        "num_kv_heads": c["num_key_value_heads"],
        "head_dim": c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
        "max_position_embeddings": c["max_position_embeddings"],
        "tie_word_embeddings": c["tie_word_embeddings"],
        "rms_norm_eps": c["rms_norm_eps"],
        "rope_theta": c["rope_theta"],
        "qk_norm": shape.model_class == "Qwen3ForCausalLM",
        "sliding_windows": (0,) * c["num_hidden_layers"],
    }
    got = {k: getattr(mc, k) for k in expected if hasattr(mc, k)}
    got["rope_theta"] = mc.rope.theta
    wrong = {k: (got.get(k), v) for k, v in expected.items() if got.get(k) != v}
    if wrong:
        raise RuntimeError(f"the built {shape.dir_name} checkpoint does not have the intended shape "
                           f"(field: (built, intended)): {wrong}")


def describe_model(path: Path, name: str) -> dict[str, Any]:
    """The model's shape as kiln reads it from ``config.json``."""
    from kiln.runtime.model_config import ModelConfig

    mc = ModelConfig.from_dir(path)
    return {
        "name": name,
        "architecture": mc.architecture,
        "vocab_size": mc.vocab_size,
        "hidden_size": mc.hidden_size,
        "intermediate_size": mc.intermediate_size,
        "num_layers": mc.num_layers,
        "num_attention_heads": mc.num_heads,
        "num_kv_heads": mc.num_kv_heads,
        "head_dim": mc.head_dim,
        "max_position_embeddings": mc.max_position_embeddings,
        "tie_word_embeddings": mc.tie_word_embeddings,
        "rope_theta": mc.rope.theta,
        "rms_norm_eps": mc.rms_norm_eps,
        "qk_norm": mc.qk_norm,
        "checkpoint_dtype": str(mc.checkpoint_dtype).removeprefix("torch."),
    }


def make_prompt(vocab_size: int, length: int, seed: int) -> list[int]:
    """``length`` token ids drawn uniformly from the vocabulary with a fixed seed."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=gen).tolist()


# ------------------------------------------------------------------------ measuring


NOISY_SPREAD = 0.2  # runs whose rates differ by more than this (relative to the median) are flagged


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def rate_spread(rates: Sequence[float]) -> dict[str, float]:
    """The best and worst of the per-run rates, and their spread relative to the
    median: noise on a shared machine only ever slows a run down, so a large spread
    means the median may be pessimistic."""
    median = _median(rates)
    return {
        "best_decode_tokens_per_s": max(rates),
        "worst_decode_tokens_per_s": min(rates),
        "spread": (max(rates) - min(rates)) / median if median > 0 else float("inf"),
    }


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def split_token_ids(runs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[int], bool]:
    """Copies of ``runs`` without their token ids, the first run's ids, and whether
    every run produced the same ones."""
    runs = [dict(r) for r in runs]
    token_ids = runs[0].pop("token_ids")
    deterministic = all(r.pop("token_ids") == token_ids for r in runs[1:])
    return runs, token_ids, deterministic


class Engine(abc.ABC):
    """One configuration being measured: loaded when built, warmed up once, then
    timed one run at a time so that several engines can take turns.

    Subclasses set ``engine`` and ``label`` and implement ``run_once`` and
    ``summary``; ``warmup`` defaults to one untimed ``run_once``. ``summary`` returns the engine's result: a dict holding at
    least ``engine``, ``label``, ``decode_tokens_per_s``, ``ms_per_token``,
    ``token_ids`` and ``runs``.
    """

    engine: str = ""
    label: str = ""
    rate_key: str = "decode_tokens_per_s"  # the per-run figure the log shows

    warmup_seconds: float | None = None

    def warmup(self) -> None:
        """Run once untimed (first-call costs: allocation, compilation, caches),
        keeping its seconds in ``warmup_seconds``."""
        t0 = time.perf_counter()
        self.run_once()
        self.warmup_seconds = time.perf_counter() - t0

    @abc.abstractmethod
    def run_once(self) -> dict[str, Any]:
        """One timed run; holds at least ``decode_tokens_per_s`` and ``token_ids``."""

    @abc.abstractmethod
    def summary(self, runs: list[dict[str, Any]]) -> dict[str, Any]:
        """The result over the timed runs."""

    def close(self) -> None:
        """Drop the model."""


class KilnEngine(Engine):
    """kiln at one optimization level, streaming one greedy request per run.

    Raises ``ValueError`` when kiln refuses the level (one not built yet).
    """

    engine = "kiln"

    def __init__(self, model_path: Path, prompt: list[int], level: int, settings: BenchSettings) -> None:
        self.level = level
        self.label = f"-O{level}"
        self.prompt = prompt
        self.max_tokens = settings.max_tokens
        self.loaded = load_kiln(model_path, level, settings, max_model_len=len(prompt) + settings.max_tokens,
                                max_num_seqs=1)
        self.rt = self.loaded.rt
        self.load_seconds = self.loaded.seconds

    def run_once(self) -> dict[str, Any]:
        """One streamed request, timed per step.

        The first delta arrives after the prefill step; every later delta is one
        decode step. Decode figures cover the steps from the first delta to the
        last; the runner's cumulative stats are snapshotted at both ends.
        """
        from kiln import SamplingParams

        rt = self.rt
        params = SamplingParams(max_tokens=self.max_tokens, temperature=0, ignore_eos=True)
        tokens: list[int] = []
        first_tokens = 0
        t_first = t_last = 0.0
        stats_first: dict[str, float] = {}
        t_submit = time.perf_counter()
        for delta in rt.stream(self.prompt, params):
            now = time.perf_counter()
            if not tokens:
                t_first = now
                stats_first = dataclasses.asdict(rt.stats)
                first_tokens = len(delta.token_ids)
            tokens.extend(delta.token_ids)
            t_last = now
        stats_last = dataclasses.asdict(rt.stats)

        decode_tokens = len(tokens) - first_tokens
        wall = t_last - t_first
        steps = int(stats_last["steps"] - stats_first["steps"])
        per_step = {
            key.removesuffix("_seconds"): (stats_last[key] - stats_first[key]) * 1e3 / max(steps, 1)
            for key in ("prepare_seconds", "model_seconds", "sample_seconds")
        }
        step_wall_ms = wall * 1e3 / max(steps, 1)
        outside_ms = step_wall_ms - per_step["model"]
        return {
            "token_ids": tokens,
            "prefill_seconds": t_first - t_submit,
            "decode_seconds": wall,
            "decode_tokens": decode_tokens,
            "decode_steps": steps,
            "decode_tokens_per_s": decode_tokens / wall if wall > 0 else float("nan"),
            "step_wall_ms": step_wall_ms,
            "model_ms": per_step["model"],
            "outside_model_ms": outside_ms,
            "prepare_ms": per_step["prepare"],
            "sample_ms": per_step["sample"],
            "other_ms": outside_ms - per_step["prepare"] - per_step["sample"],
        }

    _MEDIAN_KEYS = (
        "decode_tokens_per_s",
        "prefill_seconds",
        "step_wall_ms",
        "model_ms",
        "outside_model_ms",
        "prepare_ms",
        "sample_ms",
        "other_ms",
    )

    def summary(self, runs: list[dict[str, Any]]) -> dict[str, Any]:
        """Medians of each figure (each taken separately), and every run."""
        runs, token_ids, deterministic = split_token_ids(runs)
        result: dict[str, Any] = {
            "engine": self.engine,
            "level": self.level,
            "label": self.label,
            "load_seconds": self.load_seconds,
            "warmup_seconds": self.warmup_seconds,
            **self.loaded.info(),
            "deterministic_across_runs": deterministic,
        }
        result.update({key: _median([r[key] for r in runs]) for key in self._MEDIAN_KEYS})
        result["ms_per_token"] = 1e3 / result["decode_tokens_per_s"]
        result.update(rate_spread([r["decode_tokens_per_s"] for r in runs]))
        result["runs"] = runs
        result["token_ids"] = token_ids
        return result

    def close(self) -> None:
        del self.rt
        self.loaded.close()


CUDAGRAPH_KEYS = ("cudagraph_mode", "cudagraphs_captured", "cudagraph_capture_seconds", "cudagraph_memory_bytes",
                  "cudagraph_capture_sizes")


class LoadedKiln:
    """A kiln ``Runtime`` loaded for a benchmark, with what its load cost."""

    def __init__(self, rt: Any, seconds: float, cache_dir: Path, own_cache: bool,
                 cuda_memory: dict[str, int] | None) -> None:
        self.rt, self.seconds, self.cache_dir, self.own_cache = rt, seconds, cache_dir, own_cache
        self.cuda_memory = cuda_memory

    def info(self) -> dict[str, Any]:
        """The startup report, the CUDA graph figures pulled out of it (the keys
        kiln reports; absent ones are left out), and the load's device memory."""
        report = self.rt.startup_report
        return {
            "startup_report": report,
            "cudagraphs": {k: report[k] for k in CUDAGRAPH_KEYS if k in report},
            "attention_backend": report.get("attention_backend"),
            "compile_cache": "fresh (cold start)" if self.own_cache else "shared (--kiln-cache-dir)",
            "cuda_memory": self.cuda_memory,
        }

    def close(self) -> None:
        if self.own_cache:
            shutil.rmtree(self.cache_dir, ignore_errors=True)


def load_kiln(model_path: Path, level: int, settings: BenchSettings, *, max_model_len: int,
              max_num_seqs: int) -> LoadedKiln:
    """``Runtime.load`` at ``level``, timed, into a fresh compile cache (a cold
    start) unless ``settings.kiln_cache_dir`` names a shared one. Raises what
    kiln raises (``ValueError`` for a level it refuses)."""
    from kiln import Runtime

    own_cache = settings.kiln_cache_dir is None
    if own_cache:
        cache_dir = Path(tempfile.mkdtemp(prefix="kiln-bench-cache-"))
    else:
        cache_dir = Path(settings.kiln_cache_dir)  # type: ignore[arg-type]
        cache_dir.mkdir(parents=True, exist_ok=True)
    cuda = settings.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        alloc0, reserved0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    kwargs: dict[str, Any] = {}
    if settings.attention_backend is not None:
        kwargs["attention_backend"] = settings.attention_backend
    if settings.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = settings.max_num_batched_tokens
    t0 = time.perf_counter()
    try:
        rt = Runtime.load(
            model_path,
            cache_dir=cache_dir,
            optimization_level=level,
            device=settings.device,
            dtype=settings.dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            **kwargs,
        )
    except BaseException:
        if own_cache:
            shutil.rmtree(cache_dir, ignore_errors=True)
        raise
    seconds = time.perf_counter() - t0
    memory = None
    if cuda:
        torch.cuda.synchronize()
        memory = {
            "allocated_by_load_bytes": torch.cuda.memory_allocated() - alloc0,
            "reserved_by_load_bytes": torch.cuda.memory_reserved() - reserved0,
            "kv_cache_bytes": rt.startup_report.get("kv_cache_bytes"),
        }
    return LoadedKiln(rt, seconds, cache_dir, own_cache, memory)


def load_transformers(model_path: Path, settings: BenchSettings) -> tuple[Any, float]:
    """The checkpoint as a transformers model on the device, in eval mode, with no
    EOS in its generation config; and the seconds the load took."""
    from transformers import AutoModelForCausalLM
    from transformers import logging as hf_logging

    hf_logging.set_verbosity_error()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=settings.torch_dtype)
    model = model.to(settings.device).eval()
    _sync(settings.device)
    seconds = time.perf_counter() - t0
    # The token budget, not EOS, ends every generate: with no EOS in the
    # generation config, ``min_new_tokens`` has nothing to mask and the logits
    # stay untouched.
    model.generation_config.eos_token_id = None
    return model, seconds


def setup_static_compile(model: Any, device: str) -> str:
    """Give ``model`` transformers' fast-decoding recipe, a static KV cache and
    ``torch.compile``; return what was compiled, for the label and the JSON.

    On CPU the forward is wrapped in ``torch.compile(fullgraph=True)`` (default
    Inductor mode). On CUDA ``generate`` compiles the decode step by itself when
    the cache is static (its auto-compile, ``CompileConfig`` defaults: mode
    ``reduce-overhead``, i.e. CUDA graphs, static shapes; the prefill runs
    eagerly): wrapping the forward as well would compile twice, nested."""
    model.generation_config.cache_implementation = "static"
    if device.startswith("cuda"):
        return "generate's auto-compile of the decode step (CompileConfig defaults: reduce-overhead)"
    model.forward = torch.compile(model.forward, fullgraph=True)
    return "torch.compile(model.forward, fullgraph=True), default mode"


def dynamo_counters() -> dict[str, dict[str, int]]:
    """A copy of torch._dynamo's global counters."""
    from torch._dynamo.utils import counters

    return {group: dict(values) for group, values in counters.items()}


def compile_counters(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, Any]:
    """What torch.compile did between two :func:`dynamo_counters` snapshots: graphs
    compiled, graph breaks (and the first few reasons), CUDA graph skips."""

    def delta(group: str) -> dict[str, int]:
        old = before.get(group, {})
        return {k: v - old.get(k, 0) for k, v in after.get(group, {}).items() if v - old.get(k, 0)}

    breaks = delta("graph_break")
    inductor = delta("inductor")
    return {
        "unique_graphs": delta("stats").get("unique_graphs", 0),
        "graph_breaks": sum(breaks.values()),
        "graph_break_reasons": [str(reason)[:200] for reason in list(breaks)[:3]],
        "cudagraph_skips": sum(v for k, v in inductor.items() if "cudagraph_skip" in k),
    }


def auto_compiled(model: Any) -> bool | None:
    """Whether ``generate`` compiled the decode step (CUDA), None where it is not
    expected to (the forward was wrapped instead)."""
    if hasattr(model.forward, "_torchdynamo_orig_callable"):
        return None
    return getattr(model, "_compiled_call", None) is not None


class TransformersEngine(Engine):
    """transformers ``generate``, greedy, eager PyTorch (no ``torch.compile``), the
    model's default attention implementation.

    Each run times a generate of ``max_tokens`` new tokens and one of a single
    token (prefill and the first token); decode is their difference. The summary
    rate is ``(max_tokens - 1) / (median t_N - median t_1)``; every run keeps its
    own paired rate too.
    """

    engine = "transformers"

    def __init__(self, model_path: Path, prompt: list[int], settings: BenchSettings) -> None:
        self.prompt = prompt
        self.max_tokens = settings.max_tokens
        self.device = settings.device
        self.model, self.load_seconds = load_transformers(model_path, settings)
        self.attn_implementation = self.model.config._attn_implementation
        self.label = f"generate, eager, {self.attn_implementation}"
        self.input_ids = torch.tensor([prompt], dtype=torch.long, device=settings.device)
        self.attention_mask = torch.ones_like(self.input_ids)
        self.grad_mode: Callable[[], Any] = torch.inference_mode

    def _generate(self, new_tokens: int) -> tuple[float, list[int]]:
        _sync(self.device)
        start = time.perf_counter()
        with self.grad_mode():
            out = self.model.generate(
                self.input_ids,
                attention_mask=self.attention_mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        _sync(self.device)
        return time.perf_counter() - start, out[0, len(self.prompt):].tolist()

    def warmup(self) -> None:
        t0 = time.perf_counter()
        self._generate(self.max_tokens)
        self._generate(1)
        self.warmup_seconds = time.perf_counter() - t0

    def run_once(self) -> dict[str, Any]:
        n = self.max_tokens
        t_n, tokens = self._generate(n)
        t_1, _ = self._generate(1)
        if len(tokens) != n:
            raise RuntimeError(f"transformers generated {len(tokens)} tokens, expected {n}")
        return {
            "token_ids": tokens,
            "generate_seconds": t_n,
            "prefill_seconds": t_1,
            "decode_tokens_per_s": (n - 1) / (t_n - t_1),
        }

    def summary(self, runs: list[dict[str, Any]]) -> dict[str, Any]:
        import transformers

        runs, token_ids, deterministic = split_token_ids(runs)
        result: dict[str, Any] = {
            "engine": self.engine,
            "label": self.label,
            "transformers_version": transformers.__version__,
            "attn_implementation": self.attn_implementation,
            "torch_compile": False,
            "num_parameters": sum(p.numel() for p in self.model.parameters()),
            "load_seconds": self.load_seconds,
            "warmup_seconds": self.warmup_seconds,
            "deterministic_across_runs": deterministic,
            "prefill_seconds": _median([r["prefill_seconds"] for r in runs]),
            "generate_seconds": _median([r["generate_seconds"] for r in runs]),
        }
        n = self.max_tokens
        result["decode_tokens_per_s"] = (n - 1) / (result["generate_seconds"] - result["prefill_seconds"])
        result["ms_per_token"] = 1e3 / result["decode_tokens_per_s"]
        result.update(rate_spread([r["decode_tokens_per_s"] for r in runs]))
        result["runs"] = runs
        result["token_ids"] = token_ids
        return result

    def close(self) -> None:
        del self.model


class _StaticCompileMixin:
    """What the compiled transformers baselines share: a static KV cache under
    ``torch.compile`` (:func:`setup_static_compile`), compiled during warm-up and
    reported as ``compile_seconds`` with Dynamo's counters."""

    engine = "transformers-compiled"

    def _setup_compile(self, settings: BenchSettings, what: str) -> None:
        self.compiled = setup_static_compile(self.model, settings.device)
        cuda = settings.device.startswith("cuda")
        how = "auto-compile (reduce-overhead)" if cuda else "torch.compile"
        self.label = f"{what}, static cache, {how}, {self.attn_implementation}"
        if cuda:
            # generate itself runs under no_grad: its compiled (CUDA graph) decode path is
            # used as transformers uses it, not under inference mode
            self.grad_mode = torch.no_grad
        self.compile_counters: dict[str, Any] = {}

    def warmup(self) -> None:
        before = dynamo_counters()
        super().warmup()  # type: ignore[misc]
        self.compile_counters = compile_counters(before, dynamo_counters())

    def summary(self, runs: list[dict[str, Any]]) -> dict[str, Any]:
        result = super().summary(runs)  # type: ignore[misc]
        result["torch_compile"] = True
        result["compile_seconds"] = self.warmup_seconds
        result["compile_counters"] = self.compile_counters
        if self.device.startswith("cuda"):
            result["compiled"] = self.compiled
            result["decode_step_compiled"] = auto_compiled(self.model)
        return result


class TransformersCompiledEngine(_StaticCompileMixin, TransformersEngine):
    """transformers ``generate`` with a static KV cache under ``torch.compile``:
    transformers' own recipe for fast decoding."""

    def __init__(self, model_path: Path, prompt: list[int], settings: BenchSettings) -> None:
        super().__init__(model_path, prompt, settings)
        self._setup_compile(settings, "generate")


# name -> constructor (model_path, prompt, settings) of a batch-1 baseline engine
BASELINES: dict[str, Callable[[Path, list[int], BenchSettings], Engine]] = {
    "transformers": TransformersEngine,
    "transformers-compiled": TransformersCompiledEngine,
}


# ------------------------------------------------------------------- throughput


def _throughput_figures(wall: float, token_ids: list[list[int]], num_prompt_tokens: int) -> dict[str, Any]:
    out_tokens = sum(len(t) for t in token_ids)
    return {
        "token_ids": token_ids,
        "wall_seconds": wall,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall if wall > 0 else float("nan"),
        "total_tokens_per_s": (out_tokens + num_prompt_tokens) / wall if wall > 0 else float("nan"),
    }


def _throughput_summary(runs: list[dict[str, Any]], median_keys: Sequence[str]) -> dict[str, Any]:
    """Medians of ``median_keys``, the spread of the rates, the runs (without token
    ids) and the first run's token ids."""
    runs = [dict(r) for r in runs]
    all_ids = [r.pop("token_ids") for r in runs]
    token_ids = all_ids[0]
    deterministic = all(ids == token_ids for ids in all_ids[1:])
    result: dict[str, Any] = {"deterministic_across_runs": deterministic}
    result.update({key: _median([r[key] for r in runs]) for key in median_keys})
    rates = [r["output_tokens_per_s"] for r in runs]
    result.update({
        "best_output_tokens_per_s": max(rates),
        "worst_output_tokens_per_s": min(rates),
        "spread": (max(rates) - min(rates)) / result["output_tokens_per_s"],
        "runs": runs,
        "token_ids": token_ids,
    })
    return result


class KilnThroughputEngine(Engine):
    """kiln at one level: every prompt submitted at once through
    ``Runtime.generate`` (``max_num_seqs`` = the number of prompts), greedy, EOS
    ignored. A run is the whole batch, prefill included."""

    engine = "kiln"
    rate_key = "output_tokens_per_s"

    def __init__(self, model_path: Path, prompts: list[list[int]], level: int, settings: BenchSettings) -> None:
        self.level = level
        self.label = f"-O{level}"
        self.prompts = prompts
        self.max_tokens = settings.max_tokens
        self.loaded = load_kiln(model_path, level, settings,
                                max_model_len=max(map(len, prompts)) + settings.max_tokens,
                                max_num_seqs=len(prompts))
        self.rt = self.loaded.rt
        self.load_seconds = self.loaded.seconds

    def run_once(self) -> dict[str, Any]:
        from kiln import SamplingParams

        rt = self.rt
        params = SamplingParams(max_tokens=self.max_tokens, temperature=0, ignore_eos=True)
        stats0 = dataclasses.asdict(rt.stats)
        t0 = time.perf_counter()
        outs = rt.generate(self.prompts, params)
        wall = time.perf_counter() - t0
        stats1 = dataclasses.asdict(rt.stats)
        steps = int(stats1["steps"] - stats0["steps"])
        result = _throughput_figures(wall, [o.token_ids for o in outs], sum(map(len, self.prompts)))
        result.update({
            "steps": steps,
            "step_wall_ms": wall * 1e3 / max(steps, 1),
            "model_ms": (stats1["model_seconds"] - stats0["model_seconds"]) * 1e3 / max(steps, 1),
        })
        return result

    def summary(self, runs: list[dict[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {
            "engine": self.engine,
            "level": self.level,
            "label": self.label,
            "load_seconds": self.load_seconds,
            "warmup_seconds": self.warmup_seconds,
            **self.loaded.info(),
        }
        result.update(_throughput_summary(runs, ("output_tokens_per_s", "total_tokens_per_s", "wall_seconds",
                                                       "steps", "step_wall_ms", "model_ms")))
        return result

    def close(self) -> None:
        del self.rt
        self.loaded.close()


PAD_TOKEN_ID = 0


def left_pad(prompts: list[list[int]], pad: int = PAD_TOKEN_ID) -> tuple[list[list[int]], list[list[int]]]:
    """Input ids and attention mask of a left-padded batch."""
    width = max(map(len, prompts))
    ids = [[pad] * (width - len(p)) + list(p) for p in prompts]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
    return ids, mask


class TransformersThroughputEngine(Engine):
    """transformers: one batched greedy ``generate`` of every prompt, left-padded
    (attention mask), ``max_tokens`` new tokens each (EOS off)."""

    engine = "transformers"
    rate_key = "output_tokens_per_s"

    def __init__(self, model_path: Path, prompts: list[list[int]], settings: BenchSettings) -> None:
        self.prompts = prompts
        self.max_tokens = settings.max_tokens
        self.device = settings.device
        self.model, self.load_seconds = load_transformers(model_path, settings)
        self.attn_implementation = self.model.config._attn_implementation
        self.label = f"batched generate, eager, {self.attn_implementation}"
        ids, mask = left_pad(prompts)
        self.input_ids = torch.tensor(ids, dtype=torch.long, device=settings.device)
        self.attention_mask = torch.tensor(mask, dtype=torch.long, device=settings.device)
        self.grad_mode: Callable[[], Any] = torch.inference_mode

    def run_once(self) -> dict[str, Any]:
        n = self.max_tokens
        _sync(self.device)
        t0 = time.perf_counter()
        with self.grad_mode():
            out = self.model.generate(
                self.input_ids,
                attention_mask=self.attention_mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=PAD_TOKEN_ID,
            )
        _sync(self.device)
        wall = time.perf_counter() - t0
        tokens = out[:, self.input_ids.shape[1]:].tolist()
        if any(len(t) != n for t in tokens):
            raise RuntimeError(f"transformers generated {[len(t) for t in tokens]} tokens, expected {n} each")
        return _throughput_figures(wall, tokens, sum(map(len, self.prompts)))

    def summary(self, runs: list[dict[str, Any]]) -> dict[str, Any]:
        import transformers

        result: dict[str, Any] = {
            "engine": self.engine,
            "label": self.label,
            "transformers_version": transformers.__version__,
            "attn_implementation": self.attn_implementation,
            "torch_compile": False,
            "padding": "left (attention mask)",
            "num_parameters": sum(p.numel() for p in self.model.parameters()),
            "load_seconds": self.load_seconds,
            "warmup_seconds": self.warmup_seconds,
        }
        result.update(_throughput_summary(runs, ("output_tokens_per_s", "total_tokens_per_s", "wall_seconds")))
        return result

    def close(self) -> None:
        del self.model


class TransformersCompiledThroughputEngine(_StaticCompileMixin, TransformersThroughputEngine):
    """As :class:`TransformersThroughputEngine`, with a static cache and
    ``torch.compile``; the warm-up compiles."""

    def __init__(self, model_path: Path, prompts: list[list[int]], settings: BenchSettings) -> None:
        super().__init__(model_path, prompts, settings)
        self._setup_compile(settings, "batched generate")
# name -> constructor (model_path, prompts, settings) of a throughput baseline engine
THROUGHPUT_BASELINES: dict[str, Callable[[Path, list[list[int]], BenchSettings], Engine]] = {
    "transformers": TransformersThroughputEngine,
    "transformers-compiled": TransformersCompiledThroughputEngine,
}


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.perf_counter() > deadline


def _warm_up(e: Engine) -> str | None:
    """Warm ``e`` up; its error, or None."""
    logger.info("%s %s: warm-up", e.engine, e.label)
    try:
        e.warmup()
    except Exception as exc:  # recorded; the other engines go on
        logger.exception("%s %s: warm-up failed", e.engine, e.label)
        return f"warm-up failed: {_error_text(exc)}"
    return None


def measure(
    engines: Sequence[Engine], repeats: int, deadline: float | None = None,
    errors: Sequence[str | None] | None = None, warmup: bool = True,
) -> tuple[list[list[dict[str, Any]]], list[str | None]]:
    """Warm every engine up (unless ``warmup`` is False: done already), then time
    ``repeats`` rounds in which each engine runs once; the order rotates from
    round to round. Taking turns exposes every engine to the same background load
    on a shared machine.

    An engine whose warm-up or run raises is dropped from later rounds, with its
    error (``errors``: ones known already, None for a healthy engine). After
    ``deadline`` (a ``time.perf_counter()`` value) no round starts but the first.
    Returns each engine's runs and each one's error (None when it ran through)."""
    errs: list[str | None] = list(errors) if errors is not None else [None] * len(engines)
    if warmup:
        for j, e in enumerate(engines):
            if errs[j] is None:
                errs[j] = _warm_up(e)
    runs: list[list[dict[str, Any]]] = [[] for _ in engines]
    k = len(engines)
    for i in range(repeats):
        if i > 0 and _past(deadline):
            logger.warning("the --time-budget is spent: stopping after %d of %d rounds", i, repeats)
            break
        for j in [(i + s) % k for s in range(k)]:
            if errs[j] is not None:
                continue
            gc.collect()
            try:
                run = engines[j].run_once()
            except Exception as exc:
                logger.exception("%s %s: run %d failed", engines[j].engine, engines[j].label, i + 1)
                errs[j] = f"run {i + 1} failed: {_error_text(exc)}"
                continue
            run["round"] = i
            logger.info("%s %s: run %d/%d: %.2f tok/s", engines[j].engine, engines[j].label,
                        i + 1, repeats, run[engines[j].rate_key])
            runs[j].append(run)
    return runs, errs


@dataclasses.dataclass
class EngineSpec:
    """A configuration to measure: what its result says if it fails, and how to
    build its engine."""

    placeholder: dict[str, Any]  # engine, label (and level): the result's head when it fails
    build: Callable[[], Engine]

    @property
    def setup_rank(self) -> int:
        """Set-up order: eager engines first (cheap), then kiln's compiled levels,
        then compiled baselines, so that a --time-budget cuts the costliest last."""
        p = self.placeholder
        if p["engine"] == "kiln":
            return 0 if p.get("level") == 0 else 1
        return 2 if "compiled" in p["engine"] else 0


def run_engines(specs: Sequence[EngineSpec], repeats: int, deadline: float | None) -> list[dict[str, Any]]:
    """Set every engine up (load, then warm up: compilation happens in one or the
    other), measure them taking turns, and return one result per spec, in the
    specs' order: its engine's summary, or its placeholder with ``error``.

    Set-up goes cheapest first (:attr:`EngineSpec.setup_rank`); a spec whose
    set-up would start after ``deadline`` is skipped."""
    results: list[dict[str, Any] | None] = [None] * len(specs)
    built: list[tuple[int, Engine]] = []
    errors: list[str | None] = []
    order = sorted(range(len(specs)), key=lambda i: (specs[i].setup_rank, i))
    try:
        for i in order:
            spec = specs[i]
            engine_name, label = spec.placeholder["engine"], spec.placeholder["label"]
            name = engine_name if label == engine_name else f"{engine_name} {label}"
            if _past(deadline):
                results[i] = {**spec.placeholder, "error": "skipped: the --time-budget was spent before it was set up"}
                logger.warning("%s: %s", name, results[i]["error"])
                continue
            logger.info("%s: loading", name)
            try:
                engine = spec.build()
            except Exception as exc:  # recorded; the other engines go on
                if isinstance(exc, ValueError) and spec.placeholder["engine"] == "kiln":
                    logger.warning("kiln %s is unavailable: %s", spec.placeholder["label"], exc)
                else:
                    logger.exception("%s: load failed", name)
                results[i] = {**spec.placeholder, "error": _error_text(exc)}
                continue
            built.append((i, engine))
            errors.append(_warm_up(engine))
        runs, errors = measure([e for _, e in built], repeats, deadline, errors=errors, warmup=False)
        for (i, e), r, err in zip(built, runs, errors):
            if err is None and not r:
                err = "no timed run completed"
            if err is not None:
                results[i] = {**specs[i].placeholder, "error": err}
                continue
            try:
                results[i] = e.summary(r)
            except Exception as exc:
                logger.exception("%s %s: summary failed", e.engine, e.label)
                results[i] = {**specs[i].placeholder, "error": f"summary failed: {_error_text(exc)}"}
    finally:
        for _, e in built:
            e.close()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return [r for r in results if r is not None]


def paired_speedup(runs: list[dict[str, Any]], ref_runs: list[dict[str, Any]]) -> float:
    """The median over rounds of the ratio of two engines' rates in the same round."""
    return _median([a["decode_tokens_per_s"] / b["decode_tokens_per_s"] for a, b in zip(runs, ref_runs)])


def compare_tokens(a: list[int], b: list[int]) -> dict[str, Any]:
    """Whether two greedy outputs agree, and where they first differ."""
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    return {"tokens_match": first is None, "first_mismatch": first}


# ---------------------------------------------------------------------- reporting


def machine_info(device: str) -> dict[str, Any]:
    """Versions and hardware that the numbers depend on."""
    import transformers

    import kiln

    info: dict[str, Any] = {
        "device": device,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "kiln_version": kiln.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "git_commit": _git_commit(),
    }
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda_version"] = torch.version.cuda
    return info


def _load_average() -> list[float] | None:
    """The 1/5/15-minute load averages: other work on the machine skews timings."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _git_commit() -> str | None:
    """The repository's HEAD, with ``-dirty`` if the working tree has changes; in a
    copy of the tree without ``.git`` (a GPU machine), ``KILN_GIT_COMMIT`` if set."""
    try:
        def git(*args: str) -> str:
            return subprocess.run(
                ["git", *args], cwd=BENCH_DIR, capture_output=True, text=True, check=True, timeout=10
            ).stdout.strip()

        commit = git("rev-parse", "--short", "HEAD")
        return commit + ("-dirty" if git("status", "--porcelain") else "")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("KILN_GIT_COMMIT") or None


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Plain-text columns: text left-aligned, numbers right-aligned."""

    def numeric(cell: str) -> bool:
        return cell.rstrip("x%").replace(".", "", 1).replace("-", "", 1).isdigit()

    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    right = [all(numeric(r[i]) or r[i] in ("-", "n/a") for r in rows) and bool(rows) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            str(c).rjust(w) if r else str(c).ljust(w) for c, w, r in zip(cells, widths, right)
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def _fmt(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{suffix}"


def _model_head(report: dict[str, Any]) -> str:
    m, s, mach = report["model"], report["settings"], report["machine"]
    gpu = f" ({mach['gpu']})" if mach.get("gpu") else ""
    return (
        f"{m['name']} ({m['architecture']}, {m['num_layers']} layers, "
        f"hidden {m['hidden_size']}, heads {m['num_attention_heads']}/{m['num_kv_heads']} kv, "
        f"vocab {m['vocab_size']}), {s['dtype']} on {mach['device']}{gpu}, "
        f"torch threads {mach['torch_threads']} of {mach['cpu_count']} CPUs"
    )


def _cold_start(r: dict[str, Any]) -> str:
    return _fmt(r["load_seconds"] + (r.get("compile_seconds") or 0.0), 1, "s")


def _cudagraph_section(report: dict[str, Any]) -> list[str]:
    """kiln's CUDA graph figures per level (CUDA runs only)."""
    if not report["settings"]["device"].startswith("cuda"):
        return []
    rows = []
    for k in report["kiln"]:
        if "error" in k:
            continue
        g, mem = k.get("cudagraphs", {}), k.get("cuda_memory") or {}
        graph_bytes = g.get("cudagraph_memory_bytes")
        rows.append([
            k["label"], str(g.get("cudagraph_mode", "n/a")), str(g.get("cudagraphs_captured", "n/a")),
            _fmt(g.get("cudagraph_capture_seconds"), 2, "s"),
            _fmt(graph_bytes / 2**20 if graph_bytes is not None else None, 1),
            _fmt(mem["allocated_by_load_bytes"] / 2**20 if "allocated_by_load_bytes" in mem else None, 0),
            str(k.get("attention_backend") or "n/a"),
        ])
    if not rows:
        return []
    return ["", "kiln CUDA graphs (from startup_report; n/a: not reported by this kiln)",
            format_table(["kiln", "mode", "captured", "capture", "graph MiB", "load MiB (allocated)",
                          "attention"], rows)]


def _errors_section(report: dict[str, Any]) -> list[str]:
    return [f"{r['engine']} {r['label']} not measured: {r['error']}"
            for r in [*report["kiln"], *report["baselines"].values()] if "error" in r]


def _noisy_section(report: dict[str, Any]) -> list[str]:
    noisy = [
        f"{r['engine']} {r['label']}" for r in [*report["kiln"], *report["baselines"].values()]
        if r.get("spread", 0.0) > NOISY_SPREAD
    ]
    if not noisy:
        return []
    return ["", f"note: the runs of {', '.join(noisy)} have a spread over {NOISY_SPREAD:.0%}: "
                "the machine was busy; rerun, raise --repeats, or try --threads 1"]


def render_report(report: dict[str, Any]) -> str:
    """The human-readable summary of a batch-1 report."""
    s = report["settings"]
    head = (
        f"decode benchmark: {_model_head(report)}\n"
        f"batch 1, greedy, prompt {s['prompt_len']} tokens, {s['max_tokens']} new tokens; "
        f"decode excludes prefill; median of {s['repeats']} runs after a warm-up, engines taking turns"
    )
    ref = _usable(report["baselines"].get(REFERENCE_BASELINE))
    rate_rows = []
    for k in report["kiln"]:
        if "error" in k:
            rate_rows.append(["kiln", k["label"], "n/a", "n/a", "n/a", "n/a", "n/a", "unavailable", "n/a"])
            continue
        speed = k.get(f"speedup_vs_{REFERENCE_BASELINE}")
        match = k.get("tokens_match")
        rate_rows.append([
            "kiln",
            k["label"],
            _fmt(k["decode_tokens_per_s"]),
            _fmt(k["ms_per_token"]),
            _fmt(100 * k["spread"], 0, "%"),
            _fmt(speed, suffix="x"),
            _fmt(k.get(f"paired_speedup_vs_{REFERENCE_BASELINE}"), suffix="x"),
            "-" if match is None else ("yes" if match else f"NO (from token {k['first_mismatch']})"),
            _fmt(k["load_seconds"], 1, "s"),
        ])
    for name, b in report["baselines"].items():
        if "error" in b:
            rate_rows.append([name, b["label"], "n/a", "n/a", "n/a", "-", "-", "unavailable", "n/a"])
            continue
        speed = 1.0 if b is ref else None
        rate_rows.append([name, b["label"], _fmt(b["decode_tokens_per_s"]), _fmt(b["ms_per_token"]),
                          _fmt(100 * b["spread"], 0, "%"),
                          _fmt(speed, suffix="x") if speed else "-", "-",
                          "(reference)" if b is ref else "-",
                          _cold_start(b)])
    rates = format_table(
        ["engine", "config", "decode tok/s", "ms/token", "spread", f"kiln/{REFERENCE_BASELINE}",
         "paired", "tokens match", "cold start"],
        rate_rows,
    )

    overhead_rows = [
        [k["label"], _fmt(k["step_wall_ms"], 3), _fmt(k["model_ms"], 3), _fmt(k["outside_model_ms"], 3),
         _fmt(k["prepare_ms"], 3), _fmt(k["sample_ms"], 3), _fmt(k["other_ms"], 3)]
        for k in report["kiln"] if "error" not in k
    ]
    legend = (f"spread: (best - worst) / median of an engine's runs; paired: median over rounds of "
              f"kiln's rate / {REFERENCE_BASELINE}'s in the same round; cold start: kiln's Runtime.load "
              "into an empty compile cache (trace + compile), transformers' load (+ its torch.compile warm-up)")
    parts = [head, "", rates, legend]
    if overhead_rows:
        overhead = format_table(
            ["kiln", "step wall", "model", "outside model", "prepare", "sample", "other"], overhead_rows
        )
        parts += ["", "kiln per decode step, ms (outside model = step wall - model = prepare + sample + other)",
                  overhead]
    parts += _cudagraph_section(report)
    errors = _errors_section(report)
    if errors:
        parts += ["", *errors]
    parts += _noisy_section(report)
    return "\n".join(parts)


def render_throughput_report(report: dict[str, Any]) -> str:
    """The human-readable summary of a throughput report."""
    s = report["settings"]
    head = (
        f"decode throughput benchmark: {_model_head(report)}\n"
        f"{s['num_requests']} requests submitted at once, prompt {s['prompt_len']} + {s['max_tokens']} new "
        f"tokens each, greedy; whole batch timed (prefill included); median of {s['repeats']} runs after a "
        f"warm-up, engines taking turns"
    )
    rows = []
    for r in [*report["kiln"], *report["baselines"].values()]:
        name = "kiln" if r["engine"] == "kiln" else r["engine"]
        if "error" in r:
            rows.append([name, r["label"], "n/a", "n/a", "n/a", "n/a", "unavailable", "n/a"])
            continue
        matching = r.get("requests_matching_reference")
        rows.append([
            name,
            r["label"],
            _fmt(r["output_tokens_per_s"], 1),
            _fmt(r["wall_seconds"], 2, "s"),
            _fmt(100 * r["spread"], 0, "%"),
            _fmt(r.get(f"speedup_vs_{REFERENCE_BASELINE}"), suffix="x"),
            "(reference)" if r["engine"] == REFERENCE_BASELINE else
            ("-" if matching is None else f"{matching}/{s['num_requests']}"),
            _cold_start(r),
        ])
    table = format_table(["engine", "config", "output tok/s", "batch wall", "spread", f"vs {REFERENCE_BASELINE}",
                          "requests match", "cold start"], rows)
    legend = ("output tok/s: requests x new tokens / wall time of the whole batch; requests match: requests "
              f"whose greedy tokens equal {REFERENCE_BASELINE}'s (informational: batched low-precision "
              "arithmetic diverges at near-ties); cold start: load (+ compile) as in the batch-1 table")
    parts = [head, "", table, legend]
    steps = [[k["label"], _fmt(k["steps"], 0), _fmt(k["step_wall_ms"], 2), _fmt(k["model_ms"], 2)]
             for k in report["kiln"] if "error" not in k]
    if steps:
        parts += ["", "kiln engine steps per batch (median), ms per step",
                  format_table(["kiln", "steps", "step wall", "model (host)"], steps)]
    parts += _cudagraph_section(report)
    errors = _errors_section(report)
    if errors:
        parts += ["", *errors]
    parts += _noisy_section(report)
    return "\n".join(parts)


def scrub_paths(obj: Any, replacements: Sequence[tuple[str, str]]) -> Any:
    """``obj`` with every string's machine-specific prefixes replaced (longest
    first), so that committed results name no local directories."""
    if isinstance(obj, dict):
        return {k: scrub_paths(v, replacements) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [scrub_paths(v, replacements) for v in obj]
    if isinstance(obj, str):
        for prefix, placeholder in replacements:
            obj = obj.replace(prefix, placeholder)
    return obj


def _path_placeholders() -> list[tuple[str, str]]:
    from kiln.config import default_cache_dir

    pairs = [
        (str(default_cache_dir()), "<kiln cache>"),
        (str(BENCH_DIR.parent), "<repo>"),
        (str(Path.home()), "~"),
    ]
    return sorted(((p, r) for p, r in pairs if len(p) > 1), key=lambda pr: -len(pr[0]))


def write_report(report: dict[str, Any], out_dir: Path, prefix: str = "decode") -> tuple[Path, Path]:
    """Write the report as ``<prefix>-<device>-<stamp>.json`` and overwrite
    ``<prefix>-<device>-latest.json``; each file appears whole (written to ``.tmp``,
    then renamed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    device = report["machine"]["device"].replace(":", "")
    stamp = report["run_stamp"]
    text = json.dumps(scrub_paths(report, _path_placeholders()), indent=2, default=str) + "\n"
    paths = (out_dir / f"{prefix}-{device}-{stamp}.json", out_dir / f"{prefix}-{device}-latest.json")
    for path in paths:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return paths


# ---------------------------------------------------------------------------- main


def _parse_list(kind: type, text: str) -> list[Any]:
    return [kind(x) for x in text.replace(",", " ").split()]


def _parse_levels(text: str) -> list[int]:
    """``0,1,2``; ``O1`` and ``-O1`` spellings too (``--levels=-O0,-O1``); ``none``: no kiln row."""
    if text.strip().lower() == "none":
        return []
    levels = []
    for item in text.replace(",", " ").split():
        digits = item.lstrip("-").lstrip("Oo")
        if not digits.isdigit():
            raise argparse.ArgumentTypeError(f"{item!r} is not an optimization level (0, 1, 2, 3 or -O1 ...)")
        levels.append(int(digits))
    return levels


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.decode",
        description="Greedy decode, batch 1 or --throughput N: kiln per optimization level against baselines.",
    )
    p.add_argument("--model", type=Path, default=None,
                   help="checkpoint directory (default: the --shape model with random weights, built once "
                        "in the kiln cache)")
    p.add_argument("--shape", choices=list(SHAPES), default=None,
                   help=f"benchmark model to build and run (default {DEFAULT_SHAPE}; qwen3-tiny is for smoke "
                        "tests of this script); not with --model")
    p.add_argument("--throughput", type=int, default=0, metavar="N",
                   help="throughput mode: N requests submitted at once (default 0: batch-1 decode)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (default 128)")
    p.add_argument("--prompt-len", type=int, default=None,
                   help="prompt length in token ids (default 32; 128 with --throughput)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine, after a warm-up (default 3)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave as is)")
    p.add_argument("--levels", type=_parse_levels, default=[0, 2],
                   help="kiln optimization levels, comma-separated, e.g. 0,1,2 (default 0,2); or none")
    p.add_argument("--baselines", type=lambda t: [b for b in _parse_list(str, t) if b != "none"],
                   default=["transformers", "transformers-compiled"],
                   help=f"baselines, comma-separated, of: {', '.join(BASELINES)}; or none "
                        "(default both)")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto (default: cuda if available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weights and activations (default: float32, or bfloat16 for the qwen3 shapes)")
    p.add_argument("--attention-backend", default=None, choices=["auto", "torch", "triton"],
                   help="kiln's attention backend (default: kiln's: KILN_ATTENTION_BACKEND, else auto)")
    p.add_argument("--kiln-cache-dir", type=Path, default=None,
                   help="compile cache shared by the kiln engines (default: a fresh, empty one per engine, "
                        "so that kiln's load time is a cold start)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="kiln's per-step token budget (default: kiln's, 2048)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="skip engines not loaded or warmed up, and rounds not started, after this many "
                        "seconds (default: none); what ran is reported")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt's token ids (default 0)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR, help="results directory (default bench/results)")
    args = p.parse_args(argv)
    if args.model is not None and args.shape is not None:
        p.error("--model and --shape exclude each other")
    if args.model is None and args.shape is None:
        args.shape = DEFAULT_SHAPE
    if args.dtype is None:
        args.dtype = SHAPES[args.shape].dtype if args.shape is not None else "float32"
    if args.prompt_len is None:
        args.prompt_len = 128 if args.throughput else 32
    if args.max_tokens < 2:
        p.error("--max-tokens must be at least 2 (decode needs steps after the first token)")
    for name in ("prompt_len", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.throughput < 0:
        p.error("--throughput must be a positive number of requests")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be at least 1")
    if args.time_budget is not None and args.time_budget <= 0:
        p.error("--time-budget must be positive")
    known = THROUGHPUT_BASELINES if args.throughput else BASELINES
    unknown = [b for b in args.baselines if b not in known]
    if unknown:
        p.error(f"unknown baseline(s) {unknown}; known: {list(known)}")
    if not args.levels and not args.baselines:
        p.error("nothing to measure: --levels none and --baselines none")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: CUDA is not available here (torch {torch.__version__}, "
                f"built with CUDA {torch.version.cuda})")
    return args


def measure_all(
    model_path: Path, prompt: list[int], levels: Sequence[int], baselines: Sequence[str],
    settings: BenchSettings, deadline: float | None = None,
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Load kiln at each level and each baseline, time them taking turns, and
    return (one result per level, in order; baseline name -> result). A level kiln
    refuses to load, or an engine that fails, gets a result holding ``error``."""
    specs = [
        EngineSpec({"engine": "kiln", "level": level, "label": f"-O{level}"},
                   lambda level=level: KilnEngine(model_path, prompt, level, settings))
        for level in levels
    ] + [
        EngineSpec({"engine": name, "label": name}, lambda name=name: BASELINES[name](model_path, prompt, settings))
        for name in baselines
    ]
    results = run_engines(specs, settings.repeats, deadline)
    return results[: len(levels)], dict(zip(baselines, results[len(levels):]))


def measure_throughput(
    model_path: Path, prompts: list[list[int]], levels: Sequence[int], baselines: Sequence[str],
    settings: BenchSettings, deadline: float | None = None,
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """As :func:`measure_all`, for the throughput engines."""
    specs = [
        EngineSpec({"engine": "kiln", "level": level, "label": f"-O{level}"},
                   lambda level=level: KilnThroughputEngine(model_path, prompts, level, settings))
        for level in levels
    ] + [
        EngineSpec({"engine": name, "label": name},
                   lambda name=name: THROUGHPUT_BASELINES[name](model_path, prompts, settings))
        for name in baselines
    ]
    results = run_engines(specs, settings.repeats, deadline)
    return results[: len(levels)], dict(zip(baselines, results[len(levels):]))


def resolve_model(args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """The checkpoint to run (built first for a ``--shape``) and its description."""
    if args.model is None:
        shape = SHAPES[args.shape]
        model_path, model_name, source = ensure_shape_model(args.shape), shape.dir_name, "built"
    else:
        model_path, model_name, source = args.model, args.model.resolve().name, "user"
    model = describe_model(model_path, model_name)
    model["source"] = source
    if source == "built":
        model["shape"] = args.shape
        model["shape_note"] = SHAPES[args.shape].note
        model["seed"] = MODEL_SEED
        model["weights"] = "random (torch.manual_seed(0), initializer_range 0.02)"
    if args.prompt_len + args.max_tokens > model["max_position_embeddings"]:
        raise SystemExit(
            f"prompt {args.prompt_len} + {args.max_tokens} new tokens exceeds the model's "
            f"max_position_embeddings {model['max_position_embeddings']}"
        )
    return model_path, model


def _settings(args: argparse.Namespace) -> BenchSettings:
    return BenchSettings(args.max_tokens, args.repeats, args.device, args.dtype,
                         attention_backend=args.attention_backend, kiln_cache_dir=args.kiln_cache_dir,
                         max_num_batched_tokens=args.max_num_batched_tokens)


def _deadline(args: argparse.Namespace, started: float) -> float | None:
    return None if args.time_budget is None else started + args.time_budget


def _common_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "device": args.device,
        "dtype": args.dtype,
        "threads_requested": args.threads,
        "levels": args.levels,
        "baselines": args.baselines,
        "reference_baseline": REFERENCE_BASELINE,
        "attention_backend_requested": args.attention_backend,
        "kiln_compile_cache": "shared (--kiln-cache-dir)" if args.kiln_cache_dir else "fresh per engine (cold)",
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "time_budget_seconds": args.time_budget,
    }


def _usable(result: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if result is None or "error" in result else result


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the batch-1 measurements the arguments ask for; return the report."""
    started = dt.datetime.now()
    t_start = time.perf_counter()
    load_start = _load_average()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model_path, model = resolve_model(args)
    prompt = make_prompt(model["vocab_size"], args.prompt_len, args.seed)
    settings = _settings(args)

    kiln_results, baselines = measure_all(model_path, prompt, args.levels, args.baselines, settings,
                                          _deadline(args, t_start))

    ref = _usable(baselines.get(REFERENCE_BASELINE))
    for k in kiln_results:
        if "error" in k or ref is None:
            continue
        k[f"speedup_vs_{REFERENCE_BASELINE}"] = k["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
        k[f"paired_speedup_vs_{REFERENCE_BASELINE}"] = paired_speedup(k["runs"], ref["runs"])
        k.update(compare_tokens(k["token_ids"], ref["token_ids"]))
        if not k["tokens_match"]:
            logger.warning(
                "kiln %s and %s greedy tokens differ from token %d (random weights can have near-ties)",
                k["label"], REFERENCE_BASELINE, k["first_mismatch"],
            )
    if ref is not None:
        model["num_parameters"] = ref.get("num_parameters")

    level0 = next((k for k in kiln_results if k["level"] == 0 and "error" not in k), None)
    return {
        "benchmark": "decode",
        "schema_version": 1,
        "started_at": started.astimezone().isoformat(timespec="seconds"),
        "run_stamp": started.strftime("%Y%m%d-%H%M%S"),
        "duration_seconds": round((dt.datetime.now() - started).total_seconds(), 2),
        "machine": {**machine_info(args.device), "load_average_start": load_start,
                    "load_average_end": _load_average()},
        "model": model,
        "settings": {
            "batch_size": 1,
            "sampling": "greedy (temperature 0), EOS ignored",
            "prompt_len": args.prompt_len,
            "prompt_seed": args.seed,
            "max_tokens": args.max_tokens,
            "repeats": args.repeats,
            "warmup_runs": 1,
            "schedule": "engines take turns: each round runs every engine once, order rotating",
            "statistic": "median over repeats, each figure separately (transformers: medians of "
                         "t_generate(N) and t_generate(1)); best/worst/spread of the per-run rates too",
            "noisy_spread_threshold": NOISY_SPREAD,
            **_common_settings(args),
            "notes": [
                "decode tok/s excludes prefill: kiln (N-1)/(t_last_token - t_first_token) from stream "
                "timestamps; transformers (N-1)/(t_generate(N) - t_generate(1)).",
                "kiln step figures are per decode step from RunnerStats deltas; model = model forward + "
                "logits; other = scheduler, engine step bookkeeping and streaming.",
                "on CUDA, kiln's model time is host time without a device sync: queued GPU work lands in "
                "the sampler's time.",
                "kiln load_seconds is a cold start (trace, compile, CUDA graph capture) only with a fresh "
                "compile cache per engine, the default; see settings.kiln_compile_cache.",
            ],
        },
        "prompt_token_ids": prompt,
        # Headline figures (kiln -O0 against the reference baseline).
        "kiln_decode_tokens_per_s": level0["decode_tokens_per_s"] if level0 else None,
        f"{REFERENCE_BASELINE}_decode_tokens_per_s": ref["decode_tokens_per_s"] if ref else None,
        "speedup_kiln_vs_transformers": level0.get(f"speedup_vs_{REFERENCE_BASELINE}") if level0 else None,
        "paired_speedup_kiln_vs_transformers":
            level0.get(f"paired_speedup_vs_{REFERENCE_BASELINE}") if level0 else None,
        "kiln_outside_model_ms_per_step": level0["outside_model_ms"] if level0 else None,
        "tokens_match": level0.get("tokens_match") if level0 else None,
        "decode_tokens_per_s_by_engine": _rates_by_engine(kiln_results, baselines, "decode_tokens_per_s"),
        "kiln": kiln_results,
        "baselines": baselines,
    }


def _rates_by_engine(kiln_results: list[dict[str, Any]], baselines: dict[str, dict[str, Any]],
                     key: str) -> dict[str, float | None]:
    rates = {f"kiln {k['label']}": k.get(key) for k in kiln_results}
    rates.update({name: b.get(key) for name, b in baselines.items()})
    return rates


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    """Run the throughput measurements (``--throughput N``); return the report."""
    started = dt.datetime.now()
    t_start = time.perf_counter()
    load_start = _load_average()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model_path, model = resolve_model(args)
    prompts = [make_prompt(model["vocab_size"], args.prompt_len, args.seed + i) for i in range(args.throughput)]
    settings = _settings(args)

    kiln_results, baselines = measure_throughput(model_path, prompts, args.levels, args.baselines, settings,
                                                 _deadline(args, t_start))

    ref = _usable(baselines.get(REFERENCE_BASELINE))
    for k in [*kiln_results, *baselines.values()]:
        if "error" in k or ref is None:
            continue
        k[f"speedup_vs_{REFERENCE_BASELINE}"] = k["output_tokens_per_s"] / ref["output_tokens_per_s"]
        if k is ref:
            continue
        per_request = [compare_tokens(a, b) for a, b in zip(k["token_ids"], ref["token_ids"])]
        k["requests_matching_reference"] = sum(c["tokens_match"] for c in per_request)
        mismatches = [c["first_mismatch"] for c in per_request if not c["tokens_match"]]
        k["median_first_mismatch"] = _median(mismatches) if mismatches else None
    if ref is not None:
        model["num_parameters"] = ref.get("num_parameters")
    for r in [*kiln_results, *baselines.values()]:
        r.pop("token_ids", None)  # N x max_tokens ids: kept out of the JSON

    return {
        "benchmark": "decode-throughput",
        "schema_version": 1,
        "started_at": started.astimezone().isoformat(timespec="seconds"),
        "run_stamp": started.strftime("%Y%m%d-%H%M%S"),
        "duration_seconds": round((dt.datetime.now() - started).total_seconds(), 2),
        "machine": {**machine_info(args.device), "load_average_start": load_start,
                    "load_average_end": _load_average()},
        "model": model,
        "settings": {
            "num_requests": args.throughput,
            "sampling": "greedy (temperature 0), EOS ignored",
            "prompt_len": args.prompt_len,
            "prompt_seeds": f"{args.seed}..{args.seed + args.throughput - 1} (one per request)",
            "max_tokens": args.max_tokens,
            "repeats": args.repeats,
            "warmup_runs": 1,
            "schedule": "engines take turns: each round runs every engine once, order rotating",
            "statistic": "median over repeats of each figure; best/worst/spread of the per-run rates too",
            "noisy_spread_threshold": NOISY_SPREAD,
            **_common_settings(args),
            "notes": [
                "output tok/s = requests * max_tokens / wall time of the whole batch, prefill included; "
                "total tok/s counts the prompt tokens too.",
                "kiln: every request submitted at once to Runtime.generate, max_num_seqs = requests, "
                "continuous batching with chunked prefill under max_num_batched_tokens.",
                "transformers: one batched generate, prompts left-padded (all prompts here have the same "
                "length, so no pad token is used).",
                "requests_matching_reference: requests whose greedy tokens equal transformers eager's; "
                "batched low-precision arithmetic makes near-ties diverge, so this is informational.",
            ],
        },
        "output_tokens_per_s_by_engine": _rates_by_engine(kiln_results, baselines, "output_tokens_per_s"),
        "kiln": kiln_results,
        "baselines": baselines,
    }


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    args = parse_args(argv)
    if args.throughput:
        report = run_throughput(args)
        paths = write_report(report, args.out, prefix="decode-throughput")
        print(render_throughput_report(report))
    else:
        report = run(args)
        paths = write_report(report, args.out)
        print(render_report(report))
        if report["tokens_match"] is False:
            print("\nwarning: kiln -O0 and transformers greedy tokens differ (near-ties are possible "
                  "with random weights); the speed figures stand")
    shown = [os.path.relpath(p) if not os.path.relpath(p).startswith("..") else str(p) for p in paths]
    print(f"\nresults: {shown[0]}\n         {shown[1]}")
    failed = [f"{r['engine']} {r['label']}" for r in [*report["kiln"], *report["baselines"].values()]
              if "error" in r]
    if failed:
        print(f"\nnot measured: {', '.join(failed)} (see the errors above and in the JSON)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
