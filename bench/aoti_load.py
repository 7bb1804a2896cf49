"""What a warm start could cost with AOTInductor artifacts instead of Inductor's
standalone ones: a probe for the warm-start goal of the startup work.

Run from the repository root::

    python -m bench.aoti_load            # SmolLM2-135M's MLP block, 2 threads

A kiln warm start today spends most of its time importing Inductor's loading
path (``import_compiler`` in the startup report: Dynamo, Inductor, and the hash
of torch's sources that keys Inductor's cache). An AOTInductor package is a
shared library with its own C++ runner, which ``torch._C._aoti`` loads without
importing Inductor or Dynamo at all. This benchmark compiles one piece the shape
of a kiln piece (RMSNorm and the gated MLP of a SmolLM2-135M layer, weights as
inputs as kiln passes them, token count dynamic 1..2048) into a ``.pt2``
package, then in fresh processes measures:

* ``aoti``: loading the package with ``torch._C._aoti.AOTIModelPackageLoader``
  and its first call, and whether Inductor or Dynamo were imported;
* ``inductor``: ``kiln.compiler.artifacts.warm_up``, the fixed cost kiln's warm
  path pays before its first artifact loads;
* per-call time at 1 and 64 tokens: the package against the same function in
  eager PyTorch.

It prints a table and writes ``bench/results/aoti-load-cpu-<stamp>.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.common.models import SMOLLM2_135M_SHAPE
from bench.common.report import RESULTS_DIR, RunRecord, fmt, format_table, publish

HIDDEN, INTERMEDIATE = SMOLLM2_135M_SHAPE["hidden_size"], SMOLLM2_135M_SHAPE["intermediate_size"]


def mlp_block(x: torch.Tensor, norm: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
              down: torch.Tensor) -> torch.Tensor:
    """RMSNorm, the gated MLP and the residual: one layer's second piece."""
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm
    return x + F.linear(F.silu(F.linear(h, gate)) * F.linear(h, up), down)


class _Block(torch.nn.Module):
    def forward(self, x, norm, gate, up, down):  # noqa: ANN001, ANN201
        return mlp_block(x, norm, gate, up, down)


def example_inputs(tokens: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(tokens, HIDDEN, generator=g), torch.ones(HIDDEN),
            torch.randn(INTERMEDIATE, HIDDEN, generator=g) * 0.02, torch.randn(INTERMEDIATE, HIDDEN, generator=g) * 0.02,
            torch.randn(HIDDEN, INTERMEDIATE, generator=g) * 0.02]


def build_package(path: Path) -> float:
    """Export the block with a dynamic token count and package it with
    AOTInductor at ``path``; return the seconds it took."""
    t0 = time.perf_counter()
    tokens = torch.export.Dim("tokens", min=1, max=2048)
    ep = torch.export.export(_Block(), tuple(example_inputs(4)), dynamic_shapes=({0: tokens}, None, None, None, None))
    torch._inductor.aoti_compile_and_package(ep, package_path=str(path))
    return time.perf_counter() - t0


AOTI_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
torch.set_num_threads(int(sys.argv[2]))
loader = torch._C._aoti.AOTIModelPackageLoader(sys.argv[1], "model", False, 1, -1)
t2 = time.perf_counter()
out = {"import_torch_seconds": t1 - t0, "load_seconds": t2 - t1,
       "inductor_imported": "torch._inductor.compile_fx" in sys.modules or "torch._inductor.codecache" in sys.modules,
       "dynamo_imported": "torch._dynamo" in sys.modules}
from bench.aoti_load import example_inputs, mlp_block
for n in (1, 64):
    args = example_inputs(n)
    t = time.perf_counter()
    got = loader.run(args)[0]
    if n == 1:
        out["first_call_seconds"] = time.perf_counter() - t
    out[f"max_abs_diff_{n}"] = (got - mlp_block(*args)).abs().max().item()
    for name, fn in (("aoti", lambda: loader.run(args)), ("eager", lambda: mlp_block(*args))):
        for _ in range(5):
            fn()
        t = time.perf_counter()
        for _ in range(50):
            fn()
        out[f"{name}_ms_at_{n}"] = (time.perf_counter() - t) / 50 * 1e3
print(json.dumps(out))
"""

INDUCTOR_CHILD = r"""
import json, time
import torch
t0 = time.perf_counter()
from kiln.compiler.artifacts import warm_up
warm_up()
print(json.dumps({"warm_up_seconds": time.perf_counter() - t0}))
"""


def _child(code: str, *argv: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True, env=env,
                         cwd=root)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> dict[str, Any]:
    import os

    record = RunRecord("aoti-load", "cpu")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="kiln-aoti-") as tmp:
        # A private Inductor cache, so the build is cold and nothing of it is left behind.
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor")}
        package = Path(tmp) / "block.pt2"
        saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = env["TORCHINDUCTOR_CACHE_DIR"]
        try:
            build_seconds = build_package(package)
        finally:
            if saved is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved
        aoti = [_child(AOTI_CHILD, str(package), str(args.threads), env=env) for _ in range(args.repeats)]
        inductor = [_child(INDUCTOR_CHILD, env=env) for _ in range(args.repeats)]
        package_bytes = package.stat().st_size

    def med(runs: list[dict[str, Any]], key: str) -> float:
        return sorted(r[key] for r in runs)[len(runs) // 2]

    keys = ["import_torch_seconds", "load_seconds", "first_call_seconds", "aoti_ms_at_1", "eager_ms_at_1",
            "aoti_ms_at_64", "eager_ms_at_64", "max_abs_diff_1", "max_abs_diff_64"]
    return {
        **record.head(torch_threads=args.threads),
        "piece": f"RMSNorm + gated MLP + residual, hidden {HIDDEN}, intermediate {INTERMEDIATE}, fp32, "
                 "weights as inputs, tokens dynamic 1..2048",
        "build_seconds": round(build_seconds, 2), "package_bytes": package_bytes,
        "aoti": {k: round(med(aoti, k), 6) for k in keys},
        "aoti_imports_inductor": any(r["inductor_imported"] for r in aoti),
        "aoti_imports_dynamo": any(r["dynamo_imported"] for r in aoti),
        "inductor_warm_up_seconds": round(med(inductor, "warm_up_seconds"), 3),
        "statistic": f"median of {args.repeats} fresh processes; per-call times: mean of 50 calls after 5",
        "runs": {"aoti": aoti, "inductor": inductor},
    }


def render(report: dict[str, Any]) -> str:
    a = report["aoti"]
    rows = [["AOTInductor package: load (torch._C._aoti)", fmt(a["load_seconds"] * 1e3, 1), "-"],
            ["AOTInductor package: first call", fmt(a["first_call_seconds"] * 1e3, 1), "-"],
            ["kiln warm path: Inductor import + torch key (warm_up)", fmt(report["inductor_warm_up_seconds"] * 1e3, 0),
             "-"],
            ["1 token: package / eager", fmt(a["aoti_ms_at_1"], 3), fmt(a["eager_ms_at_1"], 3)],
            ["64 tokens: package / eager", fmt(a["aoti_ms_at_64"], 3), fmt(a["eager_ms_at_64"], 3)]]
    return (f"{report['piece']}; built in {report['build_seconds']:.1f} s, "
            f"{report['package_bytes'] / 2**20:.1f} MiB\n"
            f"the package's process imported Inductor: {report['aoti_imports_inductor']}, "
            f"Dynamo: {report['aoti_imports_dynamo']}\n\n"
            + format_table(["what", "ms", "eager ms"], rows))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.aoti_load", description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per figure (default 3)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory (default bench/results)")
    args = p.parse_args(argv)
    if args.threads < 1 or args.repeats < 1:
        p.error("--threads and --repeats must be at least 1")
    report = run(args)
    publish(report, "aoti-load", render(report), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
