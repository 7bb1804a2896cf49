"""Measuring: the engine adapter interface, the turn-taking repeat loop, and the
statistics over runs; plus the per-call timer of the micro-benchmarks.

Whole-system benchmarks (``bench.decode``) compare engines on a shared machine,
where background load comes and goes. So every engine is set up and warmed up
first, then the engines take turns, one timed run each per round with the order
rotating (:func:`run_engines`): the noise hits them alike, and each result
carries the spread of its runs. An engine that fails is recorded with its error
and the others go on.
"""

from __future__ import annotations

import abc
import dataclasses
import gc
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("bench.harness")

NOISY_SPREAD = 0.2  # runs whose rates differ by more than this (relative to the median) are flagged


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
    # throughput: each request's new tokens (max_tokens is their maximum); None: max_tokens each
    output_lens: tuple[int, ...] | None = None
    quantization: str | None = None  # kiln's Runtime.load(quantization=...); None: dense weights

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


class Engine(abc.ABC):
    """One configuration being measured (an adapter around one system): loaded
    when built, warmed up once, then timed one run at a time so that several
    engines can take turns.

    Subclasses set ``engine`` and ``label`` and implement ``run_once`` and
    ``summary``; ``warmup`` defaults to one untimed ``run_once``. ``summary``
    returns the engine's result: a dict holding at least ``engine``, ``label``,
    the ``rate_key`` figure and ``runs``.
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
        """One timed run; holds at least the ``rate_key`` figure and ``token_ids``."""

    @abc.abstractmethod
    def summary(self, runs: list[dict[str, Any]]) -> dict[str, Any]:
        """The result over the timed runs."""

    def close(self) -> None:
        """Drop the model."""


# ------------------------------------------------------------------- statistics


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def rate_spread(rates: Sequence[float], key: str = "decode_tokens_per_s") -> dict[str, float]:
    """The best and worst of the per-run rates, and their spread relative to the
    median: noise on a shared machine only ever slows a run down, so a large spread
    means the median may be pessimistic."""
    mid = median(rates)
    return {
        f"best_{key}": max(rates),
        f"worst_{key}": min(rates),
        "spread": (max(rates) - min(rates)) / mid if mid > 0 else float("inf"),
    }


def split_token_ids(runs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], Any, bool]:
    """Copies of ``runs`` without their token ids, the first run's ids, and whether
    every run produced the same ones."""
    runs = [dict(r) for r in runs]
    token_ids = runs[0].pop("token_ids")
    deterministic = all(r.pop("token_ids") == token_ids for r in runs[1:])
    return runs, token_ids, deterministic


def medians(runs: Sequence[dict[str, Any]], keys: Sequence[str]) -> dict[str, float]:
    """The median of each of ``keys`` over ``runs``, each taken separately."""
    return {key: median([r[key] for r in runs]) for key in keys}


def throughput_figures(wall: float, token_ids: list[list[int]], num_prompt_tokens: int) -> dict[str, Any]:
    """One throughput run's figures: a whole batch's output tokens over its wall time."""
    out_tokens = sum(len(t) for t in token_ids)
    return {
        "token_ids": token_ids,
        "wall_seconds": wall,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall if wall > 0 else float("nan"),
        "total_tokens_per_s": (out_tokens + num_prompt_tokens) / wall if wall > 0 else float("nan"),
    }


def throughput_summary(runs: list[dict[str, Any]], median_keys: Sequence[str]) -> dict[str, Any]:
    """Medians of ``median_keys``, the spread of the rates, the runs (without token
    ids) and the first run's token ids."""
    runs, token_ids, deterministic = split_token_ids(runs)
    return {
        "deterministic_across_runs": deterministic,
        **medians(runs, median_keys),
        **rate_spread([r["output_tokens_per_s"] for r in runs], key="output_tokens_per_s"),
        "runs": runs,
        "token_ids": token_ids,
    }


def sync(device: str) -> None:
    """Wait for the device, so that a host clock read covers its queued work."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ------------------------------------------------------------- taking turns


def error_text(e: BaseException) -> str:
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
        return f"warm-up failed: {error_text(exc)}"
    return None


def measure(
    engines: Sequence[Engine], repeats: int, deadline: float | None = None,
    errors: Sequence[str | None] | None = None,
) -> tuple[list[list[dict[str, Any]]], list[str | None]]:
    """Time ``repeats`` rounds in which each engine (warmed up already) runs once;
    the order rotates from round to round. Taking turns exposes every engine to
    the same background load on a shared machine.

    An engine whose run raises is dropped from later rounds, with its error
    (``errors``: ones known already, None for a healthy engine). After
    ``deadline`` (a ``time.perf_counter()`` value) no round starts but the first.
    Returns each engine's runs and each one's error (None when it ran through)."""
    errs: list[str | None] = list(errors) if errors is not None else [None] * len(engines)
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
            e = engines[j]
            try:
                run = e.run_once()
            except Exception as exc:
                logger.exception("%s %s: run %d failed", e.engine, e.label, i + 1)
                errs[j] = f"run {i + 1} failed: {error_text(exc)}"
                continue
            run["round"] = i
            logger.info("%s %s: run %d/%d: %.2f tok/s", e.engine, e.label, i + 1, repeats, run[e.rate_key])
            runs[j].append(run)
    return runs, errs


@dataclasses.dataclass
class EngineSpec:
    """A configuration to measure: what its result says if it fails, and how to
    build its engine."""

    placeholder: dict[str, Any]  # engine, label (and level): the result's head when it fails
    build: Callable[[], Engine]

    @property
    def name(self) -> str:
        engine, label = self.placeholder["engine"], self.placeholder["label"]
        return engine if label == engine else f"{engine} {label}"

    @property
    def setup_rank(self) -> int:
        """Set-up order: eager engines first (cheap), then kiln's compiled levels,
        then compiled baselines, so that a --time-budget cuts the costliest last."""
        p = self.placeholder
        if p["engine"] == "kiln":
            return 0 if p.get("level") == 0 else 1
        return 2 if "compiled" in p["engine"] else 0

    def failed(self, error: str) -> dict[str, Any]:
        return {**self.placeholder, "error": error}


def _set_up(spec: EngineSpec, deadline: float | None) -> Engine | dict[str, Any]:
    """Build and warm up the spec's engine; or, when it is skipped or fails, its
    result holding ``error`` (the engine closed)."""
    if _past(deadline):
        logger.warning("%s: skipped: the --time-budget was spent before it was set up", spec.name)
        return spec.failed("skipped: the --time-budget was spent before it was set up")
    logger.info("%s: loading", spec.name)
    try:
        engine = spec.build()
    except Exception as exc:  # recorded; the other engines go on
        if isinstance(exc, ValueError) and spec.placeholder["engine"] == "kiln":
            logger.warning("kiln %s is unavailable: %s", spec.placeholder["label"], exc)
        else:
            logger.exception("%s: load failed", spec.name)
        return spec.failed(error_text(exc))
    error = _warm_up(engine)
    if error is not None:
        engine.close()
        return spec.failed(error)
    return engine


def _summarize(spec: EngineSpec, engine: Engine, runs: list[dict[str, Any]], error: str | None) -> dict[str, Any]:
    if error is None and not runs:
        error = "no timed run completed"
    if error is not None:
        return spec.failed(error)
    try:
        return engine.summary(runs)
    except Exception as exc:
        logger.exception("%s: summary failed", spec.name)
        return spec.failed(f"summary failed: {error_text(exc)}")


def run_engines(specs: Sequence[EngineSpec], repeats: int, deadline: float | None) -> list[dict[str, Any]]:
    """Set every engine up (load, then warm up: compilation happens in one or the
    other), measure them taking turns, and return one result per spec, in the
    specs' order: its engine's summary, or its placeholder with ``error``.

    Set-up goes cheapest first (:attr:`EngineSpec.setup_rank`); a spec whose
    set-up would start after ``deadline`` is skipped."""
    results: dict[int, dict[str, Any]] = {}
    built: dict[int, Engine] = {}
    try:
        for i in sorted(range(len(specs)), key=lambda i: (specs[i].setup_rank, i)):
            outcome = _set_up(specs[i], deadline)
            if isinstance(outcome, Engine):
                built[i] = outcome
            else:
                results[i] = outcome
        runs, errors = measure(list(built.values()), repeats, deadline)
        for (i, engine), r, err in zip(built.items(), runs, errors):
            results[i] = _summarize(specs[i], engine, r, err)
    finally:
        for engine in built.values():
            engine.close()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return [results[i] for i in range(len(specs))]


# ------------------------------------------------------- micro-benchmark timing


def time_per_call(fn: Callable[[], Any], *, repeats: int, min_batch_seconds: float,
                  warmup: int = 3) -> dict[str, Any]:
    """Milliseconds per call of ``fn`` on the host clock, summarized by
    :func:`timing_summary` over ``repeats`` batches of back-to-back calls. Each
    batch lasts about ``min_batch_seconds`` (its call count is sized from ten
    calls after the warm-up), long enough for the clock's resolution not to
    matter; the median over batches discounts those that background load hit."""
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    for _ in range(10):
        fn()
    estimate = max((time.perf_counter() - t0) / 10, 1e-8)
    calls = max(1, int(min_batch_seconds / estimate))
    per_call_ms = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call_ms.append((time.perf_counter() - t0) * 1e3 / calls)
    return {**timing_summary(sorted(per_call_ms), "host clock, batches of back-to-back calls"),
            "batches": repeats, "calls_per_batch": calls}


def timing_summary(times_ms: Sequence[float], method: str) -> dict[str, Any]:
    """Median, 20th/80th percentile and minimum of sorted ``times_ms``, and how
    they were taken."""

    def pct(p: float) -> float:
        return times_ms[min(len(times_ms) - 1, max(0, round(p * (len(times_ms) - 1))))]

    return {"median_ms": statistics.median(times_ms), "p20_ms": pct(0.2), "p80_ms": pct(0.8),
            "min_ms": times_ms[0], "method": method}
