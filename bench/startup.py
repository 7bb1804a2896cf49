"""Startup benchmark: cold compile, warm start, eager start, and serving while
compiling in the background.

Run from the repository root::

    python -m bench.startup                          # SmolLM2-135M shape, random fp32 weights, -O2
    python -m bench.startup --baseline-ref HEAD~3    # also the cold compile of an earlier commit
    python -m bench.startup --shape qwen3-tiny --repeats 1 --after-swap 5    # smoke test

Everything runs in fresh processes (imports included) on the same checkpoint.
Cold compiles run as on a machine that never ran kiln or Inductor: HOME,
TMPDIR and the Inductor and kiln caches in new empty directories.

* cold: ``python -m kiln compile MODEL --out DIR``, and with ``--baseline-ref``
  the same command from a git worktree of that commit, in the same run, the two
  taking turns (``--cold-repeats`` each): seconds, and the CPU seconds of the
  command and everything it started (the cores it kept busy);
* warm: ``Runtime.load(bundle)`` to the first generated token, with the load's
  phases;
* eager-first: ``Runtime.load(bundle, compile="eager-first")`` to the first
  token, then batch-1 decoding until ``--after-swap`` seconds after the bundle's
  pieces were swapped in: when, and tokens/s before and after;
* eager: ``Runtime.load(MODEL, optimization_level=0)`` to the first token, and
  transformers' ``from_pretrained`` of the same checkpoint;
* background: ``Runtime.load(MODEL, compile="background")`` on an empty cache,
  then batch-1 decoding, one 64-token request after another, until
  ``--after-swap`` seconds after the compiled pieces were swapped in: the first
  token, the swap, and tokens/s before and after it; a warm -O2 start
  decoding the same way before it (the bundle) and after it (the cache it
  filled), whose mean rate the throughput after the swap is compared with.

It prints a table, writes JSON to ``bench/results/startup-<device>-<stamp>.json``
(and ``-latest.json``), and the background run's tokens/s over time as an SVG
plot beside it (``startup-background-<device>-<stamp>.svg``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common.models import DEFAULT_SHAPE, SHAPES, ensure_shape_model
from bench.common.plot import line_plot_svg
from bench.common.report import RESULTS_DIR, RunRecord, publish

REPO = Path(__file__).resolve().parent.parent

FIRST_TOKEN = r"""
import sys, time, json
t_imports = time.time()
from kiln import Runtime, SamplingParams
t_load = time.time()
rt = Runtime.load(sys.argv[1], **json.loads(sys.argv[2]))
out = rt.generate([list(range(1, 33))], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
r = rt.startup_report
print(json.dumps({"first_token_at": time.time(), "load_started_at": t_load, "token": out[0].token_ids,
                  "report": {k: r[k] for k in ("total_seconds", "dynamo_traces", "inductor_compiles",
                                               "artifacts_loaded", "compile_cache", "artifact_loader",
                                               "phases")},
                  "compiler_imported": "torch._inductor" in sys.modules}))
"""

TRANSFORMERS_LOAD = r"""
import os, sys, time, json
import torch, transformers
t0 = time.time()
path = sys.argv[1]
if path.endswith(".gguf"):  # transformers reads a GGUF file by its folder and name
    transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path),
                                                      dtype=torch.float32)
else:
    transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
print(json.dumps({"load_seconds": time.time() - t0}))
"""

# Batch-1 decoding, request after request: (seconds since the process started,
# tokens, what ran) per step, until ``after`` seconds past the swap (background)
# or for ``after`` seconds (a warm start).
DECODE_TIMELINE = r"""
import sys, time, json
t_start = float(sys.argv[3])
from kiln import Runtime, SamplingParams
options, after = json.loads(sys.argv[2]), float(sys.argv[4])
rt = Runtime.load(sys.argv[1], **options)
steps, end = [], None
params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
while end is None or time.time() < end:
    rid = rt.add_request(list(range(1, 33)), params)
    while not rt.get_output(rid).finished:
        n = sum(len(d.token_ids) for d in rt.step())
        steps.append((time.time() - t_start, n, rt.stats().execution))
        if end is None and (rt.stats().execution == "compiled" or rt.stats().background_compile == "failed"):
            end = time.time() + after
    rt.release(rid)
print(json.dumps({"steps": steps, "report": {k: v for k, v in rt.startup_report.items()
                                             if k in ("total_seconds", "phases", "background_compile",
                                                      "compile_cache", "execution")}}))
"""


def _fresh_env(root: Path) -> dict[str, str]:
    """A machine that never ran kiln or Inductor."""
    env = dict(os.environ)
    for name in ("HOME", "TMPDIR", "TORCHINDUCTOR_CACHE_DIR", "KILN_CACHE_DIR"):
        (root / name.lower()).mkdir(parents=True, exist_ok=True)
        env[name] = str(root / name.lower())
    env.pop("XDG_CACHE_HOME", None)
    return env


def _child(script: str, args: list[str], env: dict[str, str], cwd: Path | None = None) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                          timeout=3600, cwd=cwd)
    if proc.returncode != 0:
        raise RuntimeError(f"child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _first_token(target: str, kwargs: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    start = time.time()
    r = _child(FIRST_TOKEN, [target, json.dumps(kwargs)], env)
    r["seconds_to_first_token"] = r["first_token_at"] - start  # from the process's start, imports included
    r["load_to_first_token"] = r["first_token_at"] - r["load_started_at"]  # Runtime.load + one token
    return r


def _cold_compile(model: Path, level: int, root: Path, source: Path) -> dict[str, Any]:
    """``python -m kiln compile`` of the kiln in ``source`` on a fresh machine:
    seconds, CPU seconds, and the compile's own record from the bundle's manifest."""
    bundle = root / "bundle"
    t0, used = time.time(), _children_cpu_seconds()
    proc = subprocess.run([sys.executable, "-m", "kiln", "compile", str(model), "--out", str(bundle), f"-O{level}"],
                          capture_output=True, text=True, env=_fresh_env(root / "machine"), timeout=3600, cwd=source)
    seconds, cpu = time.time() - t0, _children_cpu_seconds() - used
    if proc.returncode != 0:
        raise RuntimeError(f"kiln compile failed:\n{proc.stderr[-3000:]}")
    manifest = json.loads((bundle / "compiled" / "manifest.json").read_text())
    return {"seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2), "summary": proc.stderr.strip().splitlines()[-1],
            "stats": manifest.get("stats", {}), "bundle": str(bundle)}


def _children_cpu_seconds() -> float:
    """User and system CPU seconds of every finished process this one started, theirs
    included (the compile's workers and C++ builds): on a machine whose cores a cold
    compile keeps busy, the figure that moving work between processes cannot lower."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _cold_compiles(model: Path, level: int, root: Path, sources: list[Path], repeats: int) -> list[dict[str, Any]]:
    """For each source tree, the median of ``repeats`` cold compiles (each on its
    own fresh machine), the trees taking turns so that a change in the machine's
    speed meets them alike."""
    runs: list[list[dict[str, Any]]] = [[] for _ in sources]
    for i in range(repeats):
        for j, source in enumerate(sources):
            runs[j].append(_cold_compile(model, level, root / f"tree-{j}-run-{i}", source))
    out = []
    for tree in runs:
        median = sorted(tree, key=lambda r: r["seconds"])[len(tree) // 2]
        out.append({**median, "runs_seconds": [r["seconds"] for r in tree],
                    "runs_cpu_seconds": [r["cpu_seconds"] for r in tree]})
    return out


def _worktree(ref: str, dest: Path) -> Path:
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(dest), ref], check=True,
                   capture_output=True)
    return dest


def _rates(steps: list[list[Any]], t0: float, t1: float) -> float:
    tokens = sum(n for t, n, _ in steps if t0 <= t < t1)
    return tokens / (t1 - t0) if t1 > t0 else 0.0


def _background(model: Path, bundle: str, level: int, root: Path, after: float) -> dict[str, Any]:
    """The background run on an empty cache, between two warm starts decoding
    the same way: one of ``bundle`` (the cold compile's) before it, one on the
    cache it filled after it. The warm rate is their mean, so that a drift of
    the machine's speed over the minute of the background run weighs on both
    sides alike (one warm start after it gave ratios of 0.81-0.99 in runs of
    the same code)."""
    env = _fresh_env(root / "machine")

    def timeline(path: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        return _child(DECODE_TIMELINE, [path, json.dumps(kwargs), str(time.time()), str(after)], env)

    def rate(run: dict[str, Any]) -> float:
        steps = run["steps"]
        return _rates(steps, steps[len(steps) // 10][0], steps[-1][0])

    before = timeline(bundle, {})
    bg = timeline(str(model), {"optimization_level": level, "compile": "background"})
    steps = bg["steps"]
    swap = next((t for t, _, ex in steps if ex == "compiled"), None)
    warm = timeline(str(model), {"optimization_level": level})
    warm_rates = [rate(before), rate(warm)]
    warm_rate = sum(warm_rates) / 2
    first = next(t for t, n, _ in steps if n)
    seconds = range(int(steps[-1][0]) + 1)
    result = {"first_token_seconds": round(first, 3), "swap_seconds": swap, "report": bg["report"],
              # tokens/s over each second since the process started (what the plot shows)
              "tokens_per_second": [[t, round(_rates(steps, t, t + 1), 2)] for t in seconds],
              "warm_O2_tokens_per_s": round(warm_rate, 2),
              "warm_O2_runs_tokens_per_s": [round(r, 2) for r in warm_rates], "warm_O2_report": warm["report"]}
    if swap is not None:
        result["eager_tokens_per_s"] = round(_rates(steps, first, swap), 2)
        result["after_swap_tokens_per_s"] = round(_rates(steps, swap + 1.0, steps[-1][0]), 2)
        result["after_swap_over_warm"] = round(result["after_swap_tokens_per_s"] / warm_rate, 3)
    return result


def _eager_first(bundle: str, env: dict[str, str], after: float, repeats: int) -> dict[str, Any]:
    """A warm start that serves before the compiler is imported: first tokens
    (``repeats`` processes), then one decode timeline across the swap."""
    firsts = [_first_token(bundle, {"compile": "eager-first"}, env) for _ in range(repeats)]
    t0 = time.time()
    r = _child(DECODE_TIMELINE, [bundle, json.dumps({"compile": "eager-first"}), str(t0), str(after)], env)
    steps = r["steps"]
    first = next(t for t, n, _ in steps if n)
    swap = next((t for t, _, ex in steps if ex == "compiled"), None)
    result = {"load_to_first_token_seconds": _median(firsts, "load_to_first_token"),
              "to_first_token_seconds": _median(firsts, "seconds_to_first_token"),
              "timeline_first_token_seconds": round(first, 3), "swap_seconds": swap, "report": r["report"],
              "runs": firsts}
    if swap is not None:
        result["eager_tokens_per_s"] = round(_rates(steps, first, swap), 2)
        result["after_swap_tokens_per_s"] = round(_rates(steps, swap + 1.0, steps[-1][0]), 2)
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    record = RunRecord("startup", "cpu")
    model = args.model or ensure_shape_model(args.shape)
    work = Path(tempfile.mkdtemp(prefix="kiln-startup-"))
    try:
        trees = [REPO] + ([_worktree(args.baseline_ref, work / "baseline-tree")] if args.baseline_ref else [])
        cold, *rest = _cold_compiles(model, args.level, work / "cold", trees, args.cold_repeats)
        baseline = {**rest[0], "ref": args.baseline_ref} if rest else None
        env = {**os.environ, "KILN_CACHE_DIR": str(work / "user-cache")}
        warm = [_first_token(cold["bundle"], {}, env) for _ in range(args.repeats)]
        eager_first = _eager_first(cold["bundle"], env, args.after_swap / 4, args.repeats)
        eager = [_first_token(str(model), {"optimization_level": 0}, env) for _ in range(args.repeats)]
        hf = [_child(TRANSFORMERS_LOAD, [str(model)], env)["load_seconds"] for _ in range(args.repeats)]
        background = _background(model, cold["bundle"], args.level, work / "background", args.after_swap)
    finally:
        if args.baseline_ref:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(work / "baseline-tree")],
                           capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    return _summary(record, model, args, cold, baseline, warm, eager, hf, background, eager_first)


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return round(statistics.median(r[key] for r in runs), 3)


def _summary(record: RunRecord, model: Path, args: argparse.Namespace, cold: dict[str, Any],
             baseline: dict[str, Any] | None, warm: list[dict[str, Any]], eager: list[dict[str, Any]],
             hf: list[float], background: dict[str, Any], deferred: dict[str, Any]) -> dict[str, Any]:
    for compiled in (cold, baseline):
        if compiled:
            compiled.pop("bundle")  # a temporary directory, gone by now
    eager_load = statistics.median(r["report"]["phases"]["load_weights"] for r in eager)
    eager_first = _median(eager, "seconds_to_first_token")
    goals = {
        "cold_compile_max_seconds": 30.0, "cold_over_baseline_max": 0.5, "eager_load_over_transformers_max": 1.5,
        "warm_load_to_first_token_max_seconds": 1.5, "background_first_token_over_eager_max_seconds": 1.0,
        "after_swap_over_warm_min": 0.9,
    }
    return {
        **record.head(), "model": str(model), "level": args.level,
        "cold_compile": cold, "cold_compile_baseline": baseline,
        "cold_over_baseline": round(cold["seconds"] / baseline["seconds"], 3) if baseline else None,
        "warm_bundle_to_first_token_seconds": _median(warm, "seconds_to_first_token"),
        "warm_load_to_first_token_seconds": _median(warm, "load_to_first_token"),
        "eager_first": deferred,
        "eager_to_first_token_seconds": eager_first,
        "eager_load_to_first_token_seconds": _median(eager, "load_to_first_token"),
        "eager_load_weights_seconds": round(eager_load, 3),
        "transformers_load_seconds": round(statistics.median(hf), 3),
        "eager_load_over_transformers": round(eager_load / statistics.median(hf), 3),
        "background": background,
        "background_first_token_minus_eager_seconds": round(background["first_token_seconds"] - eager_first, 3),
        "goals": goals,
        "same_first_token": all(r["token"] == eager[0]["token"] for r in [*warm, *eager]),
        "warm_runs": warm, "eager_runs": eager,
    }


def _cpu(compiled: dict[str, Any]) -> str:
    cpu = compiled.get("cpu_seconds")
    return f"CPU {cpu:.1f} s ({cpu / compiled['seconds']:.2f} cores busy)" if cpu is not None else "CPU not measured"


def render(r: dict[str, Any]) -> str:
    bg, ef = r["background"], r["eager_first"]
    cold, base = r["cold_compile"], r["cold_compile_baseline"]
    rows = [
        (f"cold: kiln compile -O{r['level']} (fresh machine)", f"{cold['seconds']:8.2f} s",
         f"{cold['stats'].get('compile_workers', 1)} workers, {cold['stats'].get('inductor_compiles')} compiles, "
         f"{_cpu(cold)}"),
        *([(f"cold: the same at {base['ref']}", f"{base['seconds']:8.2f} s",
            f"ratio {r['cold_over_baseline']:.2f} (goal <= 0.5), {_cpu(base)}")] if base else []),
        ("warm: Runtime.load(bundle) + 1 token", f"{r['warm_load_to_first_token_seconds']:8.2f} s",
         f"goal <= 1.5 s; {r['warm_bundle_to_first_token_seconds']:.2f} s from the process's start; "
         f"artifacts loaded by {r['warm_runs'][0]['report']['artifact_loader']}, Inductor imported: "
         f"{r['warm_runs'][0]['compiler_imported']}"),
        ("warm, eager-first: Runtime.load(bundle) + 1 token", f"{ef['load_to_first_token_seconds']:8.2f} s",
         f"{ef['to_first_token_seconds']:.2f} s from the process's start"),
        *([("warm, eager-first: bundle's pieces swapped in", f"{ef['swap_seconds']:8.2f} s",
            f"from the process's start; decode tok/s {ef['eager_tokens_per_s']:.1f} -> "
            f"{ef['after_swap_tokens_per_s']:.1f}, pause {ef['report']['background_compile']['swap_pause_seconds']} s")]
          if ef.get("swap_seconds") is not None else []),
        ("-O0: Runtime.load(model) + 1 token", f"{r['eager_load_to_first_token_seconds']:8.2f} s",
         f"{r['eager_to_first_token_seconds']:.2f} s from the process's start"),
        ("-O0: load_weights phase", f"{r['eager_load_weights_seconds']:8.2f} s",
         f"transformers from_pretrained {r['transformers_load_seconds']:.2f} s: "
         f"ratio {r['eager_load_over_transformers']:.2f} (goal <= 1.5)"),
        ("background: first token (empty cache)", f"{bg['first_token_seconds']:8.2f} s",
         f"-O0 {r['background_first_token_minus_eager_seconds']:+.2f} s (goal <= +1 s)"),
    ]
    if bg.get("swap_seconds") is not None:
        rows += [("background: compiled pieces swapped in", f"{bg['swap_seconds']:8.2f} s",
                  f"build {bg['report']['background_compile']['build_seconds']} s, pause "
                  f"{bg['report']['background_compile']['swap_pause_seconds']} s"),
                 ("background: decode tok/s eager -> compiled",
                  f"{bg['eager_tokens_per_s']:5.1f} -> {bg['after_swap_tokens_per_s']:.1f}",
                  f"warm -O2 starts before and after {bg['warm_O2_tokens_per_s']:.1f}: "
                  f"ratio {bg['after_swap_over_warm']:.2f} (goal >= 0.9)")]
    width = max(len(a) for a, _, _ in rows)
    return "\n".join([f"startup benchmark: {r['model']}", "",
                      *(f"{a:<{width}}  {b:>12}  {c}" for a, b, c in rows), "",
                      f"same first token everywhere: {r['same_first_token']}"])


def _plot(r: dict[str, Any], out: Path) -> Path:
    """tokens/s over 1-second windows of the background run, the swap marked."""
    bg = r["background"]
    points = [(t + 0.5, rate) for t, rate in bg["tokens_per_second"]]
    marks = [(bg["swap_seconds"], "compiled pieces swapped in")] if bg.get("swap_seconds") is not None else []
    marks.append((bg["first_token_seconds"], "first token"))
    svg = line_plot_svg(points, marks, title=f"kiln -O{r['level']}, compile='background', empty cache: "
                                              "batch-1 decode", x_label="seconds since the process started",
                        y_label="tokens/s")
    path = out / f"startup-background-{r['machine']['device']}-{r['run_stamp']}.svg"
    path.write_text(svg)
    (out / f"startup-background-{r['machine']['device']}-latest.svg").write_text(svg)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="checkpoint (default: the --shape model)")
    p.add_argument("--shape", choices=list(SHAPES), default=DEFAULT_SHAPE,
                   help=f"benchmark model to build and run when no --model is given (default {DEFAULT_SHAPE}; "
                        "qwen3-tiny is for smoke tests)")
    p.add_argument("-O", dest="level", type=int, default=2, choices=[1, 2, 3])
    p.add_argument("--repeats", type=int, default=3, help="warm and eager starts (the median is reported)")
    p.add_argument("--cold-repeats", type=int, default=1, help="cold compiles of each side (the median)")
    p.add_argument("--after-swap", type=float, default=20.0, help="seconds decoded after the swap (and warm)")
    p.add_argument("--baseline-ref", default=None, help="a git commit whose cold compile runs in the same run")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    report = run(args)
    publish(report, "startup", render(report), args.out)
    if args.out is not None:
        print(f"plot: {_plot(report, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
