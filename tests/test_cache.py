"""The automatic compile cache: a restart loads instead of compiling, on a fresh
machine with no compiler, from a read-only cache, and after damage."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln import Runtime, SamplingParams
from tests.conftest import CPU_LM_HEADS, build_hf_model, fresh_env, kiln_cli, random_prompts, run_child, save_checkpoint

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
# unique pieces x (range + exact size 1 + one few-row runnable for 2 to 8 tokens with
# the C linear kernel; without it, range + exact sizes 1, 2, 4 + the CPU LM head at each)
COMPILES = {1: 3, 2: (3 * 4 + CPU_LM_HEADS) if CPU_LM_HEADS else 3 * 3}


@pytest.fixture(scope="module", params=[1, 2])
def warm_cache(request, tiny, tmp_path_factory):
    """A cache holding the tiny model compiled at -O1 or -O2 by a cold start."""
    path, prompts, expected = tiny
    level = request.param
    root = tmp_path_factory.mktemp(f"cold-O{level}")
    cold = run_child(path, {"optimization_level": level, "cache_dir": str(root / "cache")}, prompts,
                     env=fresh_env(root / "machine"))
    assert cold["compile_cache"] == "miss" and cold["dynamo_traces"] == 1
    assert cold["inductor_compiles"] == COMPILES[level]
    assert cold["tokens"] == expected
    return level, root / "cache"


def _needed_only(cache: Path, dest: Path) -> Path:
    """A copy of ``cache`` whose Inductor cache holds only the kernel libraries
    the entries list as needed: nothing left over from the build (the ISA probe's
    test libraries, sources) can stand in for an answer the entry must replay."""
    shutil.copytree(cache / "compiled", dest / "compiled", ignore=shutil.ignore_patterns("locks"))
    for entry in (dest / "compiled").iterdir():
        for name in json.loads((entry / "manifest.json").read_text())["kernels"]:
            (dest / "inductor" / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(cache / "inductor" / name, dest / "inductor" / name)
    return dest


def test_warm_start_on_a_fresh_machine_runs_no_compiler(tiny, warm_cache, tmp_path) -> None:
    """A new process on a machine that never ran Inductor (empty HOME, TMPDIR and
    Inductor cache dir) with failing compilers on PATH, from a cache holding only
    what the entry lists: the warm start asks the toolchain nothing (no ISA probe
    build, no ``--version``)."""
    path, prompts, expected = tiny
    level, built = warm_cache
    cache = _needed_only(built, tmp_path / "cache")
    log = tmp_path / "compiler-calls.log"
    warm = run_child(path, {"optimization_level": level, "cache_dir": str(cache)}, prompts,
                     env=fresh_env(tmp_path / "machine", failing_compilers_log=log))
    assert warm["compile_cache"] == "hit" and warm["kernels_rebuilt"] == 0
    assert warm["dynamo_traces"] == 0 and warm["inductor_compiles"] == 0
    assert warm["artifacts_loaded"] == COMPILES[level]
    assert warm["tokens"] == expected
    assert not log.exists(), log.read_text()
    # every artifact ran its exported code: no Dynamo or Inductor in the process
    assert warm["artifact_loader"] == "replay" and warm["compiler_imported"] == []
    assert "import_compiler" not in warm["phases"]


def test_a_read_only_cache_loads_and_a_miss_compiles_privately(tiny, warm_cache, tmp_path) -> None:
    path, prompts, expected = tiny
    level, cache = warm_cache
    load = {"optimization_level": level, "cache_dir": str(tmp_path / "mnt")}
    hit = run_child(path, load, prompts, env=fresh_env(tmp_path / "m1"), read_only=(cache, tmp_path / "mnt"))
    assert hit["compile_cache"] == "hit" and hit["inductor_compiles"] == 0 and hit["tokens"] == expected
    empty = tmp_path / "empty"
    empty.mkdir()
    miss = run_child(path, {**load, "cache_dir": str(tmp_path / "mnt2")}, prompts, env=fresh_env(tmp_path / "m2"),
                     read_only=(empty, tmp_path / "mnt2"))
    assert miss["compile_cache"] == "miss" and miss["tokens"] == expected
    assert "is read-only and holds no entry" in miss["stderr"] and "temporary cache" in miss["stderr"]
    assert not any(empty.iterdir())


def test_lost_or_damaged_kernels_are_rebuilt_and_reported(tiny, tmp_path) -> None:
    path, prompts, expected = tiny
    cache = tmp_path / "cache"
    load = {"optimization_level": 1, "cache_dir": str(cache)}
    assert run_child(path, load, prompts, env=fresh_env(tmp_path / "m0"))["compile_cache"] == "miss"
    entry = next(e for e in (cache / "compiled").iterdir() if e.name != "locks")
    kernels = json.loads((entry / "manifest.json").read_text())["kernels"]
    assert kernels and all(name.endswith(".so") for name in kernels)
    shutil.rmtree(cache / "inductor")
    verify = kiln_cli(["cache", "verify", "--cache-dir", str(cache)])
    assert verify.returncode == 1 and f"CORRUPT: inductor/{sorted(kernels)[0]}" in verify.stdout
    repaired = run_child(path, load, prompts, env=fresh_env(tmp_path / "m1"))
    assert repaired["compile_cache"] == "repaired" and repaired["kernels_rebuilt"] == len(kernels)
    assert repaired["inductor_compiles"] == 0 and repaired["tokens"] == expected
    assert repaired["attention_kernel"] is not None  # the C decode kernel, rebuilt with the rest
    assert "missing or altered" in repaired["stderr"]
    assert kiln_cli(["cache", "verify", "--cache-dir", str(cache)]).returncode == 0
    victim = cache / "inductor" / sorted(kernels)[-1]
    victim.write_bytes(victim.read_bytes()[:100])  # truncated
    # The same machine again (its precompiled C++ header kept, 10-15 s of g++ saved):
    # the kernels live in kiln's cache, not in anything the machine keeps.
    again = run_child(path, load, prompts, env=fresh_env(tmp_path / "m1"))
    assert again["compile_cache"] == "repaired" and again["kernels_rebuilt"] == 1 and again["tokens"] == expected
    assert run_child(path, load, prompts, env=fresh_env(tmp_path / "m1"))["compile_cache"] == "hit"


def test_corrupted_artifact_is_rebuilt(tiny, tmp_path, caplog) -> None:
    path, prompts, expected = tiny
    cache = tmp_path / "cache"
    first = Runtime.load(path, optimization_level=1, cache_dir=cache)
    assert [o.token_ids for o in first.generate(prompts, GREEDY)] == expected
    artifact = next((first.compiled.entry / "artifacts").iterdir())
    data = bytearray(artifact.read_bytes())
    data[len(data) // 2] ^= 0xFF
    artifact.write_bytes(bytes(data[: len(data) - 7]))
    with caplog.at_level("WARNING"):
        again = Runtime.load(path, optimization_level=1, cache_dir=cache)
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("kiln") and "corrupted" in r.getMessage()]
    assert len(warnings) == 1 and artifact.name in warnings[0]
    assert again.startup_report["compile_cache"] == "rebuilt"
    assert again.startup_report["inductor_compiles"] == 3
    assert [o.token_ids for o in again.generate(prompts, GREEDY)] == expected
    third = Runtime.load(path, optimization_level=1, cache_dir=cache)
    assert third.startup_report["compile_cache"] == "hit"


CONCURRENT = r"""
import json, sys
from kiln import Runtime, SamplingParams
rt = Runtime.load(sys.argv[1], optimization_level=1, cache_dir=sys.argv[2])
out = rt.generate(json.loads(sys.argv[3]), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
print(json.dumps({"tokens": [o.token_ids for o in out], "compiles": rt.startup_report["inductor_compiles"]}))
"""


def test_concurrent_cold_starts_compile_once(tiny, tmp_path) -> None:
    path, prompts, expected = tiny
    cache = tmp_path / "shared"
    procs = [
        subprocess.Popen([sys.executable, "-c", CONCURRENT, str(path), str(cache), json.dumps(prompts)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["compiles"] for r in results) == [0, 0, 3]
    assert all(r["tokens"] == expected for r in results)


def test_cache_cli_lists_verifies_and_clears(tiny, tmp_path) -> None:
    path, prompts, _ = tiny
    cache = tmp_path / "c"
    rt = Runtime.load(path, optimization_level=1, cache_dir=cache)
    entry = rt.compiled.entry
    env = {**os.environ, "KILN_CACHE_DIR": str(cache)}
    ls = kiln_cli(["cache", "ls"], env)
    assert ls.returncode == 0 and entry.name in ls.stdout and "Qwen2ForCausalLM" in ls.stdout
    assert "-O1" in ls.stdout
    ok = kiln_cli(["cache", "verify"], env)
    assert ok.returncode == 0 and f"{entry.name}  ok" in ok.stdout
    (entry / "graph.pkl").write_bytes(b"garbage")
    bad = kiln_cli(["cache", "verify"], env)
    assert bad.returncode == 1 and "CORRUPT: graph.pkl" in bad.stdout
    # a read-only cache: clear says what it could not remove, fails, and removes nothing
    mount = tmp_path / "ro"
    mount.mkdir()
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", f'mount --bind -o ro "{cache}" "{mount}" && exec "{sys.executable}" '
                                      f'-m kiln cache clear --cache-dir "{mount}"'],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    assert "could not clear" in proc.stderr and "Read-only file system" in proc.stderr
    assert "removed" not in proc.stdout and entry.exists()
    cleared = kiln_cli(["cache", "clear"], env)
    assert cleared.returncode == 0 and "removed 1" in cleared.stdout
    assert not entry.exists()
