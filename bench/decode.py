"""Greedy decode benchmark: kiln against transformers, eager and compiled.

Run from the repository root::

    python -m bench.decode                      # SmolLM2-135M shape, random fp32 weights, CPU
    python -m bench.decode --model DIR --max-tokens 64 --repeats 5 --threads 2
    python -m bench.decode --shape qwen3-0.6b --device cuda --dtype bfloat16 --levels 0,1,2
    python -m bench.decode --shape qwen3-0.6b --device cuda --throughput 64   # 64 requests at once
    python -m bench.decode --shape qwen3-tiny --max-tokens 4 --prompt-len 8 --repeats 1   # smoke test

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

Batch 1 also reports each engine's prefill rate, ``--prompt-len`` over the time to
the first token (``--prompt-len 512 --max-tokens 2``: a 512-token prefill).

**Throughput** (``--throughput N``): N requests submitted at once, of mixed
lengths by default: prompts ``--prompt-len`` (default 128) x 1, 1/8, 1/2, 1/4,
3/4 and budgets ``--max-tokens`` (default 128) x 1, 1/4, 3/4, 1/2, cycled
(``--same-lengths``: every request both maxima). kiln runs them through its
engine (continuous batching, ``max_num_seqs`` N, each request stopped at its
budget); the baselines through one batched ``generate``, left-padded to the
longest prompt and run to the longest budget, each request credited with its
own budget's tokens. The figure is output tokens over the wall time of the
whole batch, prefill included, with the time split between prefill and decode.

Both modes record, per kiln level, the CUDA graph figures of its
``startup_report`` and, on CUDA, the device memory its load took.

Models (``--shape``, see ``bench.common.models``): ``smollm2-135m`` (the
default; fp32), ``qwen3-0.6b`` (bf16) and ``qwen3-tiny`` (smoke tests of this
script only). ``--model`` runs any checkpoint instead: a directory, a ``.gguf``
file, ``demo`` or ``random-demo`` (the prompts stay random token ids;
``bench.real_model`` runs a real model on real prompts, fp32 and bf16 at once).

It prints a table and writes JSON to ``bench/results/decode-<device>-<timestamp>.json``
and ``bench/results/decode-<device>-latest.json`` (throughput:
``decode-throughput-<device>-...``).

The systems measured are adapters in ``bench.adapters``; the harness
(``bench.common.harness``) sets each up in turn, eager ones first, then has them
take turns, one timed run each per round. An engine that fails to load, warm up
or run is recorded with its error and the others go on; ``--time-budget`` skips
the set-ups, and the rounds after the first, that would start after the budget
is spent. The exit status is 1 when any engine was not measured; the JSON is
written all the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.adapters import BASELINES, THROUGHPUT_BASELINES, KilnEngine, KilnThroughputEngine
from bench.common.bandwidth import attach_bandwidth, decode_traffic, machine_read_bandwidth
from bench.common.harness import NOISY_SPREAD, BenchSettings, Engine, EngineSpec, median, run_engines
from bench.common.models import (
    DEFAULT_SHAPE,
    MODEL_SEED,
    SHAPES,
    describe_model,
    ensure_shape_model,
    make_prompt,
    resolve_model_arg,
)
from bench.common.report import RESULTS_DIR, RunRecord, publish
from bench.common.roofline import machine_matmul_rate, model_cost, throughput_roofline
from bench.decode_tables import REFERENCE_BASELINE, render_report, render_throughput_report

logger = logging.getLogger("bench.decode")


# --------------------------------------------------------------------- arguments


# --throughput's mixed lengths, cycled over the requests (5 and 4 entries: 20
# distinct pairs). transformers' padded batch pays for the longest of each.
PROMPT_LEN_FRACTIONS = (1.0, 0.125, 0.5, 0.25, 0.75)
OUTPUT_LEN_FRACTIONS = (1.0, 0.25, 0.75, 0.5)


def throughput_lengths(n: int, prompt_len: int, max_tokens: int, same: bool) -> tuple[list[int], list[int]]:
    """Each of ``n`` requests' prompt length and new-token budget."""
    if same:
        return [prompt_len] * n, [max_tokens] * n
    prompts = [max(1, round(prompt_len * PROMPT_LEN_FRACTIONS[i % len(PROMPT_LEN_FRACTIONS)])) for i in range(n)]
    budgets = [max(2, round(max_tokens * OUTPUT_LEN_FRACTIONS[i % len(OUTPUT_LEN_FRACTIONS)])) for i in range(n)]
    return prompts, budgets


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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.decode",
        description="Greedy decode, batch 1 or --throughput N: kiln per optimization level against baselines.",
    )
    p.add_argument("--model", default=None,
                   help="checkpoint directory, .gguf file, demo or random-demo (default: the --shape model "
                        "with random weights, built once in the kiln cache)")
    p.add_argument("--shape", choices=list(SHAPES), default=None,
                   help=f"benchmark model to build and run (default {DEFAULT_SHAPE}; qwen3-tiny is for smoke "
                        "tests of this script); not with --model")
    p.add_argument("--throughput", type=int, default=0, metavar="N",
                   help="throughput mode: N requests submitted at once (default 0: batch-1 decode)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (default 128)")
    p.add_argument("--prompt-len", type=int, default=None,
                   help="prompt length in token ids (default 32; with --throughput the longest, default 128)")
    p.add_argument("--same-lengths", action="store_true",
                   help="--throughput: every request gets --prompt-len and --max-tokens (default: mixed, "
                        f"--prompt-len x {'/'.join(map(str, PROMPT_LEN_FRACTIONS))} and --max-tokens x "
                        f"{'/'.join(map(str, OUTPUT_LEN_FRACTIONS))}, cycled)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine, after a warm-up (default 3)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave as is)")
    p.add_argument("--levels", type=_parse_levels, default=[0, 2],
                   help="kiln optimization levels, comma-separated, e.g. 0,1,2 (default 0,2); or none")
    p.add_argument("--baselines", type=lambda t: [b for b in _parse_list(str, t) if b != "none"],
                   default=["transformers", "transformers-compiled"],
                   help=f"baselines, comma-separated, of: {', '.join(BASELINES)}; or none (default both)")
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
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory (default bench/results)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = _parser()
    args = p.parse_args(argv)
    if args.model is not None and args.shape is not None:
        p.error("--model and --shape exclude each other")
    if args.model is None and args.shape is None:
        args.shape = DEFAULT_SHAPE
    if args.model is not None:
        try:
            args.model = resolve_model_arg(args.model)
        except ValueError as e:
            p.error(f"--model: {e}")
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


# ---------------------------------------------------------------------- measuring


def measure_all(
    levels: Sequence[int], baselines: Sequence[str], kiln_engine: Callable[[int], Engine],
    baseline_engine: Callable[[str], Engine], repeats: int, deadline: float | None,
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Build kiln at each level (``kiln_engine(level)``) and each baseline
    (``baseline_engine(name)``), time them taking turns, and return (one result per
    level, in order; baseline name -> result). A level kiln refuses to load, or an
    engine that fails, gets a result holding ``error``."""
    specs = [EngineSpec({"engine": "kiln", "level": level, "label": f"-O{level}"},
                        functools.partial(kiln_engine, level)) for level in levels]
    specs += [EngineSpec({"engine": name, "label": name}, functools.partial(baseline_engine, name))
              for name in baselines]
    results = run_engines(specs, repeats, deadline)
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


def _prepare(args: argparse.Namespace) -> tuple[Path, dict[str, Any], BenchSettings, float | None]:
    """Set the thread count; return the model (path and description), the engines'
    settings, and the ``--time-budget`` deadline."""
    t_start = time.perf_counter()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model_path, model = resolve_model(args)
    settings = BenchSettings(args.max_tokens, args.repeats, args.device, args.dtype,
                             attention_backend=args.attention_backend, kiln_cache_dir=args.kiln_cache_dir,
                             max_num_batched_tokens=args.max_num_batched_tokens)
    deadline = None if args.time_budget is None else t_start + args.time_budget
    return model_path, model, settings, deadline


def _common_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "warmup_runs": 1,
        "schedule": "engines take turns: each round runs every engine once, order rotating",
        "noisy_spread_threshold": NOISY_SPREAD,
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


def _reference(baselines: dict[str, dict[str, Any]], model: dict[str, Any]) -> dict[str, Any] | None:
    """The reference baseline's result, unless it failed; the model's parameter
    count is taken from it."""
    ref = baselines.get(REFERENCE_BASELINE)
    if ref is None or "error" in ref:
        return None
    model["num_parameters"] = ref.get("num_parameters")
    return ref


def compare_tokens(a: list[int], b: list[int]) -> dict[str, Any]:
    """Whether two greedy outputs agree, and where they first differ."""
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    return {"tokens_match": first is None, "first_mismatch": first}


def _rates_by_engine(kiln_results: list[dict[str, Any]], baselines: dict[str, dict[str, Any]],
                     key: str) -> dict[str, float | None]:
    rates = {f"kiln {k['label']}": k.get(key) for k in kiln_results}
    rates.update({name: b.get(key) for name, b in baselines.items()})
    return rates


# ------------------------------------------------------------------------ batch 1


def _compare_batch1(kiln_results: list[dict[str, Any]], ref: dict[str, Any]) -> None:
    """Add each measured kiln level's speedup over ``ref`` (of the medians, and the
    median of the per-round ratios) and whether its tokens match ``ref``'s."""
    for k in kiln_results:
        if "error" in k:
            continue
        k[f"speedup_vs_{REFERENCE_BASELINE}"] = k["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
        k[f"paired_speedup_vs_{REFERENCE_BASELINE}"] = median(
            [a["decode_tokens_per_s"] / b["decode_tokens_per_s"] for a, b in zip(k["runs"], ref["runs"])])
        k.update(compare_tokens(k["token_ids"], ref["token_ids"]))
        if not k["tokens_match"]:
            logger.warning("kiln %s and %s greedy tokens differ from token %d (random weights can have near-ties)",
                           k["label"], REFERENCE_BASELINE, k["first_mismatch"])


BATCH1_NOTES = [
    "decode tok/s excludes prefill: kiln (N-1)/(t_last_token - t_first_token) from stream "
    "timestamps; transformers (N-1)/(t_generate(N) - t_generate(1)).",
    "kiln step figures are per decode step from EngineStats deltas; model = model forward + "
    "logits; other = scheduler, engine step bookkeeping and streaming.",
    "on CUDA, kiln's model time is host time without a device sync: queued GPU work lands in "
    "the sampler's time.",
    "kiln load_seconds is a cold start (trace, compile, CUDA graph capture) only with a fresh "
    "compile cache per engine, the default; see settings.kiln_compile_cache.",
]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the batch-1 measurements the arguments ask for; return the report."""
    record = RunRecord("decode", args.device)
    model_path, model, settings, deadline = _prepare(args)
    prompt = make_prompt(model["vocab_size"], args.prompt_len, args.seed)
    machine_before = machine_read_bandwidth() if args.device == "cpu" else None
    kiln_results, baselines = measure_all(
        args.levels, args.baselines, lambda level: KilnEngine(model_path, prompt, level, settings),
        lambda name: BASELINES[name](model_path, prompt, settings), args.repeats, deadline)
    ref = _reference(baselines, model)
    if ref is not None:
        _compare_batch1(kiln_results, ref)
    for r in [*kiln_results, *baselines.values()]:
        if "error" not in r and r.get("prefill_seconds"):
            r["prefill_tokens_per_s"] = args.prompt_len / r["prefill_seconds"]
    bandwidth = None
    if machine_before is not None:
        bandwidth = _bandwidth(model_path, model, args, [*kiln_results, *baselines.values()],
                               machine_before, machine_read_bandwidth())
    level0 = next((k for k in kiln_results if k["level"] == 0 and "error" not in k), {})
    return {
        **record.head(),
        "model": model,
        "settings": {
            "batch_size": 1, "sampling": "greedy (temperature 0), EOS ignored", "prompt_len": args.prompt_len,
            "prompt_seed": args.seed,
            "statistic": "median over repeats, each figure separately (transformers: medians of "
                         "t_generate(N) and t_generate(1)); best/worst/spread of the per-run rates too",
            **_common_settings(args), "notes": BATCH1_NOTES,
        },
        "prompt_token_ids": prompt,
        # Headline figures (kiln -O0 against the reference baseline).
        "kiln_decode_tokens_per_s": level0.get("decode_tokens_per_s"),
        f"{REFERENCE_BASELINE}_decode_tokens_per_s": ref["decode_tokens_per_s"] if ref else None,
        "speedup_kiln_vs_transformers": level0.get(f"speedup_vs_{REFERENCE_BASELINE}"),
        "paired_speedup_kiln_vs_transformers": level0.get(f"paired_speedup_vs_{REFERENCE_BASELINE}"),
        "kiln_outside_model_ms_per_step": level0.get("outside_model_ms"),
        "tokens_match": level0.get("tokens_match"),
        "decode_tokens_per_s_by_engine": _rates_by_engine(kiln_results, baselines, "decode_tokens_per_s"),
        "bandwidth": bandwidth,
        "kiln": kiln_results,
        "baselines": baselines,
    }


def _bandwidth(model_path: Path, model: dict[str, Any], args: argparse.Namespace, results: list[dict[str, Any]],
               before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The bytes a decode step reads, the machine's read bandwidth before and
    after the engines ran (the higher median is the roofline), and each
    result's share of it (added to the result as ``bandwidth``)."""
    machine = max(before, after, key=lambda m: m["gb_per_s"])
    traffic = attach_bandwidth(model_path, model, args.dtype, args.prompt_len + args.max_tokens / 2, results,
                               machine)
    return {"traffic": traffic, "machine": machine, "machine_before": before, "machine_after": after}


# --------------------------------------------------------------------- throughput


def _compare_throughput(results: list[dict[str, Any]], ref: dict[str, Any]) -> None:
    """Add each measured engine's speedup over ``ref`` and how many of its requests
    produced ``ref``'s tokens."""
    for r in results:
        if "error" in r:
            continue
        r[f"speedup_vs_{REFERENCE_BASELINE}"] = r["output_tokens_per_s"] / ref["output_tokens_per_s"]
        if r is ref:
            continue
        per_request = [compare_tokens(a, b) for a, b in zip(r["token_ids"], ref["token_ids"])]
        r["requests_matching_reference"] = sum(c["tokens_match"] for c in per_request)
        mismatches = [c["first_mismatch"] for c in per_request if not c["tokens_match"]]
        r["median_first_mismatch"] = median(mismatches) if mismatches else None


THROUGHPUT_NOTES = [
    "output tok/s = requests * max_tokens / wall time of the whole batch, prefill included; "
    "total tok/s counts the prompt tokens too.",
    "kiln: every request submitted at once, max_num_seqs = requests, "
    "continuous batching with chunked prefill under max_num_batched_tokens; prefix caching off "
    "(every run repeats the warm-up's prompts, which a prefix cache would serve).",
    "transformers: one batched generate, prompts left-padded to the longest (attention mask), run to "
    "the longest budget, each request credited with its own budget's tokens (static batching).",
    "mixed lengths (the default): prompts --prompt-len x PROMPT_LEN_FRACTIONS, budgets --max-tokens x "
    "OUTPUT_LEN_FRACTIONS, cycled over the requests; --same-lengths gives every request both maxima.",
    "requests_matching_reference: requests whose greedy tokens equal transformers eager's; "
    "batched low-precision arithmetic makes near-ties diverge, so this is informational.",
]


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    """Run the throughput measurements (``--throughput N``); return the report."""
    record = RunRecord("decode-throughput", args.device)
    model_path, model, settings, deadline = _prepare(args)
    prompt_lens, budgets = throughput_lengths(args.throughput, args.prompt_len, args.max_tokens, args.same_lengths)
    settings = dataclasses.replace(settings, output_lens=None if args.same_lengths else tuple(budgets))
    prompts = [make_prompt(model["vocab_size"], n, args.seed + i) for i, n in enumerate(prompt_lens)]
    machine_before = _machine_rates(args.dtype) if args.device == "cpu" else None
    kiln_results, baselines = measure_all(
        args.levels, args.baselines, lambda level: KilnThroughputEngine(model_path, prompts, level, settings),
        lambda name: THROUGHPUT_BASELINES[name](model_path, prompts, settings), args.repeats, deadline)
    ref = _reference(baselines, model)
    if ref is not None:
        _compare_throughput([*kiln_results, *baselines.values()], ref)
    roofline = None
    if machine_before is not None:
        roofline = _roofline(model_path, model, args.dtype, prompt_lens, budgets,
                             [*kiln_results, *baselines.values()], ref, machine_before, _machine_rates(args.dtype))
    for r in [*kiln_results, *baselines.values()]:
        r.pop("token_ids", None)  # N x max_tokens ids: kept out of the JSON
    return {
        **record.head(),
        "model": model,
        "settings": {
            "num_requests": args.throughput, "sampling": "greedy (temperature 0), EOS ignored",
            "prompt_len": args.prompt_len, "lengths": "same" if args.same_lengths else "mixed",
            "prompt_lens": prompt_lens, "output_lens": budgets,
            "prompt_tokens": sum(prompt_lens), "output_tokens": sum(budgets),
            "prompt_seeds": f"{args.seed}..{args.seed + args.throughput - 1} (one per request)",
            "statistic": "median over repeats of each figure; best/worst/spread of the per-run rates too",
            **_common_settings(args), "notes": THROUGHPUT_NOTES,
        },
        "output_tokens_per_s_by_engine": _rates_by_engine(kiln_results, baselines, "output_tokens_per_s"),
        "roofline": roofline,
        "kiln": kiln_results,
        "baselines": baselines,
    }


def _machine_rates(dtype: str) -> dict[str, Any]:
    """The machine's matrix-multiply rate in ``dtype`` and its read bandwidth, now."""
    return {"matmul": machine_matmul_rate(dtype), "read": machine_read_bandwidth()}


def _roofline(model_path: Path, model: dict[str, Any], dtype: str, prompt_lens: list[int], budgets: list[int],
              results: list[dict[str, Any]], ref: dict[str, Any] | None, before: dict[str, Any],
              after: dict[str, Any]) -> dict[str, Any]:
    """The workload's roofline estimate (``bench.common.roofline``) at the
    better of the machine's rates before and after the engines ran, each
    measured result's share of it (``roofline_fraction``: estimate / wall
    time) and, against the reference baseline's result ``ref`` (or None),
    the speedup an engine at the estimate would have
    (``ceiling_speedup_vs_...``)."""
    matmul = max(before["matmul"], after["matmul"], key=lambda m: m["gflop_per_s"])
    read = max(before["read"], after["read"], key=lambda m: m["gb_per_s"])
    weights = decode_traffic(model_path, model, dtype, 0)["weight_bytes"]
    estimate = throughput_roofline(model_cost(model, dtype, weights), prompt_lens, budgets, matmul["gflop_per_s"],
                                   read["gb_per_s"])
    for r in results:
        if "error" not in r:
            r["roofline_fraction"] = round(estimate["seconds"] / r["wall_seconds"], 3)
    if ref is not None:
        estimate[f"ceiling_speedup_vs_{REFERENCE_BASELINE}"] = round(ref["wall_seconds"] / estimate["seconds"], 2)
    return {**estimate, "weight_bytes": weights, "matmul": matmul, "read": read,
            "machine_before": before, "machine_after": after}


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    args = parse_args(argv)
    if args.throughput:
        report = run_throughput(args)
        publish(report, "decode-throughput", render_throughput_report(report), args.out)
    else:
        report = run(args)
        publish(report, "decode", render_report(report), args.out)
        if report["tokens_match"] is False:
            print("\nwarning: kiln -O0 and transformers greedy tokens differ (near-ties are possible "
                  "with random weights); the speed figures stand")
    failed = [f"{r['engine']} {r['label']}" for r in [*report["kiln"], *report["baselines"].values()]
              if "error" in r]
    if failed:
        print(f"\nnot measured: {', '.join(failed)} (see the errors above and in the JSON)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
