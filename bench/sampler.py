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

The baseline, in the same run: transformers' sampling step as ``generate``
takes it, its logits processors for the same options (temperature, top-k,
top-p, min-p) and then ``softmax`` and ``torch.multinomial``, or the argmax
for greedy rows (with ``log_softmax`` and the top 5 where logprobs are asked
for). transformers has no per-request seeds and no OpenAI frequency or
presence penalties: those cases have no baseline.
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
# the cases transformers' generate has no counterpart for
NO_BASELINE = ("seed", "frequency_penalty", "presence_penalty")


def transformers_step(fields: dict[str, Any]) -> Any:
    """A function of (input_ids, logits) doing transformers' sampling step for
    ``fields``, or None where transformers has no counterpart."""
    from transformers.generation.logits_process import (
        LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    if any(k in fields for k in NO_BASELINE):
        return None
    greedy = fields.get("temperature", 1.0) == 0.0
    warpers = LogitsProcessorList()
    if not greedy:
        warpers.append(TemperatureLogitsWarper(fields["temperature"]))
        if "min_p" in fields:
            warpers.append(MinPLogitsWarper(fields["min_p"]))
        if "top_k" in fields:
            warpers.append(TopKLogitsWarper(fields["top_k"]))
        if "top_p" in fields:
            warpers.append(TopPLogitsWarper(fields["top_p"]))
    logprobs = fields.get("logprobs")

    def step(input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        scores = warpers(input_ids, logits)
        if greedy:
            tokens = scores.argmax(dim=-1)
            if logprobs:
                scores.log_softmax(dim=-1).topk(logprobs, dim=-1)
            return tokens
        return torch.multinomial(scores.softmax(dim=-1), num_samples=1).squeeze(1)

    return step


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
    input_ids = torch.tensor([h[0] + h[1] for h in histories])
    sampler = Sampler(torch.device("cpu"), seed=0)
    results = []
    batch_seconds = 0.02 if args.smoke else 0.3
    for name, fields in CASES.items():
        params = [SamplingParams(**fields)] * args.rows
        steps = [0] * args.rows
        t = time_per_call(lambda: sampler(logits, params, steps, histories), repeats=args.repeats,
                          min_batch_seconds=batch_seconds)
        step = transformers_step(fields)
        base = None if step is None else time_per_call(lambda: step(input_ids, logits), repeats=args.repeats,
                                                       min_batch_seconds=batch_seconds)
        results.append({"case": name, "params": fields, "ms": t["median_ms"],
                        "sampled_tokens_per_s": args.rows / t["median_ms"] * 1e3, "timing": t,
                        "transformers_ms": None if base is None else base["median_ms"],
                        "transformers_timing": base})
    return {**record.head(torch_threads=torch.get_num_threads()),
            "settings": {"rows": args.rows, "vocab": args.vocab, "logits": "Zipf-like: -3 ln(rank) + N(0, 0.3)",
                         "history_tokens": HISTORY_TOKENS, "smoke": args.smoke,
                         "statistic": "median over batches of back-to-back calls"},
            "results": results}


def render(report: dict[str, Any]) -> str:
    s = report["settings"]
    rows = [[r["case"], fmt(r["ms"], 2), fmt(r["sampled_tokens_per_s"], 0),
             "-" if r.get("transformers_ms") is None else fmt(r["transformers_ms"], 2),
             "-" if r.get("transformers_ms") is None else f"{r['transformers_ms'] / r['ms']:.2f}x"]
            for r in report["results"]]
    return (f"kiln's Sampler, {s['rows']} rows of {s['vocab']} logits ({s['logits']}), CPU, "
            f"{report['machine']['torch_threads']} threads\n\n"
            + format_table(["case", "ms a step", "tokens/s of sampling alone", "transformers ms",
                            "kiln speedup"], rows))


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
