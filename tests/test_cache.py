"""The automatic compile cache: a restart loads instead of compiling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiln import Runtime, SamplingParams
from tests.conftest import build_hf_model, random_prompts, save_checkpoint

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

CHILD = r"""
import json, sys
from kiln import Runtime, SamplingParams
rt = Runtime.load(sys.argv[1], optimization_level=1, cache_dir=sys.argv[2])
out = rt.generate(json.loads(sys.argv[3]), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
r = rt.startup_report
print(json.dumps({"tokens": [o.token_ids for o in out], "traces": r["dynamo_traces"],
                  "compiles": r["inductor_compiles"], "loaded": r["artifacts_loaded"], "cache": r["compile_cache"]}))
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = build_hf_model("qwen2", seed=21, num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                           num_attention_heads=2, num_key_value_heads=1)
    path = save_checkpoint(model, tmp_path_factory.mktemp("tiny"))
    return path, random_prompts(2, [5, 9], model.config.vocab_size, seed=6)


def _child(path: Path, cache: Path, prompts: list[list[int]], shims: Path | None = None) -> dict:
    env = dict(os.environ)
    if shims is not None:
        env.update(PATH=f"{shims}{os.pathsep}{env['PATH']}", CC=str(shims / "gcc"), CXX=str(shims / "g++"))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path), str(cache), json.dumps(prompts)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _compiler_shims(where: Path, log: Path) -> Path:
    """C and C++ compilers on PATH that log every call and fail it: a warm start
    must not need a compiler at all (not even to ask its version)."""
    where.mkdir()
    for name in ("gcc", "g++", "cc", "c++", "clang", "clang++"):
        shim = where / name
        shim.write_text(f'#!/bin/sh\necho "{name} $*" >> "{log}"\nexit 1\n')
        shim.chmod(0o755)
    return where


def test_warm_start_in_a_fresh_process_compiles_nothing(tiny, tmp_path) -> None:
    path, prompts = tiny
    cache = tmp_path / "cache"
    eager = Runtime.load(path, optimization_level=0).generate(prompts, GREEDY)
    cold = _child(path, cache, prompts)
    assert cold["cache"] == "miss" and cold["traces"] == 1 and cold["compiles"] == 3
    log = tmp_path / "compiler-calls.log"
    warm = _child(path, cache, prompts, shims=_compiler_shims(tmp_path / "shims", log))
    assert warm["cache"] == "hit"
    assert warm["traces"] == 0 and warm["compiles"] == 0 and warm["loaded"] == 3
    assert warm["tokens"] == cold["tokens"] == [o.token_ids for o in eager]
    assert not log.exists(), log.read_text()


def test_corrupted_artifact_is_rebuilt(tiny, tmp_path, caplog) -> None:
    path, prompts = tiny
    cache = tmp_path / "cache"
    first = Runtime.load(path, optimization_level=1, cache_dir=cache)
    expected = [o.token_ids for o in first.generate(prompts, GREEDY)]
    artifact = next((first.cache_entry / "artifacts").iterdir())
    data = bytearray(artifact.read_bytes())
    data[len(data) // 2] ^= 0xFF
    artifact.write_bytes(bytes(data[: len(data) - 7]))
    with caplog.at_level("WARNING"):
        again = Runtime.load(path, optimization_level=1, cache_dir=cache)
    assert "corrupted" in caplog.text and artifact.name in caplog.text
    assert again.startup_report["compile_cache"] == "rebuilt"
    assert again.startup_report["inductor_compiles"] == 3
    assert [o.token_ids for o in again.generate(prompts, GREEDY)] == expected
    third = Runtime.load(path, optimization_level=1, cache_dir=cache)
    assert third.startup_report["compile_cache"] == "hit"


def _kiln_cli(args: list[str], env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "kiln.cli", *args], capture_output=True, text=True,
                          env=env, timeout=900)


@pytest.fixture(scope="module")
def bundle(tiny, tmp_path_factory):
    path, prompts = tiny
    out = tmp_path_factory.mktemp("bundles") / "b"
    proc = _kiln_cli(["compile", str(path), "--out", str(out), "-O1", "--include-weights"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "3 Inductor compilations" in proc.stderr
    manifest = json.loads((out / "kiln-bundle.json").read_text())
    assert manifest["model"]["includes_weights"] and manifest["compilation"]["level"] == 1
    return out


LOAD_BUNDLE = r"""
import json, sys
from kiln import Runtime, SamplingParams
rt = Runtime.load(sys.argv[1])
out = rt.generate(json.loads(sys.argv[2]), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
r = rt.startup_report
print(json.dumps({"tokens": [o.token_ids for o in out], "traces": r["dynamo_traces"],
                  "compiles": r["inductor_compiles"], "loaded": r["artifacts_loaded"], "cache": r["compile_cache"]}))
"""


def test_bundle_loads_after_a_move_and_from_a_read_only_mount(tiny, bundle, tmp_path) -> None:
    path, prompts = tiny
    expected = [o.token_ids for o in Runtime.load(path, optimization_level=0).generate(prompts, GREEDY)]
    moved = tmp_path / "moved"
    os.replace(bundle, moved)
    try:
        mount = tmp_path / "ro"
        mount.mkdir()
        log = tmp_path / "calls.log"
        shims = _compiler_shims(tmp_path / "shims", log)
        # a read-only bind mount in a private mount namespace: root ignores file modes
        script = (f'mount --bind -o ro "{moved}" "{mount}" && '
                  f'"{sys.executable}" -c \'{LOAD_BUNDLE}\' "{mount}" \'{json.dumps(prompts)}\'')
        env = {**os.environ, "PATH": f"{shims}{os.pathsep}{os.environ['PATH']}", "CC": str(shims / "gcc"),
               "CXX": str(shims / "g++"), "KILN_CACHE_DIR": str(tmp_path / "user-cache")}
        proc = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True,
                              env=env, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["cache"] == "bundle"
        assert result["traces"] == 0 and result["compiles"] == 0 and result["loaded"] == 3
        assert result["tokens"] == expected
        assert not log.exists(), log.read_text()
        assert not (tmp_path / "user-cache" / "compiled").exists()  # nothing compiled on the side
    finally:
        os.replace(moved, bundle)


def test_bundle_mismatch_names_each_factor(tiny, bundle, tmp_path) -> None:
    path, prompts = tiny
    from kiln.compiler.cached import FactorMismatchError

    with pytest.raises(FactorMismatchError) as err:
        Runtime.load(bundle, compile_sizes=[2], cache_dir=tmp_path)
    assert "compilation.compile_sizes: built with [], this runtime has [2]" in str(err.value)
    tampered = tmp_path / "tampered"
    import shutil

    shutil.copytree(bundle, tampered)
    m = json.loads((tampered / "compiled" / "manifest.json").read_text())
    m["factors"]["torch_version"] = "1.0.0"
    (tampered / "compiled" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FactorMismatchError, match=r"torch_version: built with '1\.0\.0', this runtime has"):
        Runtime.load(tampered, cache_dir=tmp_path)
    rt = Runtime.load(tampered, cache_dir=tmp_path / "user", on_mismatch="recompile")
    assert rt.startup_report["compile_cache"] == "miss" and rt.startup_report["inductor_compiles"] == 3


CONCURRENT = r"""
import json, sys
from kiln import Runtime, SamplingParams
rt = Runtime.load(sys.argv[1], optimization_level=1, cache_dir=sys.argv[2])
out = rt.generate(json.loads(sys.argv[3]), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
print(json.dumps({"tokens": [o.token_ids for o in out], "compiles": rt.startup_report["inductor_compiles"]}))
"""


def test_concurrent_cold_starts_compile_once(tiny, tmp_path) -> None:
    path, prompts = tiny
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
    assert results[0]["tokens"] == results[1]["tokens"] == results[2]["tokens"]


def test_cache_cli_lists_verifies_and_clears(tiny, tmp_path) -> None:
    path, prompts = tiny
    cache = tmp_path / "c"
    rt = Runtime.load(path, optimization_level=1, cache_dir=cache)
    env = {"KILN_CACHE_DIR": str(cache)}
    ls = _kiln_cli(["cache", "ls"], env)
    assert ls.returncode == 0 and rt.cache_entry.name in ls.stdout and "Qwen2ForCausalLM" in ls.stdout
    assert "-O1" in ls.stdout
    ok = _kiln_cli(["cache", "verify"], env)
    assert ok.returncode == 0 and f"{rt.cache_entry.name}  ok" in ok.stdout
    (rt.cache_entry / "graph.pkl").write_bytes(b"garbage")
    bad = _kiln_cli(["cache", "verify"], env)
    assert bad.returncode == 1 and "CORRUPT: graph.pkl" in bad.stdout
    cleared = _kiln_cli(["cache", "clear"], env)
    assert cleared.returncode == 0 and "removed 1" in cleared.stdout
    assert not rt.cache_entry.exists()
