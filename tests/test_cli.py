"""The command line and the demo model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from kiln.checkpoint.demo import ensure_random_model


def _kiln(args: list[str], cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "KILN_CACHE_DIR": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "kiln", *args], capture_output=True, text=True, env=env, timeout=600
    )


def test_generate_streams_demo_text_and_summary(demo_tokenizer_dir: Path) -> None:
    cache = demo_tokenizer_dir.parent.parent  # the session's cache dir already holds the demo
    args = ["generate", "--model", "random-demo", "--prompt", "Hello", "--max-tokens", "12", "--ignore-eos", "-v"]
    eager = _kiln([*args, "-O0"], cache)
    assert eager.returncode == 0, eager.stderr
    assert eager.stdout.strip()
    assert "kiln: 12 tokens" in eager.stderr and "tok/s" in eager.stderr and "startup" in eager.stderr
    report = json.loads(eager.stderr[eager.stderr.index("{\n") : eager.stderr.index("\n}\n") + 2])
    assert report["optimization_level"] == 0 and report["dynamo_traces"] == 0
    compiled = _kiln([*args, "-O1", "--compile-sizes", "1", "--cudagraph-mode", "PIECEWISE"], cache)
    assert compiled.returncode == 0, compiled.stderr
    report = json.loads(compiled.stderr[compiled.stderr.index("{\n") : compiled.stderr.index("\n}\n") + 2])
    assert report["optimization_level"] == 1 and report["dynamo_traces"] == 1
    assert report["compilation"]["compile_sizes"] == [1]
    assert report["cudagraph_mode"] == "NONE"  # resolved on CPU
    assert compiled.stdout == eager.stdout


def test_cli_error_is_one_clean_line(tmp_path: Path) -> None:
    proc = _kiln(["generate", "--model", str(tmp_path / "nope")], tmp_path)
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_demo_model_is_deterministic_and_reused(tmp_path: Path, demo_tokenizer_dir: Path) -> None:
    again = ensure_random_model(tmp_path)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (again / name).read_bytes() == (demo_tokenizer_dir / name).read_bytes(), name
    mtime = (again / "model.safetensors").stat().st_mtime_ns
    assert ensure_random_model(tmp_path) == again
    assert (again / "model.safetensors").stat().st_mtime_ns == mtime


def test_flags_are_checked_before_loading(tmp_path: Path) -> None:
    proc = _kiln(["generate", "--model", str(tmp_path / "nope"), "--max-tokens", "-1"], tmp_path)
    assert proc.returncode == 2
    assert "--max-tokens must be an integer >= 1, got -1" in proc.stderr
    assert "does not exist" not in proc.stderr and "Traceback" not in proc.stderr


def test_a_bad_config_value_is_one_line_naming_file_and_field(llama_checkpoint, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(llama_checkpoint[0], broken)
    cfg = json.loads((broken / "config.json").read_text())
    cfg["num_attention_heads"] = "four"
    (broken / "config.json").write_text(json.dumps(cfg))
    proc = _kiln(["generate", "--model", str(broken), "-O0"], tmp_path)
    assert proc.returncode == 2
    assert f"{broken / 'config.json'}: field 'num_attention_heads' must be an integer" in proc.stderr
    assert "Traceback" not in proc.stderr and "tokenizer" not in proc.stderr
