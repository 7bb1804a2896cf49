"""kiln as a measured system: one greedy request at a time streamed through
``Runtime.stream`` (batch 1), or every request at once through
``Runtime.generate`` (throughput). Both load with :func:`load_kiln`, by default
into a fresh compile cache, so that the load time is a cold start."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common.harness import (
    BenchSettings,
    Engine,
    medians,
    rate_spread,
    split_token_ids,
    throughput_figures,
    throughput_summary,
)

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
        """Drop the runtime, and the compile cache if it is the benchmark's own."""
        del self.rt
        if self.own_cache:
            shutil.rmtree(self.cache_dir, ignore_errors=True)


def _compile_cache(settings: BenchSettings) -> tuple[Path, bool]:
    """The compile cache to load into, and whether it is the benchmark's own
    (fresh and empty: removed again when the engine closes)."""
    if settings.kiln_cache_dir is None:
        return Path(tempfile.mkdtemp(prefix="kiln-bench-cache-")), True
    cache_dir = Path(settings.kiln_cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    return cache_dir, False


def _cuda_memory() -> tuple[int, int]:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def load_kiln(model_path: Path, level: int, settings: BenchSettings, *, max_model_len: int,
              max_num_seqs: int) -> LoadedKiln:
    """``Runtime.load`` at ``level``, prefix caching off, timed, into a fresh compile cache (a cold
    start) unless ``settings.kiln_cache_dir`` names a shared one; on CUDA with the
    device memory the load took. Raises what kiln raises (``ValueError`` for a
    level it refuses)."""
    from kiln import Runtime

    cache_dir, own_cache = _compile_cache(settings)
    # Prefix caching off: every repeat runs the warm-up's prompts again, which a
    # prefix cache would serve from the warm-up's blocks (the prefill measured
    # would be a cache hit that the baselines cannot have).
    options: dict[str, Any] = {"cache_dir": cache_dir, "optimization_level": level, "device": settings.device,
                               "dtype": settings.dtype, "max_model_len": max_model_len,
                               "max_num_seqs": max_num_seqs, "enable_prefix_caching": False}
    if settings.attention_backend is not None:
        options["attention_backend"] = settings.attention_backend
    if settings.max_num_batched_tokens is not None:
        options["max_num_batched_tokens"] = settings.max_num_batched_tokens
    if settings.quantization is not None:
        options["quantization"] = settings.quantization
    cuda = settings.device.startswith("cuda")
    before = _cuda_memory() if cuda else (0, 0)
    t0 = time.perf_counter()
    try:
        rt = Runtime.load(model_path, **options)
    except BaseException:
        if own_cache:
            shutil.rmtree(cache_dir, ignore_errors=True)
        raise
    seconds = time.perf_counter() - t0
    memory = None
    if cuda:
        after = _cuda_memory()
        memory = {"allocated_by_load_bytes": after[0] - before[0], "reserved_by_load_bytes": after[1] - before[1],
                  "kv_cache_bytes": rt.startup_report.get("kv_cache_bytes")}
    return LoadedKiln(rt, seconds, cache_dir, own_cache, memory)


class KilnAdapter(Engine):
    """What both kiln adapters share: the load at one level and the result's head."""

    engine = "kiln"

    def __init__(self, model_path: Path, level: int, settings: BenchSettings, *, max_model_len: int,
                 max_num_seqs: int) -> None:
        self.level = level
        self.label = f"-O{level}"
        self.max_tokens = settings.max_tokens
        self.loaded = load_kiln(model_path, level, settings, max_model_len=max_model_len,
                                max_num_seqs=max_num_seqs)
        self.load_seconds = self.loaded.seconds

    @property
    def rt(self) -> Any:
        return self.loaded.rt

    def _params(self, max_tokens: int | None = None) -> Any:
        from kiln import SamplingParams

        return SamplingParams(max_tokens=max_tokens or self.max_tokens, temperature=0, ignore_eos=True)

    def _head(self) -> dict[str, Any]:
        return {"engine": self.engine, "level": self.level, "label": self.label,
                "load_seconds": self.load_seconds, "warmup_seconds": self.warmup_seconds, **self.loaded.info()}

    def close(self) -> None:
        self.loaded.close()


class KilnEngine(KilnAdapter):
    """kiln at one optimization level, streaming one greedy request per run.

    Raises ``ValueError`` when kiln refuses the level (one not built yet).
    """

    _MEDIAN_KEYS = ("decode_tokens_per_s", "prefill_seconds", "step_wall_ms", "model_ms", "outside_model_ms",
                    "prepare_ms", "sample_ms", "other_ms")

    def __init__(self, model_path: Path, prompt: list[int], level: int, settings: BenchSettings) -> None:
        super().__init__(model_path, level, settings, max_model_len=len(prompt) + settings.max_tokens,
                         max_num_seqs=1)
        self.prompt = prompt

    def run_once(self) -> dict[str, Any]:
        """One streamed request, timed per step.

        The first delta arrives after the prefill step; every later delta is one
        decode step. Decode figures cover the steps from the first delta to the
        last; the engine's cumulative stats are snapshotted at both ends.
        """
        rt = self.rt
        tokens: list[int] = []
        first_tokens = 0
        t_first = t_last = 0.0
        stats_first: dict[str, Any] = {}
        t_submit = time.perf_counter()
        for delta in rt.stream(self.prompt, self._params()):
            now = time.perf_counter()
            if not tokens:
                t_first, first_tokens = now, len(delta.token_ids)
                stats_first = dataclasses.asdict(rt.stats())
            tokens.extend(delta.token_ids)
            t_last = now
        stats_last = dataclasses.asdict(rt.stats())
        wall = t_last - t_first
        decode_tokens = len(tokens) - first_tokens
        return {
            "token_ids": tokens,
            "prefill_seconds": t_first - t_submit,
            "decode_seconds": wall,
            "decode_tokens": decode_tokens,
            "decode_tokens_per_s": decode_tokens / wall if wall > 0 else float("nan"),
            **_step_figures(stats_first, stats_last, wall),
        }

    def summary(self, runs: list[dict[str, Any]]) -> dict[str, Any]:
        """Medians of each figure (each taken separately), and every run."""
        runs, token_ids, deterministic = split_token_ids(runs)
        result = {**self._head(), "deterministic_across_runs": deterministic, **medians(runs, self._MEDIAN_KEYS)}
        result["ms_per_token"] = 1e3 / result["decode_tokens_per_s"]
        result.update(rate_spread([r["decode_tokens_per_s"] for r in runs]))
        result["runs"] = runs
        result["token_ids"] = token_ids
        return result


def _step_figures(first: dict[str, Any], last: dict[str, Any], wall: float) -> dict[str, Any]:
    """Per decode step between two ``EngineStats`` snapshots: the wall time, the
    engine's prepare/model/sample time, and the rest (scheduler, bookkeeping,
    streaming)."""
    steps = int(last["steps"] - first["steps"])
    per_step = {key.removesuffix("_seconds"): (last[key] - first[key]) * 1e3 / max(steps, 1)
                for key in ("prepare_seconds", "model_seconds", "sample_seconds")}
    step_wall_ms = wall * 1e3 / max(steps, 1)
    outside_ms = step_wall_ms - per_step["model"]
    return {
        "decode_steps": steps,
        "step_wall_ms": step_wall_ms,
        "model_ms": per_step["model"],
        "outside_model_ms": outside_ms,
        "prepare_ms": per_step["prepare"],
        "sample_ms": per_step["sample"],
        "other_ms": outside_ms - per_step["prepare"] - per_step["sample"],
    }


class KilnThroughputEngine(KilnAdapter):
    """kiln at one level: every prompt submitted at once through
    ``Runtime.generate`` (``max_num_seqs`` = the number of prompts), greedy, EOS
    ignored, each request with its own token budget when ``settings.output_lens``
    gives them. A run is the whole batch, prefill included."""

    rate_key = "output_tokens_per_s"

    def __init__(self, model_path: Path, prompts: list[list[int]], level: int, settings: BenchSettings) -> None:
        super().__init__(model_path, level, settings, max_model_len=max(map(len, prompts)) + settings.max_tokens,
                         max_num_seqs=len(prompts))
        self.prompts = prompts
        lens = settings.output_lens
        self.params = [self._params(n) for n in lens] if lens else self._params()

    def run_once(self) -> dict[str, Any]:
        """The whole batch, stepped here so that each step's wall time is
        filed under prefill (it ran prompt tokens) or decode (one token per
        running request: as many tokens scheduled as generated)."""
        rt = self.rt
        params = self.params if isinstance(self.params, list) else [self.params] * len(self.prompts)
        stats0 = rt.stats()
        t0 = time.perf_counter()
        rids = [rt.add_request(p, sp) for p, sp in zip(self.prompts, params)]
        split = {"prefill": 0.0, "decode": 0.0}
        before, pending = stats0, set(rids)
        while pending:
            t = time.perf_counter()
            for delta in rt.step():
                if delta.finished:
                    pending.discard(delta.request_id)
            after = rt.stats()
            decode = after.scheduled_tokens - before.scheduled_tokens == after.generated_tokens - before.generated_tokens
            split["decode" if decode else "prefill"] += time.perf_counter() - t
            before = after
        outs = [rt.release(r) for r in rids]
        wall = time.perf_counter() - t0
        steps = before.steps - stats0.steps
        result = throughput_figures(wall, [o.token_ids for o in outs], sum(map(len, self.prompts)))
        result.update({
            "steps": steps,
            "step_wall_ms": wall * 1e3 / max(steps, 1),
            "model_ms": (before.model_seconds - stats0.model_seconds) * 1e3 / max(steps, 1),
            "prefill_seconds": split["prefill"],
            "decode_seconds": split["decode"],
        })
        return result

    def summary(self, runs: list[dict[str, Any]]) -> dict[str, Any]:
        return {**self._head(), **throughput_summary(runs, ("output_tokens_per_s", "total_tokens_per_s",
                                                            "wall_seconds", "steps", "step_wall_ms", "model_ms",
                                                            "prefill_seconds", "decode_seconds"))}
