"""``compile="background"``: serve eagerly from the start, compile in another
process, swap the compiled pieces in between two steps; a failed or killed build
leaves the engine eager; processes starting together build once.
``compile="eager-first"``: the same on a miss, and eager at first on a hit too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kiln import Runtime, SamplingParams
from kiln.compiler import artifacts
from tests.conftest import fresh_env

LONG = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
BUILD_TIMEOUT = 600.0


def _wait_for(rt: Runtime, states: tuple[str, ...], timeout: float = BUILD_TIMEOUT) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = rt.startup_report["background_compile"]["state"]
        if state in states:
            return state
        time.sleep(0.2)
    raise AssertionError(f"the background build did not reach {states}: {rt.startup_report['background_compile']}")


@pytest.fixture(scope="module")
def eager_long(tiny) -> list[int]:
    path, prompts, _ = tiny
    return Runtime.load(path, optimization_level=0).generate([prompts[1]], LONG)[0].token_ids


def test_a_request_in_flight_across_the_swap_keeps_the_eager_tokens(tiny, eager_long, tmp_path) -> None:
    path, prompts, expected = tiny
    rt = Runtime.load(path, optimization_level=1, compile="background", cache_dir=tmp_path / "cache")
    report = rt.startup_report
    assert report["compile_mode"] == "background" and report["execution"] == "eager"
    assert report["background_compile"]["state"] == "building" and report["inductor_compiles"] == 0
    assert rt.stats().execution == "eager" and rt.compiled is None
    # eager from the first step, with the eager tokens
    assert [o.token_ids for o in rt.generate(prompts, SamplingParams(max_tokens=6, temperature=0,
                                                                       ignore_eos=True))] == expected
    rid = rt.add_request(prompts[1], LONG)
    for _ in range(5):
        rt.step()
    assert _wait_for(rt, ("ready", "failed")) == "ready"
    seen = set()
    while not rt.get_output(rid).finished:
        rt.step()
        seen.add(rt.stats().execution)
    assert seen == {"compiled"}  # the swap came at the first step after the build was ready
    assert rt.release(rid).token_ids == eager_long
    done = rt.startup_report["background_compile"]
    assert done["state"] == "swapped" and done["execution_after"] == "compiled"
    assert done["build_cache"] == "miss" and done["inductor_compiles"] == 3
    assert 0 < done["build_seconds"] <= done["swapped_at_seconds"]
    assert rt.stats().background_compile == "swapped" and rt.compiled is not None
    # the next start finds the entry: compiled from the first step, no build
    again = Runtime.load(path, optimization_level=1, compile="background", cache_dir=tmp_path / "cache")
    assert again.startup_report["execution"] == "compiled" and "background_compile" not in again.startup_report
    assert again.startup_report["compile_cache"] == "hit"
    assert again.generate([prompts[1]], LONG)[0].token_ids == eager_long


def test_a_killed_build_leaves_the_engine_eager_and_a_later_start_rebuilds(tiny, eager_long, tmp_path) -> None:
    path, prompts, _ = tiny
    cache = tmp_path / "cache"
    rt = Runtime.load(path, optimization_level=1, compile="background", cache_dir=cache)
    pid = rt.startup_report["background_compile"]["pid"]
    deadline = time.monotonic() + BUILD_TIMEOUT
    while not [e for e in (cache / "compiled").glob("*") if e.name != "locks"]:  # compiling, half written
        assert time.monotonic() < deadline and rt.startup_report["background_compile"]["state"] == "building"
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    assert _wait_for(rt, ("failed", "ready"), timeout=60) == "failed"
    report = rt.startup_report["background_compile"]
    assert "killed by signal 9" in report["error"] and report["execution_after"] is None
    assert rt.generate([prompts[1]], LONG)[0].token_ids == eager_long
    assert rt.stats().execution == "eager" and rt.stats().background_compile == "failed"
    rebuilt = Runtime.load(path, optimization_level=1, cache_dir=cache)
    assert rebuilt.startup_report["compile_cache"] == "miss" and rebuilt.startup_report["inductor_compiles"] == 3
    assert rebuilt.generate([prompts[1]], LONG)[0].token_ids == eager_long


CHILD = r"""
import json, sys, time
from kiln import Runtime, SamplingParams
rt = Runtime.load(sys.argv[1], optimization_level=1, compile="background", cache_dir=sys.argv[2])
loaded = {"execution": rt.startup_report["execution"], "dynamo": "torch._dynamo" in sys.modules}
params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
first = rt.generate([json.loads(sys.argv[3])], params)[0].token_ids
deadline = time.monotonic() + 600
while rt.startup_report["background_compile"]["state"] not in ("ready", "swapped", "failed"):
    assert time.monotonic() < deadline
    time.sleep(0.2)
after = rt.generate([json.loads(sys.argv[3])], params)[0].token_ids
print(json.dumps({**loaded, "first": first, "after": after, "build": rt.startup_report["background_compile"],
                  "execution_after": rt.stats().execution, "loader": rt.compiled.stats.artifact_loader,
                  "compiler_after": [m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules]}))
"""


def test_two_processes_on_one_empty_cache_build_once_and_both_swap(tiny, eager_long, tmp_path) -> None:
    path, prompts, _ = tiny
    cache = tmp_path / "cache"
    env = fresh_env(tmp_path / "machine")
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(cache), json.dumps(prompts[1])],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    for r in results:
        # eager until the swap, with no Dynamo or Inductor in the serving process before it
        assert r["execution"] == "eager" and not r["dynamo"]
        assert r["first"] == eager_long and r["after"] == eager_long
        assert r["build"]["state"] == "swapped" and r["execution_after"] == "compiled"
        # the built entry's artifacts replayed: the serving process never imported the compiler
        assert r["loader"] == "replay" and r["compiler_after"] == []
    assert sorted(r["build"]["build_cache"] for r in results) == ["hit", "miss"]  # one compiled, one loaded
    assert sorted(r["build"]["inductor_compiles"] for r in results) == [0, 3]
    assert len(list((cache / "compiled").iterdir())) == 2  # the entry and its lock directory


def test_the_compile_option_is_checked_before_loading(tmp_path) -> None:
    with pytest.raises(ValueError, match="compile must be one of 'blocking', 'background', 'eager-first', got 'later'"):
        Runtime.load(tmp_path / "missing", compile="later")


def test_eager_first_builds_on_a_miss_and_serves_a_hit_eagerly_until_it_is_loaded(tiny, eager_long, tmp_path,
                                                                                 monkeypatch) -> None:
    path, prompts, expected = tiny
    cache = tmp_path / "cache"
    missed = Runtime.load(path, optimization_level=1, compile="eager-first", cache_dir=cache)
    assert missed.startup_report["background_compile"]["state"] == "building"  # as compile="background"
    assert _wait_for(missed, ("ready", "failed")) == "ready"
    missed.close()

    # The entry's artifacts replay without Inductor: nothing to import, so the
    # swap comes right after the first (eager) step.
    monkeypatch.setattr(artifacts, "warm_up", lambda: pytest.fail("a replayable entry imported the compiler"))
    quick = Runtime.load(path, optimization_level=1, compile="eager-first", cache_dir=cache)
    rid = quick.add_request(prompts[1], LONG)
    quick.step()
    assert quick.stats().execution == "eager"
    assert _wait_for(quick, ("ready", "failed"), timeout=60) == "ready"
    while not quick.get_output(rid).finished:
        quick.step()
    assert quick.stats().execution == "compiled" and quick.compiled.stats.artifact_loader == "replay"
    assert quick.release(rid).token_ids == eager_long
    quick.close()

    # Without its replay records (as a CUDA entry has none) the load imports the
    # compiler first. This process has imported it already: hold the loading
    # thread until the engine has stepped eagerly, as the imports would in a
    # fresh process.
    (manifest_path,) = (cache / "compiled").glob("*/manifest.json")
    manifest = json.loads(manifest_path.read_text())
    del manifest["replay"]
    manifest_path.write_text(json.dumps(manifest))
    imports_done = threading.Event()
    monkeypatch.setattr(artifacts, "warm_up", lambda: imports_done.wait(60))
    rt = Runtime.load(path, optimization_level=1, compile="eager-first", cache_dir=cache)
    report = rt.startup_report
    assert report["compile_mode"] == "eager-first" and report["execution"] == "eager"
    assert "import_compiler" not in report["phases"] and report["artifacts_loaded"] == 0
    build = report["background_compile"]
    assert build["state"] == "loading" and build["pid"] is None and build["build_cache"] == "hit"
    rid = rt.add_request(prompts[1], LONG)
    for _ in range(5):
        rt.step()
        assert rt.stats().execution == "eager"
    imports_done.set()
    assert _wait_for(rt, ("ready", "failed"), timeout=120) == "ready"
    seen = set()
    while not rt.get_output(rid).finished:
        rt.step()
        seen.add(rt.stats().execution)
    assert seen == {"compiled"}  # swapped in at the first step after the imports
    assert rt.release(rid).token_ids == eager_long
    done = rt.startup_report["background_compile"]
    assert done["state"] == "swapped" and done["build_seconds"] is None and done["swap_pause_seconds"] > 0
    assert rt.compiled is not None and rt.compiled.stats.artifacts_loaded == 3
    assert rt.compiled.stats.inductor_compiles == 0 and rt.compiled.stats.cache == "hit"
    assert rt.compiled.stats.artifact_loader == "inductor"
    outs = rt.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
