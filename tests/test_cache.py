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
        env["PATH"] = f"{shims}{os.pathsep}{env['PATH']}"
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path), str(cache), json.dumps(prompts)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _compiler_shims(where: Path, log: Path) -> Path:
    """gcc/g++/cc/c++ on PATH that log every call and pass through to the real ones."""
    where.mkdir()
    for name in ("gcc", "g++", "cc", "c++"):
        real = next((Path(d) / name for d in os.environ["PATH"].split(os.pathsep) if (Path(d) / name).is_file()), None)
        if real is None:
            continue
        shim = where / name
        shim.write_text(f'#!/bin/sh\necho "{name} $*" >> "{log}"\nexec "{real}" "$@"\n')
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
    # Inductor may ask the compiler for its version (it is part of kernel keys);
    # it must not build anything.
    calls = log.read_text().splitlines() if log.exists() else []
    builds = [c for c in calls if not c.split(" ", 1)[-1].strip() in ("--version", "-v")]
    assert builds == []


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
