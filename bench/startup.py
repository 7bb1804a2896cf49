"""Startup benchmark: cold compile, warm start from a bundle, and eager load.

Run from the repository root::

    python -m bench.startup                 # SmolLM2-135M shape, random fp32 weights, -O2

In one run, each in a fresh process (imports included), on the same checkpoint:

* ``kiln compile MODEL -O2 --out DIR``: the cold compile (trace, split, every
  Inductor compilation, into an empty cache) and the bundle's writing;
* ``Runtime.load(DIR)`` of that bundle to the first generated token (warm start:
  no trace, no compile, no C++ build);
* ``Runtime.load(MODEL, optimization_level=0)`` to the first generated token.

Targets (issue: compile cache and bundles): warm <= 10% of cold, and warm <= -O0 + 3 s.
It prints a table and writes JSON to ``bench/results/startup-<device>-<stamp>.json``
(and ``startup-<device>-latest.json``).
"""

from __future__ import annotations

import argparse
import datetime as dt
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

from bench.decode import DEFAULT_OUT_DIR, _path_placeholders, ensure_default_model, machine_info, scrub_paths

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


def _first_token(target: str, kwargs: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    start = time.time()
    proc = subprocess.run([sys.executable, "-c", FIRST_TOKEN, target, json.dumps(kwargs)],
                          capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"child failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["seconds_to_first_token"] = result["first_token_at"] - start
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model or ensure_default_model()
    work = Path(tempfile.mkdtemp(prefix="kiln-startup-"))
    env = {**os.environ, "KILN_CACHE_DIR": str(work / "user-cache")}
    try:
        bundle = work / "bundle"
        t0 = time.time()
        proc = subprocess.run(
            [sys.executable, "-m", "kiln.cli", "compile", str(model), "--out", str(bundle), f"-O{args.level}"],
            capture_output=True, text=True, env=env, timeout=3600,
        )
        cold = time.time() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"kiln compile failed:\n{proc.stderr[-3000:]}")
        warm = [_first_token(str(bundle), {}, env) for _ in range(args.repeats)]
        eager = [_first_token(str(model), {"optimization_level": 0}, env) for _ in range(args.repeats)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    warm_s = statistics.median(r["seconds_to_first_token"] for r in warm)
    eager_s = statistics.median(r["seconds_to_first_token"] for r in eager)
    now = dt.datetime.now(dt.timezone.utc)
    return {
        "benchmark": "startup",
        "started_at": now.isoformat(timespec="seconds"),
        "run_stamp": now.strftime("%Y%m%d-%H%M%S"),
        "machine": machine_info("cpu"),
        "model": str(model),
        "level": args.level,
        "cold_compile_seconds": cold,
        "kiln_compile_stderr": proc.stderr.strip().splitlines()[-1],
        "warm_bundle_to_first_token_seconds": warm_s,
        "eager_to_first_token_seconds": eager_s,
        "warm_over_cold": warm_s / cold,
        "warm_minus_eager_seconds": warm_s - eager_s,
        "targets": {"warm_over_cold_max": 0.10, "warm_minus_eager_max_seconds": 3.0},
        "targets_met": {"warm_over_cold": warm_s / cold <= 0.10, "warm_minus_eager": warm_s - eager_s <= 3.0},
        "same_first_token": all(r["token"] == eager[0]["token"] for r in [*warm, *eager]),
        "warm_runs": warm,
        "eager_runs": eager,
    }


def render(r: dict[str, Any]) -> str:
    rows = [
        ("cold: kiln compile -O%d (fresh process, empty cache)" % r["level"], r["cold_compile_seconds"]),
        ("warm: Runtime.load(bundle) to first token", r["warm_bundle_to_first_token_seconds"]),
        ("-O0: Runtime.load(model) to first token", r["eager_to_first_token_seconds"]),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"startup benchmark: {r['model']}", ""]
    lines += [f"{name:<{width}}  {secs:8.2f} s" for name, secs in rows]
    lines += [
        "",
        f"warm / cold = {r['warm_over_cold']:.1%} (target <= 10%: {'met' if r['targets_met']['warm_over_cold'] else 'NOT met'})",
        f"warm - (-O0) = {r['warm_minus_eager_seconds']:+.2f} s (target <= +3 s: "
        f"{'met' if r['targets_met']['warm_minus_eager'] else 'NOT met'})",
        f"same first token everywhere: {r['same_first_token']}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="checkpoint (default: the SmolLM2-135M shape)")
    p.add_argument("-O", dest="level", type=int, default=2, choices=[1, 2, 3])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR)
    args = p.parse_args(argv)
    report = run(args)
    print(render(report))
    args.out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(scrub_paths(report, _path_placeholders()), indent=2) + "\n"
    for name in (f"startup-cpu-{report['run_stamp']}.json", "startup-cpu-latest.json"):
        tmp = args.out / (name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, args.out / name)
    print(f"\nwrote {args.out / ('startup-cpu-' + report['run_stamp'] + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
