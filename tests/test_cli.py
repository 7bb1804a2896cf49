"""The command line and the demo model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kiln.demo import ensure_demo_model


def _kiln(args: list[str], cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "KILN_CACHE_DIR": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "kiln.cli", *args], capture_output=True, text=True, env=env, timeout=600
    )


def test_generate_streams_demo_text_and_summary(demo_tokenizer_dir: Path) -> None:
    cache = demo_tokenizer_dir.parent.parent  # the session's cache dir already holds the demo
    proc = _kiln(["generate", "--prompt", "Hello", "--max-tokens", "12", "--ignore-eos", "-v"], cache)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "kiln: 12 tokens" in proc.stderr and "tok/s" in proc.stderr and "startup" in proc.stderr
    report = json.loads(proc.stderr[proc.stderr.index("{") : proc.stderr.index("}\n") + 1])
    assert report["optimization_level"] == 0 and report["dynamo_traces"] == 0


def test_cli_error_is_one_clean_line(tmp_path: Path) -> None:
    proc = _kiln(["generate", "--model", str(tmp_path / "nope")], tmp_path)
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_demo_model_is_deterministic_and_reused(tmp_path: Path, demo_tokenizer_dir: Path) -> None:
    again = ensure_demo_model(tmp_path)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (again / name).read_bytes() == (demo_tokenizer_dir / name).read_bytes(), name
    mtime = (again / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model(tmp_path) == again
    assert (again / "model.safetensors").stat().st_mtime_ns == mtime
