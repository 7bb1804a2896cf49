"""Which exact compile sizes pay on CPU: decode steps of B requests (B tokens a
step) with the compiled range alone, and with exact-size pieces.

Run from the repository root::

    python -m bench.compile_sizes            # SmolLM2-135M shape, random fp32 weights
    python -m bench.compile_sizes --shape qwen3-tiny --repeats 1 --max-tokens 8   # smoke test

An exact-size piece of one token computes its fp32 linear layers as
reductions (``kiln.compiler.gemv``); where kiln's C linear kernel is built, the
sizes from 2 to 8 are one few-row piece whose linears call the kernel (3 and
5-8 tokens included), and without it each exact size up to 4 has its own
reductions. This measures, per batch size, the decode milliseconds per step
with the range alone and with the default sizes, the engines taking turns, and
writes ``bench/results/compile-sizes-<device>-<stamp>.json``. It is the
measurement behind the CPU default ``compile_sizes`` (``kiln.config``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common.models import DEFAULT_SHAPE, SHAPES, ensure_shape_model, make_prompt
from bench.common.report import RESULTS_DIR, RunRecord, publish

# "1,2,4,8" compiles what "1,2,4" does where the C kernel's few-row piece takes 2 to 8
SIZE_SETS = {"range only": [], "1,2,4": [1, 2, 4]}
BATCHES = (1, 2, 3, 4, 6, 8)


def _decode_ms_per_step(rt: Any, batch: int, max_tokens: int, vocab: int) -> float:
    from kiln import SamplingParams

    prompts = [make_prompt(vocab, 16, seed=i) for i in range(batch)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    rt.generate(prompts, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))  # warm-up
    before = rt.stats()
    t0 = time.perf_counter()
    rt.generate(prompts, params)
    wall = time.perf_counter() - t0
    steps = rt.stats().steps - before.steps
    return 1000 * wall / steps


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kiln import Runtime

    record = RunRecord("compile-sizes", "cpu")
    model = ensure_shape_model(args.shape)
    cache = Path(tempfile.mkdtemp(prefix="kiln-sizes-"))
    rts = {name: Runtime.load(model, compile_sizes=sizes, cache_dir=cache) for name, sizes in SIZE_SETS.items()}
    vocab = next(iter(rts.values())).model_config.vocab_size
    runs: dict[str, dict[int, list[float]]] = {name: {b: [] for b in BATCHES} for name in rts}
    for _ in range(args.repeats):
        for b in BATCHES:
            for name, rt in rts.items():  # taking turns: noise hits all alike
                runs[name][b].append(_decode_ms_per_step(rt, b, args.max_tokens, vocab))
    medians = {name: {b: round(statistics.median(v), 3) for b, v in by_batch.items()} for name, by_batch in runs.items()}
    return {**record.head(torch_threads=torch.get_num_threads()), "model": str(model), "batches": list(BATCHES),
            "max_tokens": args.max_tokens, "ms_per_step": medians,
            "runs_ms_per_step": {n: {b: [round(x, 3) for x in v] for b, v in d.items()} for n, d in runs.items()}}


def render(r: dict[str, Any]) -> str:
    names = list(r["ms_per_step"])
    head = f"{'batch (tokens/step)':<20}" + "".join(f"{n:>14}" for n in names)
    rows = [f"{b:<20}" + "".join(f"{r['ms_per_step'][n][b]:>11.2f} ms" for n in names) for b in r["batches"]]
    return "\n".join([f"decode ms per step by exact compile sizes: {r['model']}", "", head, *rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compile_sizes", description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=list(SHAPES), default=DEFAULT_SHAPE)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    report = run(args)
    publish(report, "compile-sizes", render(report), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
