"""Serving benchmark: N concurrent streaming clients against ``kiln serve``, and
the same requests through offline ``Runtime.generate`` in the same run.

Run from the repository root::

    python -m bench.serve                     # the demo model, -O2, 16 clients, 64 requests

Requests are the chat prompts of ``bench.common.models`` with mixed output
lengths (max_tokens cycling through ``--max-tokens`` x 1, 1/4, 3/4, 1/2),
``ignore_eos`` so that every request produces its budget. Each client streams
one request at a time (``stream_options.include_usage``) until the queue is
empty. Offline generation gets every request at once with ``max_num_seqs`` set
to the number of clients, so both batch at most that many requests: the ratio
measures what serving costs, not a difference in batch size. Reported: output
tokens/s of the server and of offline generation (the goal: server >= 0.95x
offline), time to first token and inter-token latency p50/p99 (the goal: p99
inter-token <= 1.5x its median at 16 clients). The offline run goes first and
compiles into the cache the server then loads warm; the two never run at the
same time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common.models import chat_prompts, load_tokenizer, resolve_model_arg
from bench.common.report import RunRecord, fmt, format_table, publish

FRACTIONS = (1.0, 0.25, 0.75, 0.5)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _workload(model: Path, count: int, max_tokens: int) -> tuple[list[list[int]], list[int]]:
    _, prompts, _ = chat_prompts(load_tokenizer(model), count)
    budgets = [max(1, int(max_tokens * FRACTIONS[i % len(FRACTIONS)])) for i in range(count)]
    return prompts, budgets


def run_offline(model: Path, prompts: list[list[int]], budgets: list[int], load: dict[str, Any],
                repeats: int) -> dict[str, Any]:
    from kiln import Runtime, SamplingParams

    rt = Runtime.load(model, **load)
    params = [SamplingParams(max_tokens=b, temperature=0, ignore_eos=True, logprobs=0) for b in budgets]
    rt.generate(prompts[:2], params[:2])  # warm-up
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = rt.generate(prompts, params)
        rates.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
    return {"tokens_per_s": round(statistics.median(rates), 2), "runs_tokens_per_s": [round(r, 2) for r in rates],
            "startup_seconds": rt.startup_report["total_seconds"]}


async def _one(client: Any, base: str, prompt: list[int], budget: int) -> dict[str, Any]:
    """One streamed request. ``logprobs: 0`` makes every chunk say how many tokens
    it carries (a client that lags gets several merged), so that inter-token
    latency is per token, as the server's own metric is."""
    body = {"prompt": prompt, "max_tokens": budget, "temperature": 0, "ignore_eos": True, "stream": True,
            "logprobs": 0, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps: list[tuple[float, int]] = []  # (arrival, tokens in the chunk)
    usage = None
    async with client.stream("POST", f"{base}/v1/completions", json=body, timeout=None) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"] and chunk["choices"][0]["logprobs"]:
                stamps.append((time.perf_counter(), len(chunk["choices"][0]["logprobs"]["token_logprobs"])))
    itl = [(b - a) / n for (a, _), (b, n) in zip(stamps, stamps[1:]) for _ in range(n)]
    return {"ttft": stamps[0][0] - t0 if stamps else None, "itl": itl,
            "tokens": usage["completion_tokens"] if usage else 0}


async def _clients(base: str, prompts: list[list[int]], budgets: list[int], clients: int) -> dict[str, Any]:
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for item in zip(prompts, budgets):
        queue.put_nowait(item)
    results: list[dict[str, Any]] = []

    async def worker(client: Any) -> None:
        while not queue.empty():
            prompt, budget = queue.get_nowait()
            results.append(await _one(client, base, prompt, budget))

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients + 4)) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(clients)))
        wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    itl = [x for r in results for x in r["itl"]]
    return {"wall_seconds": round(wall, 3), "output_tokens": tokens, "tokens_per_s": round(tokens / wall, 2),
            "ttft_p50": _percentile(ttft, 0.5), "ttft_p99": _percentile(ttft, 0.99),
            "itl_p50": _percentile(itl, 0.5), "itl_p99": _percentile(itl, 0.99), "requests": len(results)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_server(model: Path, level: int, prompts: list[list[int]], budgets: list[int], clients: int,
               env: dict[str, str], repeats: int, options: list[str]) -> dict[str, Any]:
    """``options``: more ``kiln serve`` arguments (``--dtype``, ``--cudagraph-mode``)."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kiln", "serve", str(model), "-O", str(level), "--port", str(port),
                             *options], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        t0 = time.perf_counter()
        while not _healthy(base):
            if proc.poll() is not None:
                raise RuntimeError(f"kiln serve exited: {proc.stderr.read()[-2000:]}")
            time.sleep(0.5)
        ready = time.perf_counter() - t0
        asyncio.run(_clients(base, prompts[:2], budgets[:2], 2))  # warm-up
        runs = [asyncio.run(_clients(base, prompts, budgets, clients)) for _ in range(repeats)]
        result = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]  # the median run
        return {**result, "runs_tokens_per_s": [r["tokens_per_s"] for r in runs], "seconds_to_ready": round(ready, 2)}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _healthy(base: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{base}/health", timeout=2).status_code == 200
    except httpx.TransportError:  # not listening yet
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="checkpoint, .gguf, demo or random-demo (default demo)")
    p.add_argument("-O", dest="level", type=int, default=2)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each side; the median is reported")
    p.add_argument("--dtype", default=None, help="kiln's dtype on both sides (default: kiln's)")
    p.add_argument("--cudagraph-mode", default=None, help="kiln's graph mode on both sides (default: the level's)")
    p.add_argument("--out", type=Path, default=None, help="results directory (default bench/results)")
    args = p.parse_args(argv)
    record = RunRecord("serve", "cpu")
    model = resolve_model_arg(args.model)
    prompts, budgets = _workload(model, args.requests, args.max_tokens)
    env = {**os.environ}
    load: dict[str, Any] = {"optimization_level": args.level, "max_num_seqs": args.clients}
    options: list[str] = []
    for name in ("dtype", "cudagraph_mode"):
        if getattr(args, name) is not None:
            load[name] = getattr(args, name)
            options += [f"--{name.replace('_', '-')}", getattr(args, name)]
    offline = run_offline(model, prompts, budgets, load, args.repeats)
    served = run_server(model, args.level, prompts, budgets, args.clients, env, args.repeats, options)
    ratio = served["tokens_per_s"] / offline["tokens_per_s"]
    itl_ratio = served["itl_p99"] / served["itl_p50"] if served["itl_p50"] else None
    report = {**record.head(), "model": args.model, "level": args.level, "clients": args.clients,
              "dtype": args.dtype, "cudagraph_mode": args.cudagraph_mode,
              "requests": args.requests, "max_tokens": args.max_tokens, "offline": offline, "server": served,
              "server_over_offline": round(ratio, 3), "itl_p99_over_p50": itl_ratio and round(itl_ratio, 3),
              "goals": {"server_over_offline": ">= 0.95", "itl_p99_over_p50": "<= 1.5 at 16 clients"}}
    rows = [["offline generate", fmt(offline["tokens_per_s"]), "", "", "", ""],
            [f"kiln serve, {args.clients} clients", fmt(served["tokens_per_s"]), fmt(served["ttft_p50"], 3),
             fmt(served["ttft_p99"], 3), fmt(served["itl_p50"], 4), fmt(served["itl_p99"], 4)]]
    table = format_table(["", "output tok/s", "TTFT p50 s", "TTFT p99 s", "ITL p50 s", "ITL p99 s"], rows)
    table += f"\nserver / offline: {ratio:.3f}x; ITL p99 / p50: {fmt(itl_ratio, 3)}"
    if args.out:
        publish(report, "serve", table, args.out)
    else:
        publish(report, "serve", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
