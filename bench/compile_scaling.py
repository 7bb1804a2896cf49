"""Cold compile time against depth: the same width, 2 layers and 24 layers.

Identical decoder-layer pieces are compiled once, so the number of Inductor
compilations must not grow with depth and the cold compile time should barely
move (target: 24 layers <= 1.5x 2 layers). Each load runs in a fresh process with
an empty compile cache.

    python -m bench.compile_scaling [-O 2]
    python -m bench.compile_scaling --shape qwen3-tiny --layers 1,2 -O 1    # smoke test

It prints a table and writes JSON to ``bench/results/compile-scaling-cpu-<stamp>.json``
(and ``compile-scaling-cpu-latest.json``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common.models import DEFAULT_SHAPE, SHAPES, save_random_checkpoint
from bench.common.report import RESULTS_DIR, RunRecord, fmt, format_table, publish

CHILD = r"""
import json, sys
from kiln import Runtime
rt = Runtime.load(sys.argv[1], optimization_level=int(sys.argv[2]), cache_dir=sys.argv[3], num_kv_blocks=64)
r = rt.startup_report
print(json.dumps({k: r[k] for k in ("phases", "total_seconds", "inductor_compiles", "pieces", "unique_pieces")}))
"""
TARGET_RATIO_MAX = 1.5


def _cold_load(model: Path, level: int, cache_dir: Path) -> dict[str, Any]:
    """The startup report of ``Runtime.load`` in a fresh process with an empty cache."""
    proc = subprocess.run([sys.executable, "-c", CHILD, str(model), str(level), str(cache_dir)],
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(shape_name: str, depths: tuple[int, int], level: int) -> dict[int, dict[str, Any]]:
    """Build the shape at each depth (random weights) and cold-load it; the
    startup reports by depth."""
    work = Path(tempfile.mkdtemp(prefix="kiln-scaling-"))
    results: dict[int, dict[str, Any]] = {}
    try:
        for layers in depths:
            model = work / f"l{layers}"
            save_random_checkpoint(SHAPES[shape_name], model, num_hidden_layers=layers)
            results[layers] = _cold_load(model, level, work / f"c{layers}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return results


def render(report: dict[str, Any]) -> str:
    rows = [[n, fmt(report["cold_compile_seconds"][n], 2, "s"), str(r["inductor_compiles"]), str(r["pieces"]),
             str(r["unique_pieces"])] for n, r in report["results"].items()]
    shallow, deep = report["results"]
    ratio = report[f"ratio_{deep}_over_{shallow}"]
    return "\n".join([
        f"cold compile at -O{report['level']} (trace + split + Inductor), width of {report['width']}",
        "",
        format_table(["layers", "cold compile", "Inductor compilations", "pieces", "unique pieces"], rows),
        "",
        f"{deep} / {shallow} = {ratio:.2f}x (target <= {TARGET_RATIO_MAX}x); "
        f"same Inductor compilations: {report['same_inductor_compiles']}",
    ])


def _depths(text: str) -> tuple[int, int]:
    depths = tuple(int(x) for x in text.split(","))
    if len(depths) != 2 or not 0 < depths[0] < depths[1]:
        raise argparse.ArgumentTypeError("two depths, shallow then deep, e.g. 2,24")
    return depths  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compile_scaling")
    p.add_argument("-O", dest="level", type=int, default=2, choices=[1, 2, 3])
    p.add_argument("--shape", choices=list(SHAPES), default=DEFAULT_SHAPE,
                   help=f"the width to build (default {DEFAULT_SHAPE}; qwen3-tiny is for smoke tests)")
    p.add_argument("--layers", type=_depths, default=(2, 24), help="the two depths (default 2,24)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    record = RunRecord("compile_scaling", "cpu")
    results = measure(args.shape, args.layers, args.level)
    cold = {str(n): r["phases"]["trace"] + r["phases"]["split"] + r["phases"]["compile"] for n, r in results.items()}
    shallow, deep = args.layers
    report = {
        **record.head(),
        "level": args.level,
        "width": SHAPES[args.shape].describe_width(),
        "results": {str(n): r for n, r in results.items()},
        "cold_compile_seconds": cold,
        f"ratio_{deep}_over_{shallow}": cold[str(deep)] / cold[str(shallow)],
        "same_inductor_compiles": results[shallow]["inductor_compiles"] == results[deep]["inductor_compiles"],
        "target_ratio_max": TARGET_RATIO_MAX,
    }
    publish(report, "compile-scaling", render(report), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
