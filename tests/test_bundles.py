"""Bundles written by ``kiln compile``: relocatable, read-only, and warm on a
fresh machine with no compiler."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from kiln import Runtime
from kiln.checkpoint import CheckpointError
from kiln.compiler.cached import FactorMismatchError
from tests.conftest import fresh_env, kiln_cli, run_child
from tests.test_cache import COMPILES


@pytest.fixture(scope="module", params=[1, 2])
def bundle(request, tiny, tmp_path_factory):
    path, _, _ = tiny
    level = request.param
    out = tmp_path_factory.mktemp(f"bundles-O{level}") / "b"
    proc = kiln_cli(["compile", str(path), "--out", str(out), f"-O{level}", "--include-weights"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{COMPILES[level]} Inductor compilations" in proc.stderr
    manifest = json.loads((out / "kiln-bundle.json").read_text())
    assert manifest["model"]["includes_weights"] and manifest["compilation"]["level"] == level
    return level, out


def test_bundle_loads_after_a_move_from_a_read_only_mount_on_a_fresh_machine(tiny, bundle, tmp_path) -> None:
    path, prompts, expected = tiny
    level, built = bundle
    moved = tmp_path / "moved"
    os.replace(built, moved)
    try:
        log = tmp_path / "compiler-calls.log"
        user_cache = tmp_path / "user-cache"
        env = fresh_env(tmp_path / "machine", failing_compilers_log=log, KILN_CACHE_DIR=str(user_cache))
        result = run_child(tmp_path / "ro", {}, prompts, env=env, read_only=(moved, tmp_path / "ro"))
        assert result["compile_cache"] == "bundle"
        assert result["dynamo_traces"] == 0 and result["inductor_compiles"] == 0
        assert result["artifacts_loaded"] == COMPILES[level]
        assert result["attention_kernel"] is not None  # the C decode kernel travelled in the bundle
        assert result["artifact_loader"] == "replay" and result["compiler_imported"] == []
        assert result["tokens"] == expected
        assert not log.exists(), log.read_text()
        assert not (user_cache / "compiled").exists()  # nothing compiled on the side
    finally:
        os.replace(moved, built)


EAGER_FIRST_CHILD = r"""
import json, sys, time
from kiln import Runtime, SamplingParams
rt = Runtime.load(sys.argv[1], compile="eager-first")
report = rt.startup_report
params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
first = [o.token_ids for o in rt.generate(json.loads(sys.argv[2]), params)]
deadline = time.monotonic() + 300
while rt.startup_report["background_compile"]["state"] not in ("ready", "swapped", "failed"):
    assert time.monotonic() < deadline
    time.sleep(0.1)
after = [o.token_ids for o in rt.generate(json.loads(sys.argv[2]), params)]
print(json.dumps({"execution": report["execution"], "phases": report["phases"], "first": first, "after": after,
                  "build": rt.startup_report["background_compile"], "execution_after": rt.stats().execution,
                  "artifacts_loaded": rt.compiled.stats.artifacts_loaded if rt.compiled else 0}))
"""


@pytest.mark.parametrize("bundle", [2], indirect=True)
def test_eager_first_serves_a_bundle_at_once_and_swaps_its_pieces_in(tiny, bundle, tmp_path) -> None:
    """A warm start that waits for nothing: eager tokens from the first step, the
    bundle's pieces loaded (no compiler on the machine) and swapped in after."""
    path, prompts, expected = tiny
    level, built = bundle
    log = tmp_path / "compiler-calls.log"
    env = fresh_env(tmp_path / "machine", failing_compilers_log=log, KILN_CACHE_DIR=str(tmp_path / "user-cache"))
    proc = subprocess.run([sys.executable, "-c", EAGER_FIRST_CHILD, str(built), json.dumps(prompts)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["execution"] == "eager" and "import_compiler" not in r["phases"]
    assert r["first"] == expected and r["after"] == expected
    assert r["build"]["state"] == "swapped" and r["build"]["build_cache"] == "bundle"
    assert r["execution_after"] == "compiled" and r["artifacts_loaded"] == COMPILES[level]
    assert not log.exists(), log.read_text()
    assert not (tmp_path / "user-cache" / "compiled").exists()


@pytest.mark.parametrize("bundle", [1], indirect=True)
def test_bundle_mismatch_names_each_factor(bundle, tmp_path) -> None:
    level, built = bundle
    with pytest.raises(FactorMismatchError) as err:
        Runtime.load(built, compile_sizes=[2], cache_dir=tmp_path)
    assert "compilation.compile_sizes: built with [], this runtime has [2]" in str(err.value)
    tampered = tmp_path / "tampered"
    shutil.copytree(built, tampered)
    m = json.loads((tampered / "compiled" / "manifest.json").read_text())
    m["factors"]["torch_version"] = "1.0.0"
    (tampered / "compiled" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FactorMismatchError, match=r"torch_version: built with '1\.0\.0', this runtime has"):
        Runtime.load(tampered, cache_dir=tmp_path)
    with pytest.raises(FactorMismatchError, match="torch_version"):  # before it serves anything
        Runtime.load(tampered, cache_dir=tmp_path, compile="eager-first")
    rt = Runtime.load(tampered, cache_dir=tmp_path / "user", on_mismatch="recompile")
    assert rt.startup_report["compile_cache"] == "miss" and rt.startup_report["inductor_compiles"] == 3


def test_a_gguf_compiles_into_a_bundle_with_or_without_the_file(tmp_path) -> None:
    """``kiln compile x.gguf``: with --include-weights the file travels in the
    bundle; without, the bundle finds it where it was built, or at weights_path."""
    from kiln import SamplingParams
    from tests.conftest import build_hf_model, random_prompts
    from tests.unit.test_gguf import hf_to_gguf, write_gguf

    model = build_hf_model("qwen3", seed=5, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                           num_key_value_heads=1)
    meta, tensors = hf_to_gguf(model, "qwen3")
    (tmp_path / "src").mkdir()
    source = write_gguf(tmp_path / "src" / "tiny.gguf", "qwen3", meta, tensors)
    prompts = random_prompts(2, [4, 11], model.config.vocab_size, seed=3)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in Runtime.load(source, optimization_level=0).generate(prompts, greedy)]
    for include in (True, False):
        out = tmp_path / f"bundle-{include}"
        args = ["compile", str(source), "--out", str(out), "-O1"] + (["--include-weights"] if include else [])
        proc = kiln_cli(args)
        assert proc.returncode == 0, proc.stderr[-3000:]
        manifest = json.loads((out / "kiln-bundle.json").read_text())
        assert manifest["model"]["format"] == "gguf" and manifest["model"]["file"] == "tiny.gguf"
        assert (out / "model" / "tiny.gguf").is_file() == include
        rt = Runtime.load(out, cache_dir=tmp_path / "cache")
        assert rt.startup_report["compile_cache"] == "bundle"
        assert [o.token_ids for o in rt.generate(prompts, greedy)] == expected
    moved = tmp_path / "elsewhere"
    shutil.move(str(tmp_path / "src"), moved)
    with pytest.raises(CheckpointError, match="built without weights and none were found"):
        Runtime.load(tmp_path / "bundle-False", cache_dir=tmp_path / "cache")
    rt = Runtime.load(tmp_path / "bundle-False", cache_dir=tmp_path / "cache", weights_path=moved)
    assert [o.token_ids for o in rt.generate(prompts, greedy)] == expected


def test_a_bad_gguf_leaves_nothing_in_the_cache(tmp_path) -> None:
    """A file that fails to load fails before anything is compiled or cached."""
    from tests.unit.test_gguf import hf_to_gguf, write_gguf
    from tests.conftest import build_hf_model

    model = build_hf_model("llama", hidden_size=32, intermediate_size=64, num_attention_heads=2,
                           num_key_value_heads=1)
    meta, tensors = hf_to_gguf(model, "llama")
    good = write_gguf(tmp_path / "good.gguf", "llama", meta, tensors)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    unknown = tmp_path / "unknown.gguf"
    write_gguf(unknown, "llama", {**meta, "general.architecture": "gpt2"}, tensors)
    for bad, needle in ((truncated, "truncated"), (unknown, "gpt2")):
        cache = tmp_path / f"cache-{bad.stem}"
        with pytest.raises(CheckpointError, match=needle) as err:
            Runtime.load(bad, optimization_level=1, cache_dir=cache)
        assert bad.name in str(err.value)
        assert not (cache / "compiled").exists() or not any((cache / "compiled").iterdir())
