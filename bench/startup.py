"""Startup benchmark: cold compile, warm start from a bundle, and eager load.

Run from the repository root::

    python -m bench.startup                 # SmolLM2-135M shape, random fp32 weights, -O2
    python -m bench.startup --shape qwen3-tiny -O 1 --repeats 1    # smoke test

In one run, each in a fresh process (imports included), on the same checkpoint:

* ``python -m kiln compile MODEL -O2 --out DIR``: the cold compile (trace, split,
  every Inductor compilation, into an empty cache) and the bundle's writing;
* ``Runtime.load(DIR)`` of that bundle to the first generated token (warm start:
  no trace, no compile, no C++ build);
* ``Runtime.load(MODEL, optimization_level=0)`` to the first generated token.

Targets (issue: compile cache and bundles): warm <= 10% of cold, and warm <= -O0 + 3 s.
It prints a table and writes JSON to ``bench/results/startup-<device>-<stamp>.json``
(and ``startup-<device>-latest.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common.models import DEFAULT_SHAPE, SHAPES, ensure_shape_model
from bench.common.report import RESULTS_DIR, RunRecord, publish

FIRST_TOKEN = r"""
import sys, time, json
from kiln import Runtime, SamplingParams
kwargs = json.loads(sys.argv[2])
rt = Runtime.load(sys.argv[1], **kwargs)
out = rt.generate([list(range(1, 33))], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
print(json.dumps({"first_token_at": time.time(), "token": out[0].token_ids,
                  "report": {k: rt.startup_report[k] for k in
                             ("total_seconds", "dynamo_traces", "inductor_compiles", "artifacts_loaded",
                              "compile_cache", "phases")}}))
"""
WARM_OVER_COLD_MAX = 0.10
WARM_MINUS_EAGER_MAX_SECONDS = 3.0


def _first_token(target: str, kwargs: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """Load ``target`` in a fresh process and generate one token; the child's
    report, with the seconds from the process's start to that token."""
    start = time.time()
    proc = subprocess.run([sys.executable, "-c", FIRST_TOKEN, target, json.dumps(kwargs)],
                          capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"child failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["seconds_to_first_token"] = result["first_token_at"] - start
    return result


def _cold_compile(model: Path, bundle: Path, level: int, env: dict[str, str]) -> tuple[float, str]:
    """Seconds of ``python -m kiln compile`` in a fresh process, and the last line
    of what it printed on stderr (its summary)."""
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "kiln", "compile", str(model), "--out", str(bundle), f"-O{level}"],
        capture_output=True, text=True, env=env, timeout=3600,
    )
    seconds = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"kiln compile failed:\n{proc.stderr[-3000:]}")
    lines = proc.stderr.strip().splitlines()
    return seconds, lines[-1] if lines else ""


def run(args: argparse.Namespace) -> dict[str, Any]:
    record = RunRecord("startup", "cpu")
    model = args.model or ensure_shape_model(args.shape)
    work = Path(tempfile.mkdtemp(prefix="kiln-startup-"))
    env = {**os.environ, "KILN_CACHE_DIR": str(work / "user-cache")}
    try:
        bundle = work / "bundle"
        cold, compile_summary = _cold_compile(model, bundle, args.level, env)
        warm = [_first_token(str(bundle), {}, env) for _ in range(args.repeats)]
        eager = [_first_token(str(model), {"optimization_level": 0}, env) for _ in range(args.repeats)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    warm_s = statistics.median(r["seconds_to_first_token"] for r in warm)
    eager_s = statistics.median(r["seconds_to_first_token"] for r in eager)
    return {
        **record.head(),
        "model": str(model),
        "level": args.level,
        "cold_compile_seconds": cold,
        "kiln_compile_stderr": compile_summary,
        "warm_bundle_to_first_token_seconds": warm_s,
        "eager_to_first_token_seconds": eager_s,
        "warm_over_cold": warm_s / cold,
        "warm_minus_eager_seconds": warm_s - eager_s,
        "targets": {"warm_over_cold_max": WARM_OVER_COLD_MAX,
                    "warm_minus_eager_max_seconds": WARM_MINUS_EAGER_MAX_SECONDS},
        "targets_met": {"warm_over_cold": warm_s / cold <= WARM_OVER_COLD_MAX,
                        "warm_minus_eager": warm_s - eager_s <= WARM_MINUS_EAGER_MAX_SECONDS},
        "same_first_token": all(r["token"] == eager[0]["token"] for r in [*warm, *eager]),
        "warm_runs": warm,
        "eager_runs": eager,
    }


def render(r: dict[str, Any]) -> str:
    rows = [
        (f"cold: kiln compile -O{r['level']} (fresh process, empty cache)", r["cold_compile_seconds"]),
        ("warm: Runtime.load(bundle) to first token", r["warm_bundle_to_first_token_seconds"]),
        ("-O0: Runtime.load(model) to first token", r["eager_to_first_token_seconds"]),
    ]
    met = {k: "met" if v else "NOT met" for k, v in r["targets_met"].items()}
    width = max(len(name) for name, _ in rows)
    return "\n".join([
        f"startup benchmark: {r['model']}",
        "",
        *(f"{name:<{width}}  {secs:8.2f} s" for name, secs in rows),
        "",
        f"warm / cold = {r['warm_over_cold']:.1%} (target <= {WARM_OVER_COLD_MAX:.0%}: {met['warm_over_cold']})",
        f"warm - (-O0) = {r['warm_minus_eager_seconds']:+.2f} s (target <= +{WARM_MINUS_EAGER_MAX_SECONDS:.0f} s: "
        f"{met['warm_minus_eager']})",
        f"same first token everywhere: {r['same_first_token']}",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="checkpoint (default: the --shape model)")
    p.add_argument("--shape", choices=list(SHAPES), default=DEFAULT_SHAPE,
                   help=f"benchmark model to build and run when no --model is given (default {DEFAULT_SHAPE}; "
                        "qwen3-tiny is for smoke tests)")
    p.add_argument("-O", dest="level", type=int, default=2, choices=[1, 2, 3])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    report = run(args)
    publish(report, "startup", render(report), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
