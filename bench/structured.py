"""What structured output costs: the demo model's answers free, kept to a JSON
object, and kept to a JSON Schema, in turns.

    python -m bench.structured [--batches 1,16] [--max-tokens 64] [--repeats 3]

Each request asks SmolLM2-135M-Instruct (``kiln fetch-demo``) for JSON about a
city, greedy, at ``-O2``. A constrained row's step costs the automaton's checks
of its candidate tokens (``kiln.engine.structured``) and keeps the step off
the greedy LM-head screen, so the figure is the milliseconds per output token
of the whole batch against the free answers of the same prompts, and the
tokens per second. The constrained answers are shorter (they stop when the
value closes), so a batch's last steps run fewer rows, each token costing more
("tokens a step": the batch's average rows a step): compare per token, and
mind that column. Also timed: ``TokenConstraint.mask`` alone
on one row of the model's 49152 logits inside a JSON string, greedy and sampled.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common.harness import time_per_call
from bench.common.report import RESULTS_DIR, RunRecord, fmt, format_table, publish

CITIES = ["Paris", "Tokyo", "Cairo", "Lima", "Oslo", "Delhi", "Rome", "Quito"]
SCHEMA = {"type": "object", "required": ["city", "country", "population", "landmarks"],
          "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                         "population": {"type": "integer"},
                         "landmarks": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}}
MODES: dict[str, Any] = {"free": None, "json_object": "json_object", "json_schema": SCHEMA}


def _messages(i: int) -> list[dict[str, str]]:
    city = CITIES[i % len(CITIES)]
    return [{"role": "user", "content": f"Describe {city} as JSON with city, country, population and landmarks."}]


def _run(rt: Any, batch: int, structured: Any, max_tokens: int) -> dict[str, float]:
    from kiln import SamplingParams
    from kiln.entrypoints.chat import render_chat

    params = SamplingParams(max_tokens=max_tokens, temperature=0, structured=structured)
    prompts = [render_chat(rt.tokenizer, _messages(i)) for i in range(batch)]
    steps = rt.stats().steps
    t0 = time.perf_counter()
    outs = rt.generate(prompts, params)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {"seconds": wall, "tokens": tokens, "steps": rt.stats().steps - steps,
            "ms_per_token": wall / tokens * 1e3, "tokens_per_s": tokens / wall}


def _mask_timings(rt: Any) -> dict[str, float]:
    from kiln.engine.detokenizer import vocab_bytes
    from kiln.engine.structured import TokenConstraint, structured_shape

    vocab = vocab_bytes(rt.tokenizer, rt.config.model.vocab_size)
    constraint = TokenConstraint(vocab, rt.config.eos_token_ids, structured_shape("json_object"))
    for t in rt.tokenizer.encode('{"city": "Par', add_special_tokens=False):
        constraint.advance(t)
    row = torch.randn(rt.config.model.vocab_size, generator=torch.Generator().manual_seed(0)) * 3
    out = {}
    for name, temperature in (("greedy", 0.0), ("sampled, temperature 0.8", 0.8)):
        out[name] = time_per_call(lambda: constraint.mask(row.clone(), temperature), repeats=7,
                                  min_batch_seconds=0.1)["median_ms"]
    return out


def structured_report(args: argparse.Namespace) -> dict[str, Any]:
    from kiln import Runtime
    from kiln.checkpoint.demo import chat_model_path

    path = chat_model_path()
    if not path.is_file():
        raise SystemExit(f"bench.structured needs the demo model at {path}: run `kiln fetch-demo` first")
    record = RunRecord("structured", "cpu")
    rt = Runtime.load(str(path))
    results: list[dict[str, Any]] = []
    for batch in args.batches:
        for mode, structured in MODES.items():
            _run(rt, batch, structured, args.max_tokens)  # warm-up
        runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
        for _ in range(args.repeats):  # the modes take turns
            for mode, structured in MODES.items():
                runs[mode].append(_run(rt, batch, structured, args.max_tokens))
        for mode in MODES:
            ms = sorted(r["ms_per_token"] for r in runs[mode])
            results.append({"batch": batch, "mode": mode, "ms_per_token": ms[len(ms) // 2],
                            "tokens": runs[mode][0]["tokens"], "steps": runs[mode][0]["steps"], "runs": runs[mode]})
    masks = _mask_timings(rt)
    rt.close()
    return {**record.head(torch_threads=torch.get_num_threads()),
            "settings": {"model": path.name, "level": 2, "greedy": True, "max_tokens": args.max_tokens,
                         "repeats": args.repeats, "schema": SCHEMA, "statistic": "median over rounds taking turns"},
            "results": results, "mask_ms": masks}


def render(report: dict[str, Any]) -> str:
    free = {r["batch"]: r["ms_per_token"] for r in report["results"] if r["mode"] == "free"}
    rows = [[str(r["batch"]), r["mode"], str(r["tokens"]), fmt(r["tokens"] / r["steps"], 1),
             fmt(r["ms_per_token"], 2), fmt(1e3 / r["ms_per_token"], 1), f"{r['ms_per_token'] / free[r['batch']]:.2f}x"]
            for r in report["results"]]
    masks = ", ".join(f"{k} {v:.3f} ms" for k, v in report["mask_ms"].items())
    return (f"Structured output on {report['settings']['model']} (-O2, greedy), CPU, "
            f"{report['machine']['torch_threads']} threads\n\n"
            + format_table(["requests", "answers", "tokens", "tokens a step", "ms a token", "tokens/s",
                            "against free"], rows)
            + f"\n\nTokenConstraint.mask on one row of logits inside a JSON string: {masks}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.structured", description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,16", help="requests at once, a run each (default 1,16)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens a request at most (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="rounds of the three modes (default 3)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory (default bench/results)")
    args = p.parse_args(argv)
    try:
        args.batches = [int(b) for b in args.batches.split(",") if b]
    except ValueError:
        p.error(f"--batches must be comma-separated integers, got {args.batches!r}")
    if min([*args.batches, args.max_tokens, args.repeats, args.threads]) < 1:
        p.error("--batches, --max-tokens, --repeats and --threads must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    report = structured_report(args)
    publish(report, "structured", render(report), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
