"""Batch-1 greedy decode benchmark: kiln against transformers, eager and compiled.

Run from the repository root::

    python -m bench.decode                      # SmolLM2-135M shape, random fp32 weights
    python -m bench.decode --model DIR --max-tokens 64 --repeats 5 --threads 2

One run measures, on the same checkpoint, dtype and prompt:

* kiln's decode rate (tokens/s, prefill excluded) at each optimization level in
  ``--levels`` (one row per level, default -O0 and -O2; a level kiln refuses to
  load is recorded as unavailable), and its cold start (load, trace and compile
  into an empty compile cache);
* each baseline's decode rate (``--baselines``: transformers ``generate`` eager,
  and with a static cache under ``torch.compile``, whose compile time is reported);
* kiln's per-step CPU time outside the model (runner prepare, sampler, and the
  rest of the engine step: scheduler, bookkeeping, streaming).

It prints a table and writes JSON to ``bench/results/decode-<device>-<timestamp>.json``
and ``bench/results/decode-<device>-latest.json``.

Adding an optimization level needs nothing here but ``--levels``. Adding a
baseline means writing an :class:`Engine` subclass (see :class:`TransformersEngine`)
and registering it in :data:`BASELINES`; its ``summary`` dict becomes its entry
under ``baselines`` in the JSON.

The engines take turns (one timed run each per round) so that background load on
a shared machine hits them alike; each row also reports the spread of its runs.
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
MODEL_SEED = 0


# --------------------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class BenchSettings:
    """What every measured engine shares."""

    max_tokens: int
    repeats: int
    device: str
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


# ----------------------------------------------------------------------------- model


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """Return the directory of the SmolLM2-135M-shaped checkpoint, building it first
    if it is not there yet.

    It lives in ``<kiln cache>/bench-models/smollm2-135m-shape``. It is built in a
    temporary sibling directory and moved into place with ``os.replace``, so a
    half-built model is never found there.
    """
    if cache_dir is None:
        from kiln.config import default_cache_dir

        cache_dir = default_cache_dir()
    target = Path(cache_dir) / "bench-models" / DEFAULT_MODEL_NAME
    if target.exists():
        if not (target / "config.json").is_file() or not any(target.glob("*.safetensors")):
            raise RuntimeError(
                f"{target} exists but holds no complete checkpoint; remove it and run again"
            )
        logger.info("reusing the benchmark model in %s", target)
        return target

    from transformers import LlamaConfig, LlamaForCausalLM

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.tmp-", dir=target.parent))
    try:
        logger.info("building the benchmark model (random weights, seed %d) in %s", MODEL_SEED, target)
        torch.manual_seed(MODEL_SEED)
        config = LlamaConfig(**SMOLLM2_135M_SHAPE, dtype="float32")
        model = LlamaForCausalLM(config).to(torch.float32).eval()
        model.save_pretrained(tmp, safe_serialization=True)
        del model
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp made it private
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process finished first: keep its copy.
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


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

    Subclasses set ``engine`` and ``label`` and implement ``warmup``, ``run_once``
    and ``summary``. ``summary`` returns the engine's result: a dict holding at
    least ``engine``, ``label``, ``decode_tokens_per_s``, ``ms_per_token``,
    ``token_ids`` and ``runs``.
    """

    engine: str = ""
    label: str = ""

    @abc.abstractmethod
    def warmup(self) -> None:
        """Run once untimed (first-call costs: allocation, compilation, caches)."""

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
        from kiln import Runtime

        self.level = level
        self.label = f"-O{level}"
        self.prompt = prompt
        self.max_tokens = settings.max_tokens
        # an empty compile cache: load_seconds is a cold start (trace and compile)
        self.cache_dir = tempfile.mkdtemp(prefix="kiln-bench-cache-")
        t0 = time.perf_counter()
        self.rt = Runtime.load(
            model_path,
            cache_dir=self.cache_dir,
            optimization_level=level,
            device=settings.device,
            dtype=settings.dtype,
            max_model_len=len(prompt) + settings.max_tokens,
            max_num_seqs=1,
        )
        self.load_seconds = time.perf_counter() - t0
        self.warmup_seconds: float | None = None

    def warmup(self) -> None:
        t0 = time.perf_counter()
        self.run_once()
        self.warmup_seconds = time.perf_counter() - t0

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
            "startup_report": self.rt.startup_report,
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
        shutil.rmtree(self.cache_dir, ignore_errors=True)


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
        from transformers import AutoModelForCausalLM
        from transformers import logging as hf_logging

        hf_logging.set_verbosity_error()
        self.prompt = prompt
        self.max_tokens = settings.max_tokens
        self.device = settings.device
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=settings.torch_dtype)
        self.model = model.to(settings.device).eval()
        self.load_seconds = time.perf_counter() - t0
        self.warmup_seconds: float | None = None
        # The token budget, not EOS, ends every generate: with no EOS in the
        # generation config, ``min_new_tokens`` has nothing to mask and the logits
        # stay untouched.
        self.model.generation_config.eos_token_id = None
        self.attn_implementation = self.model.config._attn_implementation
        self.label = f"generate, eager, {self.attn_implementation}"
        self.input_ids = torch.tensor([prompt], dtype=torch.long, device=settings.device)
        self.attention_mask = torch.ones_like(self.input_ids)

    def _generate(self, new_tokens: int) -> tuple[float, list[int]]:
        _sync(self.device)
        start = time.perf_counter()
        with torch.inference_mode():
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


class TransformersCompiledEngine(TransformersEngine):
    """transformers ``generate`` with a static KV cache and the model's forward
    under ``torch.compile`` (Inductor, default mode): transformers' own recipe for
    fast decoding. Its warm-up pays the compilation (prefill and decode shapes),
    reported as ``compile_seconds``."""

    engine = "transformers-compiled"

    def __init__(self, model_path: Path, prompt: list[int], settings: BenchSettings) -> None:
        super().__init__(model_path, prompt, settings)
        self.model.generation_config.cache_implementation = "static"
        self.model.forward = torch.compile(self.model.forward, fullgraph=True)
        self.label = f"generate, static cache, torch.compile, {self.attn_implementation}"

    def summary(self, runs: list[dict[str, Any]]) -> dict[str, Any]:
        result = super().summary(runs)
        result["torch_compile"] = True
        result["compile_seconds"] = self.warmup_seconds
        return result


# name -> constructor (model_path, prompt, settings) of a baseline engine
BASELINES: dict[str, Callable[[Path, list[int], BenchSettings], Engine]] = {
    "transformers": TransformersEngine,
    "transformers-compiled": TransformersCompiledEngine,
}


def measure(engines: Sequence[Engine], repeats: int) -> list[list[dict[str, Any]]]:
    """Warm every engine up, then time ``repeats`` rounds in which each engine runs
    once; the order rotates from round to round. Taking turns exposes every engine
    to the same background load on a shared machine. Returns each engine's runs."""
    for e in engines:
        logger.info("%s %s: warm-up", e.engine, e.label)
        e.warmup()
    runs: list[list[dict[str, Any]]] = [[] for _ in engines]
    k = len(engines)
    for i in range(repeats):
        for j in [(i + s) % k for s in range(k)]:
            gc.collect()
            run = engines[j].run_once()
            run["round"] = i
            logger.info("%s %s: run %d/%d: %.2f tok/s", engines[j].engine, engines[j].label,
                        i + 1, repeats, run["decode_tokens_per_s"])
            runs[j].append(run)
    return runs


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
    """The repository's HEAD, with ``-dirty`` if the working tree has changes."""
    try:
        def git(*args: str) -> str:
            return subprocess.run(
                ["git", *args], cwd=BENCH_DIR, capture_output=True, text=True, check=True, timeout=10
            ).stdout.strip()

        commit = git("rev-parse", "--short", "HEAD")
        return commit + ("-dirty" if git("status", "--porcelain") else "")
    except (OSError, subprocess.SubprocessError):
        return None


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


def render_report(report: dict[str, Any]) -> str:
    """The human-readable summary of a report."""
    m, s, mach = report["model"], report["settings"], report["machine"]
    head = (
        f"decode benchmark: {m['name']} ({m['architecture']}, {m['num_layers']} layers, "
        f"hidden {m['hidden_size']}, heads {m['num_attention_heads']}/{m['num_kv_heads']} kv, "
        f"vocab {m['vocab_size']}), {s['dtype']} on {mach['device']}, "
        f"torch threads {mach['torch_threads']} of {mach['cpu_count']} CPUs\n"
        f"batch 1, greedy, prompt {s['prompt_len']} tokens, {s['max_tokens']} new tokens; "
        f"decode excludes prefill; median of {s['repeats']} runs after a warm-up, engines taking turns"
    )
    ref = report["baselines"].get(REFERENCE_BASELINE)
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
        speed = 1.0 if b is ref else None
        rate_rows.append([name, b["label"], _fmt(b["decode_tokens_per_s"]), _fmt(b["ms_per_token"]),
                          _fmt(100 * b["spread"], 0, "%"),
                          _fmt(speed, suffix="x") if speed else "-", "-",
                          "(reference)" if b is ref else "-",
                          _fmt(b["load_seconds"] + (b.get("compile_seconds") or 0.0), 1, "s")])
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
    for k in report["kiln"]:
        if "error" in k:
            parts += ["", f"kiln {k['label']} unavailable: {k['error']}"]
    noisy = [
        f"{r['engine']} {r['label']}" for r in [*report["kiln"], *report["baselines"].values()]
        if r.get("spread", 0.0) > NOISY_SPREAD
    ]
    if noisy:
        parts += ["", f"note: the runs of {', '.join(noisy)} have a spread over {NOISY_SPREAD:.0%}: "
                      "the machine was busy; rerun, raise --repeats, or try --threads 1"]
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


def write_report(report: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    """Write the report as ``decode-<device>-<stamp>.json`` and overwrite
    ``decode-<device>-latest.json``; each file appears whole (written to ``.tmp``,
    then renamed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    device = report["machine"]["device"].replace(":", "")
    stamp = report["run_stamp"]
    text = json.dumps(scrub_paths(report, _path_placeholders()), indent=2) + "\n"
    paths = (out_dir / f"decode-{device}-{stamp}.json", out_dir / f"decode-{device}-latest.json")
    for path in paths:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return paths


# ---------------------------------------------------------------------------- main


def _parse_list(kind: type, text: str) -> list[Any]:
    return [kind(x) for x in text.replace(",", " ").split()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.decode",
        description="Batch-1 greedy decode: kiln per optimization level against baselines.",
    )
    p.add_argument("--model", type=Path, default=None,
                   help=f"checkpoint directory (default: a {DEFAULT_MODEL_NAME} model with random "
                        "weights, built once in the kiln cache)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (default 128)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt length in token ids (default 32)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine, after a warm-up (default 3)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave as is)")
    p.add_argument("--levels", type=lambda t: _parse_list(int, t), default=[0, 2],
                   help="kiln optimization levels, comma-separated (default 0,2)")
    p.add_argument("--baselines", type=lambda t: [b for b in _parse_list(str, t) if b != "none"],
                   default=["transformers", "transformers-compiled"],
                   help=f"baselines, comma-separated, of: {', '.join(BASELINES)}; or none "
                        "(default transformers)")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto (default: cuda if available)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights and activations (default float32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt's token ids (default 0)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR, help="results directory (default bench/results)")
    args = p.parse_args(argv)
    if args.max_tokens < 2:
        p.error("--max-tokens must be at least 2 (decode needs steps after the first token)")
    for name in ("prompt_len", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be at least 1")
    if not args.levels:
        p.error("--levels needs at least one level")
    unknown = [b for b in args.baselines if b not in BASELINES]
    if unknown:
        p.error(f"unknown baseline(s) {unknown}; known: {list(BASELINES)}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def measure_all(
    model_path: Path, prompt: list[int], levels: Sequence[int], baselines: Sequence[str],
    settings: BenchSettings,
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Load kiln at each level and each baseline, time them taking turns, and
    return (one result per level, in order; baseline name -> result). A level kiln
    refuses to load gets a result holding ``error``."""
    kiln_results: list[dict[str, Any] | None] = []
    engines: list[Engine] = []
    for level in levels:
        try:
            engines.append(KilnEngine(model_path, prompt, level, settings))
            kiln_results.append(None)
        except ValueError as e:
            logger.warning("kiln -O%d is unavailable: %s", level, e)
            kiln_results.append({"engine": "kiln", "level": level, "label": f"-O{level}", "error": str(e)})
    kiln_engines = list(engines)
    engines += [BASELINES[name](model_path, prompt, settings) for name in baselines]
    try:
        runs = measure(engines, settings.repeats)
        summaries = [e.summary(r) for e, r in zip(engines, runs)]
    finally:
        for e in engines:
            e.close()
        gc.collect()
    it = iter(summaries[: len(kiln_engines)])
    kiln_out = [r if r is not None else next(it) for r in kiln_results]
    return kiln_out, dict(zip(baselines, summaries[len(kiln_engines):]))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run every measurement the arguments ask for; return the report."""
    started = dt.datetime.now()
    load_start = _load_average()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.model is None:
        model_path, model_name, model_source = ensure_default_model(), DEFAULT_MODEL_NAME, "built"
    else:
        model_path, model_name, model_source = args.model, args.model.resolve().name, "user"
    model = describe_model(model_path, model_name)
    model["source"] = model_source
    if model_source == "built":
        model["seed"] = MODEL_SEED
        model["weights"] = "random (torch.manual_seed(0), initializer_range 0.02)"
    if args.prompt_len + args.max_tokens > model["max_position_embeddings"]:
        raise SystemExit(
            f"prompt {args.prompt_len} + {args.max_tokens} new tokens exceeds the model's "
            f"max_position_embeddings {model['max_position_embeddings']}"
        )
    prompt = make_prompt(model["vocab_size"], args.prompt_len, args.seed)
    settings = BenchSettings(args.max_tokens, args.repeats, args.device, args.dtype)

    kiln_results, baselines = measure_all(model_path, prompt, args.levels, args.baselines, settings)

    ref = baselines.get(REFERENCE_BASELINE)
    for k in kiln_results:
        if "error" in k or ref is None:
            continue
        k[f"speedup_vs_{REFERENCE_BASELINE}"] = k["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
        k[f"paired_speedup_vs_{REFERENCE_BASELINE}"] = paired_speedup(k["runs"], ref["runs"])
        k.update(compare_tokens(k["token_ids"], ref["token_ids"]))
        if not k["tokens_match"]:
            logger.warning(
                "kiln %s and %s greedy tokens differ from token %d (random fp32 weights can have near-ties)",
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
            "device": args.device,
            "dtype": args.dtype,
            "threads_requested": args.threads,
            "levels": args.levels,
            "baselines": args.baselines,
            "reference_baseline": REFERENCE_BASELINE,
            "notes": [
                "decode tok/s excludes prefill: kiln (N-1)/(t_last_token - t_first_token) from stream "
                "timestamps; transformers (N-1)/(t_generate(N) - t_generate(1)).",
                "kiln step figures are per decode step from RunnerStats deltas; model = model forward + "
                "logits; other = scheduler, engine step bookkeeping and streaming.",
                "on CUDA, kiln's model time is host time without a device sync: queued GPU work lands in "
                "the sampler's time.",
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
        "kiln": kiln_results,
        "baselines": baselines,
    }


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    args = parse_args(argv)
    report = run(args)
    paths = write_report(report, args.out)
    print(render_report(report))
    if report["tokens_match"] is False:
        print("\nwarning: kiln -O0 and transformers greedy tokens differ (near-ties are possible "
              "with random weights); the speed figures stand")
    shown = [os.path.relpath(p) if not os.path.relpath(p).startswith("..") else str(p) for p in paths]
    print(f"\nresults: {shown[0]}\n         {shown[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
