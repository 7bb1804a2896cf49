"""The toolchain warm-up of a cold CPU compile (``kiln.compiler.toolchain.ToolchainWarmup``)
predicts the vector ISA Inductor's probe picks and builds the precompiled C++
header for it, what the compile's first kernel would otherwise build first.

On a machine that never ran Inductor, the warm-up runs, then a small vectorised
graph is compiled with kiln's Inductor settings and the predicted ISA while
every C++ build is recorded: the compile must build its kernel and nothing else
(no probe, no header), the header it includes must be the one the warm-up
built, and the prediction must be the probe's own answer, asked afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import fresh_env

SCRIPT = r"""
import json, sys
from pathlib import Path
import torch
from torch._inductor import codecache, config, cpp_builder
from kiln.compiler.artifacts import inductor_settings
from kiln.compiler.toolchain import ToolchainWarmup, recorded_vec_isa, vec_isa_record

def step(x):
    return (x * 2.0 + 1.0,)

with inductor_settings(), config.patch({"compile_threads": 1}):
    warmup = ToolchainWarmup("cpu")
    warmup.join()
    headers = {p.name: p.stat().st_mtime_ns for p in Path(codecache._HEADER_DIR).glob("*.gch")}
    builds = []
    build = cpp_builder.CppBuilder.build
    def recording_build(self):
        builds.append(self.get_target_file_path())
        return build(self)
    cpp_builder.CppBuilder.build = recording_build
    gm = torch.fx.symbolic_trace(step)
    with recorded_vec_isa(warmup.predicted):
        fn = torch._inductor.standalone_compile(gm, [torch.zeros(256)], dynamic_shapes="from_example_inputs",
                                                options={})
    out = fn(torch.ones(256))
    out = out[0] if isinstance(out, (list, tuple)) else out
    after = {p.name: p.stat().st_mtime_ns for p in Path(codecache._HEADER_DIR).glob("*.gch")}
    cpp_builder.CppBuilder.build = build
    probed = vec_isa_record()  # the probe's builds, now
print(json.dumps({"headers": headers, "after": after, "builds": builds, "value": float(out[0]),
                  "predicted": warmup.predicted, "probed": probed}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the warm-up forks, which kiln does on Linux only")
def test_warmup_predicts_the_probe_and_builds_the_header_the_compile_uses(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=fresh_env(tmp_path), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["value"] == 3.0
    assert len(r["headers"]) == 1, f"the warm-up should build one header, found {sorted(r['headers'])}"
    assert r["after"] == r["headers"], "the compile built or rebuilt a header the warm-up should have built"
    libraries = [b for b in r["builds"] if b.endswith(".so")]
    others = [b for b in r["builds"] if not b.endswith(".so") and not b.endswith(".i")]
    assert len(libraries) == 1, f"only the graph's kernel should be built, got {libraries}"
    assert libraries[0].endswith(".main.so"), libraries  # a kernel, not an ISA probe library
    assert others == [], others
    assert r["predicted"] == r["probed"]  # a CPU and compiler that build what their flags say
