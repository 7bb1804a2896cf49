"""The command line and the demo model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from kiln.checkpoint.demo import ensure_random_model
from kiln.engine.structured import JsonAutomaton, structured_shape


def _kiln(args: list[str], cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "KILN_CACHE_DIR": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "kiln", *args], capture_output=True, text=True, env=env, timeout=600
    )


def test_generate_streams_demo_text_and_summary(demo_tokenizer_dir: Path) -> None:
    cache = demo_tokenizer_dir.parent.parent  # the session's cache dir already holds the demo
    args = ["generate", "--model", "random-demo", "--prompt", "Hello", "--max-tokens", "12", "--ignore-eos", "-v"]
    eager = _kiln([*args, "-O0", "--kv-cache-memory", "6MiB", "--block-size", "8"], cache)
    assert eager.returncode == 0, eager.stderr
    assert eager.stdout.strip()
    assert "kiln: 12 tokens" in eager.stderr and "tok/s" in eager.stderr and "startup" in eager.stderr
    report = json.loads(eager.stderr[eager.stderr.index("{\n") : eager.stderr.index("\n}\n") + 2])
    assert report["optimization_level"] == 0 and report["dynamo_traces"] == 0
    assert report["config"]["block_size"] == 8 and report["kv_cache_bytes"] <= 6 << 20
    compiled = _kiln([*args, "-O1", "--compile-sizes", "1", "--cudagraph-mode", "PIECEWISE",
                      "--speculative-config", '{"num_speculative_tokens": 3, "prompt_lookup_min": 1}'], cache)
    assert compiled.returncode == 0, compiled.stderr
    report = json.loads(compiled.stderr[compiled.stderr.index("{\n") : compiled.stderr.index("\n}\n") + 2])
    assert report["optimization_level"] == 1 and report["dynamo_traces"] == 1
    assert report["compilation"]["compile_sizes"] == [1]
    assert report["cudagraph_mode"] == "NONE"  # resolved on CPU
    assert report["speculative_config"]["num_speculative_tokens"] == 3
    assert compiled.stdout == eager.stdout  # speculation keeps greedy tokens


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
    proc = _kiln(["generate", "--model", str(tmp_path / "nope"), "--presence-penalty", "3"], tmp_path)
    assert proc.returncode == 2 and "--presence-penalty must be in [-2, 2] (0 disables it), got 3.0" in proc.stderr
    (tmp_path / "odd.json").write_text('{"type": "object", "not": {}}')
    proc = _kiln(["generate", "--model", str(tmp_path / "nope"), "--json-schema", str(tmp_path / "odd.json")],
                 tmp_path)
    assert proc.returncode == 2 and "--json-schema: schema.not is not supported" in proc.stderr
    proc = _kiln(["generate", "--model", str(tmp_path / "nope"), "--json-schema", str(tmp_path / "none.json")],
                 tmp_path)
    assert proc.returncode == 2 and f"--json-schema: cannot read {tmp_path / 'none.json'}" in proc.stderr


def test_generate_json_keeps_the_answer_to_an_object(demo_tokenizer_dir: Path) -> None:
    cache = demo_tokenizer_dir.parent.parent
    proc = _kiln(["generate", "--model", "random-demo", "-O0", "--chat", "--prompt", "JSON please", "--json",
                  "--max-tokens", "24"], cache)
    assert proc.returncode == 0, proc.stderr
    state = JsonAutomaton(structured_shape("json_object"))
    assert state.feed(proc.stdout.removesuffix("\n").encode("utf-8")), proc.stdout


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


class _Terminal:
    """What the child wrote to its terminal, read up to one marker at a time:
    what arrived past the marker (the next prompt, say) stays for the next read."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pending = b""

    def read_until(self, needle: bytes, timeout: float) -> bytes:
        import select

        deadline = time.monotonic() + timeout
        while needle not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                raise AssertionError(f"{needle!r} not seen within {timeout}s; got {self.pending[-500:]!r}")
            try:
                chunk = os.read(self.fd, 4096)
            except OSError:  # the child closed the terminal
                break
            self.pending += chunk
        head, _, self.pending = self.pending.partition(needle)
        return head + needle

    def read_bytes(self, count: int, timeout: float) -> bytes:
        """At least ``count`` bytes more than are pending already, all of them taken."""
        import select

        deadline = time.monotonic() + timeout
        while len(self.pending) < count:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                raise AssertionError(f"{count} bytes not seen within {timeout}s; got {self.pending[-500:]!r}")
            self.pending += os.read(self.fd, 4096)
        got, self.pending = self.pending, b""
        return got


def _controlling_terminal() -> None:
    """In the child: a new session whose controlling terminal is its stdin, so
    that Ctrl-C typed there is a SIGINT, as in a shell; and SIGINT's default
    action, as a shell gives a job it runs in the foreground. (pytest started
    in the background by a shell without job control ignores SIGINT, and a
    child inherits that: Ctrl-C then stopped nothing.)"""
    import fcntl
    import signal
    import termios

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def test_chat_on_a_terminal_ctrl_c_stops_the_answer_not_the_repl(demo_tokenizer_dir: Path, tmp_path: Path) -> None:
    import pty

    main, child = pty.openpty()
    env = {**os.environ, "KILN_CACHE_DIR": str(demo_tokenizer_dir.parent.parent)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln", "chat", "--model", "random-demo", "-O0", "--max-tokens", "2000",
         "--ignore-eos", "--temperature", "0.8", "--seed", "1"],
        stdin=child, stdout=child, stderr=child, env=env, preexec_fn=_controlling_terminal,
    )
    os.close(child)
    terminal = _Terminal(main)
    try:
        terminal.read_until(b"> ", 300)
        os.write(main, b"hello there\n")
        terminal.read_until(b"hello there", 60)  # the terminal's echo
        # Ctrl-C once the answer streams: it runs to the 1024-token context, a
        # second or less at -O0 on a fast machine, so a fixed wait could miss it
        # (it did, once: the answer had ended and no "[stopped]" came)
        terminal.read_bytes(20, 120)
        os.write(main, b"\x03")  # Ctrl-C, delivered by the terminal as SIGINT
        terminal.read_until(b"[stopped]", 60)
        terminal.read_until(b"> ", 60)  # the REPL is still there
        os.write(main, b"/exit\n")
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(main)


def test_serve_checks_its_options_before_listening(tmp_path: Path) -> None:
    proc = _kiln(["serve", "random-demo", "--max-num-seqs", "0", "--port", "1"], tmp_path)
    assert proc.returncode == 2 and "max_num_seqs must be a positive integer, got 0" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = _kiln(["serve", "random-demo", "--gpu-memory-utilization", "2", "--port", "1"], tmp_path)
    assert proc.returncode == 2 and "gpu_memory_utilization must be in (0, 1], got 2.0" in proc.stderr
    proc = _kiln(["serve", "random-demo", "--kv-cache-memory", "lots", "--port", "1"], tmp_path)
    assert proc.returncode == 2 and "'lots' is not a size" in proc.stderr
    proc = _kiln(["serve", "random-demo", "--enable-auto-tool-choice", "--port", "1"], tmp_path)
    assert proc.returncode == 2 and "--enable-auto-tool-choice needs --tool-call-parser" in proc.stderr
    proc = _kiln(["serve", "random-demo", "--chat-template", str(tmp_path / "none.jinja"), "--port", "1"], tmp_path)
    assert proc.returncode == 2 and f"--chat-template: {tmp_path / 'none.jinja'} is not a file" in proc.stderr
    proc = _kiln(["generate", "--model", str(tmp_path / "nope"), "--chat", "--chat-template", "x.j"], tmp_path)
    assert proc.returncode == 2 and "--chat-template: x.j is not a file" in proc.stderr
