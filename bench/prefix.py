"""Prefix-caching benchmark: a shared-system-prompt workload with caching on and
off, and a workload with nothing to share (the cost of hashing), in one run.

Run from the repository root::

    python -m bench.prefix                  # the demo model at -O2

Shared workload: ``--requests`` requests, each a ``--prefix-len``-token shared
prefix plus a ``--suffix-len``-token suffix of its own, ``--max-tokens`` greedy
output tokens each.
* Time to first token, requests sent one after another (streamed): request 1
  fills the cache, the later ones can hit it. Goal: mean TTFT of requests 2..N
  at least 5x lower with caching on.
* Throughput, all requests submitted at once: output tokens/s.
No-sharing workload: the same sizes with every prompt distinct, all at once:
caching's overhead (hashing, bookkeeping) when nothing hits. Goal: under 2%.
Token ids are random (seeded) within the vocabulary, so nothing is shared by
chance; greedy outputs with caching on and off are compared.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.common.models import resolve_model_arg
from bench.common.report import RunRecord, fmt, format_table, publish


def _prompts(vocab: int, n: int, prefix_len: int, suffix_len: int, shared: bool, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
    out = []
    for _ in range(n):
        head = prefix if shared else [rng.randrange(vocab) for _ in range(prefix_len)]
        out.append(head + [rng.randrange(vocab) for _ in range(suffix_len)])
    return out


def _ttft(rt: Any, prompts: list[list[int]], params: Any) -> tuple[list[float], list[list[int]]]:
    times, tokens = [], []
    for p in prompts:
        t0 = time.perf_counter()
        got: list[int] = []
        for delta in rt.stream(p, params):
            if not got:
                times.append(time.perf_counter() - t0)
            got += delta.token_ids
        tokens.append(got)
    return times, tokens


def _throughput(rt: Any, prompts: list[list[int]], params: Any) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    outs = rt.generate(prompts, params)
    wall = time.perf_counter() - t0
    return sum(len(o.token_ids) for o in outs) / wall, [o.token_ids for o in outs]


def measure(model: Path, caching: bool, args: argparse.Namespace) -> dict[str, Any]:
    from kiln import Runtime, SamplingParams

    rt = Runtime.load(model, optimization_level=args.level, enable_prefix_caching=caching,
                      max_model_len=args.prefix_len + args.suffix_len + args.max_tokens + 16)
    vocab = rt.config.model.vocab_size
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    rt.generate(_prompts(vocab, 2, 64, 8, True, seed=99), params)  # warm-up (and nothing it caches is reused)
    shared = _prompts(vocab, args.requests, args.prefix_len, args.suffix_len, True, seed=1)
    ttft, ttft_tokens = _ttft(rt, shared, params)
    shared_rate, shared_tokens = _throughput(rt, _prompts(vocab, args.requests, args.prefix_len, args.suffix_len,
                                                          True, seed=2), params)
    distinct_rate, distinct_tokens = _throughput(rt, _prompts(vocab, args.requests, args.prefix_len, args.suffix_len,
                                                              False, seed=3), params)
    stats = rt.stats()
    return {"ttft_first": ttft[0], "ttft_rest_mean": statistics.mean(ttft[1:]), "shared_tokens_per_s": shared_rate,
            "distinct_tokens_per_s": distinct_rate, "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits, "startup_seconds": rt.startup_report["total_seconds"],
            "tokens": [ttft_tokens, shared_tokens, distinct_tokens]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prefix", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="checkpoint, .gguf, demo or random-demo (default demo)")
    p.add_argument("-O", dest="level", type=int, default=2)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out", type=Path, default=None, help="results directory (default bench/results)")
    args = p.parse_args(argv)
    record = RunRecord("prefix", "cpu")
    model = resolve_model_arg(args.model)
    on, off = measure(model, True, args), measure(model, False, args)
    same_tokens = on.pop("tokens") == off.pop("tokens")
    speedup = off["ttft_rest_mean"] / on["ttft_rest_mean"]
    overhead = 1 - on["distinct_tokens_per_s"] / off["distinct_tokens_per_s"]
    report = {**record.head(), "model": args.model, "level": args.level, "workload": vars(args) | {"out": None},
              "caching_on": on, "caching_off": off, "ttft_speedup_rest": round(speedup, 2),
              "no_sharing_overhead": round(overhead, 4), "tokens_equal": same_tokens,
              "goals": {"ttft_speedup_rest": ">= 5", "no_sharing_overhead": "< 0.02"}}
    rows = [[name, fmt(r["ttft_first"], 3), fmt(r["ttft_rest_mean"], 3), fmt(r["shared_tokens_per_s"]),
             fmt(r["distinct_tokens_per_s"]), f"{r['prefix_cache_hits']}/{r['prefix_cache_queries']}"]
            for name, r in (("caching on", on), ("caching off", off))]
    table = format_table(["", "TTFT 1st s", "TTFT 2..N mean s", "shared tok/s", "no-sharing tok/s",
                          "hits/queries (tokens)"], rows)
    table += (f"\nTTFT of requests 2..N: {speedup:.1f}x lower with caching; no-sharing overhead "
              f"{overhead * 100:.1f}%; greedy tokens equal on/off: {same_tokens}")
    if args.out:
        publish(report, "prefix", table, args.out)
    else:
        publish(report, "prefix", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
