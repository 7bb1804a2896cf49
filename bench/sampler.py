"""The sampler's cost a step: kiln's ``Sampler`` on a batch of logits, per option set.

    python -m bench.sampler [--rows 64] [--vocab 49152]

A decode step of many requests hands the sampler one row of logits per
request; on CPU a sampled step's filters and draw were once as slow as the
model's forward (the 64 requests of ``bench.decode --throughput 64`` take about
50 ms a step in fp32). The rows are Zipf-like, as a language model's are: the
token of rank r has logit -3 ln r, plus noise, in a random order per row (at
temperature 0.8 the median nucleus of top-p 0.95 is a couple of tokens, as
SmolLM2-135M-Instruct's are for most steps of ordinary prompts). Cases: greedy,
greedy with logprobs, temperature alone (unseeded and seeded), with top-k 50,
with top-p 0.95, with both, with min-p 0.05, and greedy with frequency and
presence penalties over 100 prompt and 100 output tokens a row. Reported in ms
a step (median over batches of back-to-back calls), with the tokens per second
of sampling alone that makes at that batch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common.harness import time_per_call
from bench.common.report import RESULTS_DIR, RunRecord, fmt, format_table, publish

CASES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "greedy + logprobs 5": {"temperature": 0.0, "logprobs": 5},
    "temperature 0.8": {"temperature": 0.8},
    "temperature 0.8, seeded": {"temperature": 0.8, "seed": 1},
    "top-k 50": {"temperature": 0.8, "top_k": 50},
    "top-p 0.95": {"temperature": 0.8, "top_p": 0.95},
    "top-k 40 + top-p 0.9": {"temperature": 0.7, "top_k": 40, "top_p": 0.9},
    "min-p 0.05": {"temperature": 0.8, "min_p": 0.05},
    "greedy + penalties": {"temperature": 0.0, "frequency_penalty": 0.5, "presence_penalty": 0.3},
}
HISTORY_TOKENS = 100  # prompt and output tokens a row, for the penalties


def zipf_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Rows whose rank-r token has logit -3 ln r plus N(0, 0.3), in a random order per row."""
    g = torch.Generator().manual_seed(seed)
    base = -3.0 * torch.arange(1, vocab + 1, dtype=torch.float32).log()
    return torch.stack([base[torch.randperm(vocab, generator=g)] + 0.3 * torch.randn(vocab, generator=g)
                        for _ in range(rows)])


def sampler_report(args: argparse.Namespace) -> dict[str, Any]:
    from kiln.engine.request import SamplingParams
    from kiln.engine.sampler import Sampler

    record = RunRecord("sampler", "cpu")
    logits = zipf_logits(args.rows, args.vocab)
    g = torch.Generator().manual_seed(1)
    histories = [(torch.randint(0, args.vocab, (HISTORY_TOKENS,), generator=g).tolist(),
                  torch.randint(0, args.vocab, (HISTORY_TOKENS,), generator=g).tolist()) for _ in range(args.rows)]
    sampler = Sampler(torch.device("cpu"), seed=0)
    results = []
    for name, fields in CASES.items():
        params = [SamplingParams(**fields)] * args.rows
        steps = [0] * args.rows
        t = time_per_call(lambda: sampler(logits, params, steps, histories), repeats=args.repeats,
                          min_batch_seconds=0.02 if args.smoke else 0.3)
        results.append({"case": name, "params": fields, "ms": t["median_ms"],
                        "sampled_tokens_per_s": args.rows / t["median_ms"] * 1e3, "timing": t})
    return {**record.head(torch_threads=torch.get_num_threads()),
            "settings": {"rows": args.rows, "vocab": args.vocab, "logits": "Zipf-like: -3 ln(rank) + N(0, 0.3)",
                         "history_tokens": HISTORY_TOKENS, "smoke": args.smoke,
                         "statistic": "median over batches of back-to-back calls"},
            "results": results}


def render(report: dict[str, Any]) -> str:
    s = report["settings"]
    rows = [[r["case"], fmt(r["ms"], 2), fmt(r["sampled_tokens_per_s"], 0)] for r in report["results"]]
    return (f"kiln's Sampler, {s['rows']} rows of {s['vocab']} logits ({s['logits']}), CPU, "
            f"{report['machine']['torch_threads']} threads\n\n"
            + format_table(["case", "ms a step", "tokens/s of sampling alone"], rows))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.sampler", description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=64, help="sampling rows a step (default 64)")
    p.add_argument("--vocab", type=int, default=49152, help="logits a row (default 49152, SmolLM2's)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--repeats", type=int, default=None, help="timed batches a case (default 11; 3 with --smoke)")
    p.add_argument("--smoke", action="store_true", help="a check of this script: short batches")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory (default bench/results)")
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 3 if args.smoke else 11
    if min(args.rows, args.vocab, args.threads, args.repeats) < 1:
        p.error("--rows, --vocab, --threads and --repeats must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    report = sampler_report(args)
    publish(report, "sampler", render(report), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
