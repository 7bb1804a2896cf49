"""The real-model benchmark: kiln -O0 and -O2 against transformers eager and
compiled on a real checkpoint with real prompts, batch-1 decode and N-request
throughput, in fp32 and bf16, all in one run.

Run from the repository root::

    python -m bench.real_model                  # SmolLM2-135M-Instruct (Q4_1 GGUF, `kiln fetch-demo`), CPU
    python -m bench.real_model --model random-demo --max-tokens 8 --throughput 4 --repeats 1   # smoke test
    python -m bench.real_model --model DIR_OR_GGUF --dtypes float32 --levels 0

Prompts are :data:`bench.common.models.CHAT_PROMPTS`, English questions and
story openings, each rendered as a user message through the model's chat
template and tokenized by its own tokenizer. Batch 1 decodes one of them
(``--batch1-prompt``); throughput submits ``--throughput`` of them at once with
mixed output budgets (``--max-tokens`` x 1, 1/4, 3/4, 1/2, cycled; kiln stops
each request at its budget, transformers' one batched generate runs to the
longest and each request keeps its own budget's tokens; ``--same-lengths``
gives every request ``--max-tokens``).

The engines are ``bench.adapters``' and the measuring is ``bench.decode``'s:
for each mode every engine of every dtype is set up (eager first), then they
all take turns, one timed run each per round, so that fp32 and bf16 meet the
same background load. A GGUF is dequantized by each engine to the run dtype.

Greedy tokens are compared with transformers eager's of the same dtype: in
fp32 kiln's must be equal (the exit status is 1 when they are not); in bf16,
where kiln and transformers order their arithmetic differently, the agreement
is reported as a fraction (the share of tokens before the first difference).

It prints Markdown tables (tok/s per engine and dtype, kiln/transformers per
dtype, bf16/fp32 per engine, load times) and writes the JSON through
``bench.common.report`` as ``bench/results/real-model-<device>-<stamp>.json``
and ``...-latest.json``; ``machine.cpu_bf16`` records the CPU's bf16 support
(AMX, AVX-512 BF16, torch's kernel capability).
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
from bench.common.bandwidth import attach_bandwidth, machine_read_bandwidth
from bench.common.harness import NOISY_SPREAD, BenchSettings, Engine, EngineSpec, run_engines
from bench.common.machine import cpu_bf16_support
from bench.common.models import chat_prompts, describe_model, load_tokenizer, resolve_model_arg
from bench.common.report import RESULTS_DIR, RunRecord, fmt, markdown_table, publish
from bench.decode import BATCH1_NOTES, THROUGHPUT_NOTES, _parse_levels, _parse_list, compare_tokens
from bench.decode_tables import REFERENCE_BASELINE

logger = logging.getLogger("bench.real_model")

COMPILED_BASELINE = "transformers-compiled"
EXACT_DTYPE = "float32"  # where kiln's tokens must equal transformers'
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
OUTPUT_LEN_FRACTIONS = (1.0, 0.25, 0.75, 0.5)  # throughput budgets: --max-tokens x these, cycled
MODES = {  # mode -> (rate key, what the rate is)
    "batch1": ("decode_tokens_per_s", "batch-1 decode tok/s (prefill excluded)"),
    "throughput": ("output_tokens_per_s", "output tok/s (whole batch, prefill included)"),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.real_model",
        description="kiln against transformers on a real model and prompts: batch-1 decode and N-request "
                    "throughput, in each --dtypes, in one run.",
    )
    p.add_argument("--model", default="demo",
                   help="checkpoint directory, .gguf file, demo (SmolLM2-135M-Instruct Q4_1 GGUF, after "
                        "`kiln fetch-demo`; the default) or random-demo")
    p.add_argument("--dtypes", type=lambda t: _parse_list(str, t), default=["float32", "bfloat16"],
                   help="run dtypes, comma-separated (default float32,bfloat16)")
    p.add_argument("--levels", type=_parse_levels, default=[0, 2],
                   help="kiln optimization levels, comma-separated (default 0,2); or none")
    p.add_argument("--baselines", type=lambda t: [b for b in _parse_list(str, t) if b != "none"],
                   default=["transformers", COMPILED_BASELINE],
                   help=f"baselines, comma-separated, of: {', '.join(BASELINES)}; or none (default both)")
    p.add_argument("--max-tokens", type=int, default=128,
                   help="new tokens: batch 1, and the longest throughput request (default 128)")
    p.add_argument("--throughput", type=int, default=16, metavar="N",
                   help="requests submitted at once in the throughput mode (default 16; 0: batch 1 only)")
    p.add_argument("--same-lengths", action="store_true",
                   help="every throughput request gets --max-tokens (default: mixed budgets)")
    p.add_argument("--batch1-prompt", type=int, default=1, metavar="I",
                   help="index of the batch-1 prompt in bench.common.models.CHAT_PROMPTS (default 1, a story)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine, after a warm-up (default 3)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave as is)")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto (default: cuda if available)")
    p.add_argument("--kiln-cache-dir", type=Path, default=None,
                   help="compile cache shared by the kiln engines (default: a fresh one per engine: cold starts)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="skip set-ups and rounds that would start after this many seconds (default: none)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory (default bench/results)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = _parser()
    args = p.parse_args(argv)
    try:
        args.model_path = resolve_model_arg(args.model)
    except ValueError as e:
        p.error(f"--model: {e}")
    bad = [d for d in args.dtypes if d not in SHORT]
    if bad or not args.dtypes:
        p.error(f"--dtypes: {bad or 'none'}; known: {', '.join(SHORT)}")
    unknown = [b for b in args.baselines if b not in BASELINES]
    if unknown:
        p.error(f"unknown baseline(s) {unknown}; known: {list(BASELINES)}")
    if not args.levels and not args.baselines:
        p.error("nothing to measure: --levels none and --baselines none")
    if args.max_tokens < 2 or args.repeats < 1 or args.throughput < 0:
        p.error("--max-tokens must be at least 2, --repeats at least 1, --throughput not negative")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def output_lens(max_tokens: int, count: int, same: bool) -> list[int]:
    """Each throughput request's new-token budget."""
    if same:
        return [max_tokens] * count
    return [max(2, round(max_tokens * OUTPUT_LEN_FRACTIONS[i % len(OUTPUT_LEN_FRACTIONS)])) for i in range(count)]


# ---------------------------------------------------------------------- measuring


def engine_key(result: dict[str, Any]) -> str:
    """``kiln -O0``, ``transformers``, ``transformers-compiled``: a row of the tables."""
    return f"kiln -O{result['level']}" if result["engine"] == "kiln" else result["engine"]


def measure_mode(
    args: argparse.Namespace, base: BenchSettings, kiln_engine: Callable[[int, BenchSettings], Engine],
    baseline_engine: Callable[[str, BenchSettings], Engine], deadline: float | None,
) -> dict[str, dict[str, dict[str, Any]]]:
    """Every kiln level and baseline in every dtype, set up, then taking turns;
    returns dtype -> engine key -> result (with ``dtype``; ``error`` if it failed)."""

    def build(make: Callable[[BenchSettings], Engine], dtype: str) -> Engine:
        engine = make(dataclasses.replace(base, dtype=dtype))
        engine.label = f"{engine.label} {SHORT[dtype]}"  # tells the dtypes apart in the log
        return engine

    specs, spec_dtypes = [], []
    for dtype in args.dtypes:
        for level in args.levels:
            specs.append(EngineSpec({"engine": "kiln", "level": level, "label": f"-O{level} {SHORT[dtype]}"},
                                    functools.partial(build, functools.partial(kiln_engine, level), dtype)))
        for name in args.baselines:
            specs.append(EngineSpec({"engine": name, "label": f"{name} {SHORT[dtype]}"},
                                    functools.partial(build, functools.partial(baseline_engine, name), dtype)))
        spec_dtypes += [dtype] * (len(args.levels) + len(args.baselines))
    by_dtype: dict[str, dict[str, dict[str, Any]]] = {d: {} for d in args.dtypes}
    for dtype, result in zip(spec_dtypes, run_engines(specs, args.repeats, deadline)):
        by_dtype[dtype][engine_key(result)] = {"dtype": dtype, **result}
    return by_dtype


def _agreement(ids: list[int], ref: list[int]) -> tuple[dict[str, Any], int]:
    """compare_tokens, and how many leading tokens agree."""
    c = compare_tokens(ids, ref)
    return c, len(ref) if c["first_mismatch"] is None else c["first_mismatch"]


def compare(results: dict[str, dict[str, Any]], mode: str) -> dict[str, Any] | None:
    """Against transformers eager of the same dtype, add to each measured result
    its speedup and its token agreement (the share of tokens before the first
    difference; throughput: over all requests, and the requests that agree
    throughout). Returns the reference, or None when it failed."""
    ref = results.get(REFERENCE_BASELINE)
    if ref is None or "error" in ref:
        return None
    rate = MODES[mode][0]
    compiled = results.get(COMPILED_BASELINE, {})
    for r in results.values():
        if "error" in r or r is ref:
            continue
        r[f"speedup_vs_{REFERENCE_BASELINE}"] = r[rate] / ref[rate]
        if r["engine"] == "kiln" and rate in compiled:
            r[f"speedup_vs_{COMPILED_BASELINE}"] = r[rate] / compiled[rate]
        if mode == "batch1":
            c, agree = _agreement(r["token_ids"], ref["token_ids"])
            r.update(c, token_agreement=agree / len(ref["token_ids"]))
        else:
            pairs = [_agreement(a, b) for a, b in zip(r["token_ids"], ref["token_ids"])]
            r["requests_matching_reference"] = sum(c["tokens_match"] for c, _ in pairs)
            r["tokens_match"] = r["requests_matching_reference"] == len(ref["token_ids"])
            r["first_mismatch_by_request"] = [c["first_mismatch"] for c, _ in pairs]
            r["token_agreement"] = sum(n for _, n in pairs) / sum(map(len, ref["token_ids"]))
    return ref


def token_failures(by_mode: dict[str, dict[str, dict[str, dict[str, Any]]]]) -> list[str]:
    """Where kiln's tokens differ from transformers eager's in :data:`EXACT_DTYPE`."""
    failures = []
    for mode, by_dtype in by_mode.items():
        for key, r in by_dtype.get(EXACT_DTYPE, {}).items():
            if r["engine"] == "kiln" and r.get("tokens_match") is False:
                where = (f"from token {r['first_mismatch']}" if mode == "batch1" else
                         f"{r['requests_matching_reference']}/{len(r['first_mismatch_by_request'])} requests equal")
                failures.append(f"{mode} {key} {EXACT_DTYPE}: tokens differ from {REFERENCE_BASELINE}'s ({where})")
    return failures


def summarize(by_mode: dict[str, dict[str, dict[str, dict[str, Any]]]], dtypes: list[str]) -> dict[str, Any]:
    """The headline figures per mode: tok/s per engine and dtype, kiln over each
    transformers baseline per dtype, bf16 over fp32 per engine, token agreement;
    and the load times (kiln: its startup report's total; transformers: its
    from_pretrained, and the compiled one's compile warm-up)."""
    summary: dict[str, Any] = {}
    for mode, by_dtype in by_mode.items():
        rate = MODES[mode][0]
        keys = list(dict.fromkeys(k for d in dtypes for k in by_dtype[d]))
        tok_s = {k: {d: by_dtype[d][k].get(rate) for d in dtypes} for k in keys}
        s: dict[str, Any] = {"rate": MODES[mode][1], "tokens_per_s": tok_s}
        for base in (REFERENCE_BASELINE, COMPILED_BASELINE):
            s[f"kiln_vs_{base}"] = {d: {k: by_dtype[d][k].get(f"speedup_vs_{base}") for k in keys
                                        if k.startswith("kiln")} for d in dtypes}
        if "float32" in dtypes and "bfloat16" in dtypes:
            s["bf16_vs_fp32"] = {k: (v["bfloat16"] / v["float32"] if v["bfloat16"] and v["float32"] else None)
                                 for k, v in tok_s.items()}
        s["token_agreement_vs_transformers"] = {
            d: {k: by_dtype[d][k].get("token_agreement") for k in keys if k != REFERENCE_BASELINE} for d in dtypes}
        s["load_seconds"] = {d: {k: _load_figures(by_dtype[d][k]) for k in keys} for d in dtypes}
        summary[mode] = s
    return summary


def _load_figures(r: dict[str, Any]) -> dict[str, Any]:
    if "error" in r:
        return {}
    if r["engine"] == "kiln":
        return {"load_seconds": r["load_seconds"],
                "startup_total_seconds": r["startup_report"].get("total_seconds")}
    return {"load_seconds": r["load_seconds"], "compile_seconds": r.get("compile_seconds")}


# ------------------------------------------------------------------------ tables


def _tokens_cell(r: dict[str, Any], mode: str, exact: bool) -> str:
    if "error" in r:
        return "n/a"
    if r["engine"] == REFERENCE_BASELINE:
        return "(reference)"
    if r.get("token_agreement") is None:
        return "-"
    if mode == "throughput":
        n = len(r["first_mismatch_by_request"])
        return f"{r['requests_matching_reference']}/{n} equal, {100 * r['token_agreement']:.0f}%"
    if exact:
        return "equal" if r["tokens_match"] else f"DIFFER from token {r['first_mismatch']}"
    return f"{100 * r['token_agreement']:.0f}%"


def _bandwidth_section(report: dict[str, Any]) -> list[str]:
    """Batch 1: bytes a step reads per dtype, achieved GB/s and the share of the
    machine's bandwidth."""
    bw = report.get("bandwidth")
    if not bw:
        return []
    m = bw["machine"]
    def step_mb(dtype: str, r: dict[str, Any]) -> str:
        return fmt(r["bandwidth"].get("bytes_per_token", bw["traffic"][dtype]["bytes_per_token"]) / 1e6, 1)

    rows = [[key, SHORT[dtype], step_mb(dtype, r),
             fmt(r["bandwidth"]["achieved_gb_per_s"], 1), fmt(100 * r["bandwidth"]["fraction_of_machine"], 0, "%"),
             fmt(r["bandwidth"]["roofline_tokens_per_s"], 1)]
            for dtype, results in report["results"]["batch1"].items() for key, r in results.items()
            if r.get("bandwidth")]
    return ["", f"### Batch-1 memory bandwidth (the machine: {m['gb_per_s']:.1f} GB/s, {m['method']}, "
                f"{m['threads']} threads; weights counted at the run dtype, as kiln holds them, an fp32 head with "
                f"kiln's greedy screen in bf16)", "",
            markdown_table(["engine", "dtype", "MB a step", "achieved GB/s", "of machine", "roofline tok/s"], rows)]


def _split_table(by_dtype: dict[str, dict[str, Any]], dtypes: list[str]) -> str:
    rows = []
    for key in by_dtype[dtypes[0]]:
        row = [key]
        for d in dtypes:
            r = by_dtype[d].get(key, {})
            row += [fmt(r.get("prefill_seconds"), 2, "s"), fmt(r.get("decode_seconds"), 2, "s")]
        rows.append(row)
    return markdown_table(["engine", *(f"{SHORT[d]} {part}" for d in dtypes for part in ("prefill", "decode"))],
                          rows)


def render(report: dict[str, Any]) -> str:
    """The Markdown summary: one table per mode, then the load times."""
    m, s, mach = report["model"], report["settings"], report["machine"]
    dtypes = s["dtypes"]
    bf = mach["cpu_bf16"]
    types = ", ".join(f"{n} {t}" for t, n in (m.get("tensor_types") or {}).items())
    parts = [
        f"real-model benchmark: {m['name']} ({m['architecture']}, {m['num_layers']} layers, hidden "
        f"{m['hidden_size']}, {m['format']}{f': {types}' if types else ''}) "
        f"on {mach['device']}: {mach['cpu_model']}, torch threads {mach['torch_threads']} of {mach['cpu_count']} "
        f"CPUs; CPU bf16: AMX-BF16 {'yes' if bf['amx_bf16'] else 'no'}, AVX512-BF16 "
        f"{'yes' if bf['avx512_bf16'] else 'no'}, torch kernels {bf['torch_cpu_capability']}",
        f"greedy, EOS ignored; chat-template prompts ({s['prompt_lens']['batch1']} tokens batch 1, "
        f"{s['prompt_lens'].get('throughput', 'n/a')} throughput); median of {s['repeats']} runs after a "
        f"warm-up, engines and dtypes taking turns",
    ]
    for mode, by_dtype in report["results"].items():
        summ = report["summary"][mode]
        title = (f"Batch-1 decode, {s['max_tokens']} new tokens: decode tok/s (prefill excluded)" if mode == "batch1"
                 else f"{s['num_requests']}-request throughput, {s['output_lens_note']}: output tok/s "
                      "(whole batch, prefill included)")
        headers = ["engine"]
        for d in dtypes:
            headers += [f"{SHORT[d]} tok/s", f"{SHORT[d]} kiln/transformers (eager / compiled)"]
        if "bf16_vs_fp32" in summ:
            headers.append("bf16/fp32")
        headers += [f"{SHORT[d]} tokens vs eager" for d in dtypes]
        rows = []
        for key, rates in summ["tokens_per_s"].items():
            row = [key]
            for d in dtypes:
                r = by_dtype[d][key]
                ratio = "-"
                if key.startswith("kiln") and f"speedup_vs_{REFERENCE_BASELINE}" in r:
                    ratio = " / ".join(fmt(r.get(f"speedup_vs_{b}"), suffix="x")
                                       for b in (REFERENCE_BASELINE, COMPILED_BASELINE))
                row += [fmt(rates[d], 1) if "error" not in r else "n/a", ratio]
            if "bf16_vs_fp32" in summ:
                row.append(fmt(summ["bf16_vs_fp32"][key], suffix="x"))
            row += [_tokens_cell(by_dtype[d][key], mode, d == EXACT_DTYPE) for d in dtypes]
            rows.append(row)
        parts += ["", f"### {title}", "", markdown_table(headers, rows)]
        if mode == "throughput":
            parts += ["", "Time of the whole batch split into prefill and decode (kiln: steps that ran "
                          "prompt tokens / the others; transformers: a one-token generate of the batch / the rest)",
                      "", _split_table(by_dtype, dtypes)]
    parts += _bandwidth_section(report)
    first = next(iter(report["summary"].values()), None)
    if first is not None:
        rows = []
        for key in first["tokens_per_s"]:
            row = [key]
            for d in dtypes:
                lf = first["load_seconds"][d][key]
                extra = lf.get("compile_seconds") if key == COMPILED_BASELINE else None
                row.append("n/a" if not lf else fmt(lf["load_seconds"], 1, "s")
                           + (f" + {extra:.1f}s compile" if extra else ""))
            rows.append(row)
        parts += ["", f"### Load time ({next(iter(report['summary']))} engines; GGUF: dequantized at load)", "",
                  markdown_table(["engine", *(SHORT[d] for d in dtypes)], rows),
                  "", "kiln: Runtime.load into an empty compile cache (trace + compile; startup_report "
                      "total_seconds in the JSON); transformers: from_pretrained (+ the compiled one's "
                      "torch.compile warm-up)."]
    every = [r for by_dtype in report["results"].values() for d in by_dtype.values() for r in d.values()]
    errors = [f"{r['engine']} {r['label']} not measured: {r['error']}" for r in every if "error" in r]
    noisy = [f"{r['engine']} {r['label']}" for r in every if r.get("spread", 0.0) > NOISY_SPREAD]
    if errors:
        parts += ["", *errors]
    if noisy:
        parts += ["", f"note: spread over {NOISY_SPREAD:.0%} (a busy machine): {', '.join(noisy)}"]
    if report["token_check_failures"]:
        parts += ["", *(f"TOKEN CHECK FAILED: {f}" for f in report["token_check_failures"])]
    return "\n".join(parts)


# --------------------------------------------------------------------------- run


def run(args: argparse.Namespace) -> dict[str, Any]:
    record = RunRecord("real-model", args.device)
    t_start = time.perf_counter()
    deadline = None if args.time_budget is None else t_start + args.time_budget
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = describe_model(args.model_path, args.model_path.name)
    model["source"] = args.model
    tokenizer = load_tokenizer(args.model_path)
    count = max(args.throughput, args.batch1_prompt + 1)
    texts, ids, templated = chat_prompts(tokenizer, count)
    prompt = ids[args.batch1_prompt]
    base = BenchSettings(args.max_tokens, args.repeats, args.device, args.dtypes[0],
                         kiln_cache_dir=args.kiln_cache_dir)
    lens = output_lens(args.max_tokens, args.throughput, args.same_lengths)
    machine_before = machine_read_bandwidth() if args.device == "cpu" else None
    by_mode = {"batch1": measure_mode(
        args, base, lambda level, st: KilnEngine(args.model_path, prompt, level, st),
        lambda name, st: BASELINES[name](args.model_path, prompt, st), deadline)}
    if args.throughput:
        prompts = ids[: args.throughput]
        tp = dataclasses.replace(base, max_tokens=max(lens), output_lens=tuple(lens))
        by_mode["throughput"] = measure_mode(
            args, tp, lambda level, st: KilnThroughputEngine(args.model_path, prompts, level, st),
            lambda name, st: THROUGHPUT_BASELINES[name](args.model_path, prompts, st), deadline)
    bandwidth = None
    if machine_before is not None:
        machine = max(machine_before, machine_read_bandwidth(), key=lambda m: m["gb_per_s"])
        bandwidth = {"machine": machine, "traffic": {
            dtype: attach_bandwidth(args.model_path, model, dtype, len(prompt) + args.max_tokens / 2,
                                    list(results.values()), machine)
            for dtype, results in by_mode["batch1"].items()}}
    for mode, by_dtype in by_mode.items():
        for results in by_dtype.values():
            ref = compare(results, mode)
            if ref is not None:
                model["num_parameters"] = ref.get("num_parameters")
    failures = token_failures(by_mode)
    summary = summarize(by_mode, args.dtypes)
    if "throughput" in by_mode:  # N x max_tokens ids: kept out of the JSON
        for results in by_mode["throughput"].values():
            for r in results.values():
                r.pop("token_ids", None)
    lens_note = ("every request " if args.same_lengths else "budgets ") + (
        f"{args.max_tokens} new tokens" if args.same_lengths else
        f"{'/'.join(map(str, lens[:len(OUTPUT_LEN_FRACTIONS)]))} new tokens cycled")
    return {
        **record.head(cpu_bf16=cpu_bf16_support()),
        "model": model,
        "settings": {
            "dtypes": args.dtypes, "levels": args.levels, "baselines": args.baselines,
            "reference_baseline": REFERENCE_BASELINE, "max_tokens": args.max_tokens, "repeats": args.repeats,
            "warmup_runs": 1, "num_requests": args.throughput, "output_lens": lens, "output_lens_note": lens_note,
            "sampling": "greedy (temperature 0), EOS ignored", "device": args.device,
            "threads_requested": args.threads, "time_budget_seconds": args.time_budget,
            "schedule": "per mode, every engine of every dtype set up first, then taking turns: each round "
                        "runs each once, order rotating",
            "kiln_compile_cache": "shared (--kiln-cache-dir)" if args.kiln_cache_dir else "fresh per engine (cold)",
            "token_check": f"kiln's greedy tokens must equal {REFERENCE_BASELINE}'s in {EXACT_DTYPE}; other "
                           "dtypes: token_agreement = share of tokens before the first difference",
            "prompt_lens": {"batch1": len(prompt), **({"throughput": f"{min(map(len, ids[:args.throughput]))}"
                                                                     f"..{max(map(len, ids[:args.throughput]))}"}
                                                      if args.throughput else {})},
            "noisy_spread_threshold": NOISY_SPREAD,
            "notes": [*BATCH1_NOTES, *THROUGHPUT_NOTES,
                      "throughput with mixed budgets: kiln stops each request at its own; transformers' batched "
                      "generate runs every row to the longest budget and is credited with each request's own "
                      "budget only (static batching)."],
        },
        "prompts": {"chat_template": templated, "batch1_index": args.batch1_prompt, "texts": texts,
                    "token_ids": ids},
        "token_check_failures": failures,
        "bandwidth": bandwidth,
        "summary": summary,
        "results": by_mode,
    }


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    args = parse_args(argv)
    report = run(args)
    publish(report, "real-model", render(report), args.out)
    every = [r for by_dtype in report["results"].values() for d in by_dtype.values() for r in d.values()]
    failed = [f"{r['engine']} {r['label']}" for r in every if "error" in r]
    if failed:
        print(f"\nnot measured: {', '.join(failed)} (see the errors above and in the JSON)", file=sys.stderr)
    if report["token_check_failures"]:
        print(f"\n{len(report['token_check_failures'])} token check(s) failed (see above)", file=sys.stderr)
    return 1 if failed or report["token_check_failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
