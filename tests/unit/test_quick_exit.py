"""``kiln compile`` and a background build end their process without the
interpreter's teardown (``kiln.quick_exit.exit_now``): what a normal exit would
still do that anyone can see (exit handlers, buffered output) must happen all
the same."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import atexit, sys
from kiln.quick_exit import exit_now
atexit.register(lambda: print("handler ran"))
print("buffered", end="")
sys.stderr.write("err")
exit_now(3)
print("never")
"""


def test_exit_now_runs_exit_handlers_and_flushes_output() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3
    assert proc.stdout.startswith("buffered")
    assert proc.stdout.rstrip().endswith("handler ran")
    assert "never" not in proc.stdout
    assert proc.stderr.endswith("err")


def test_only_commands_with_nothing_left_to_do_end_the_process() -> None:
    from kiln.entrypoints import cli

    assert cli._DONE_WHEN_RETURNED <= set(cli.COMMANDS)
    assert "serve" not in cli._DONE_WHEN_RETURNED and "chat" not in cli._DONE_WHEN_RETURNED
