"""Ending a process whose work is done without the interpreter's teardown.

With torch, Dynamo and Inductor loaded, Python's teardown (freeing every module's
objects one by one, after the exit handlers) took 2.4 s here after a compile had
finished: 5% of a cold ``kiln compile``, and the same delay between a background
build's end and the engine's swap, which waits for the build process to exit."""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn

__all__ = ["exit_now"]


def exit_now(code: int) -> NoReturn:
    """End the process with ``code`` after its exit handlers (logging's flush,
    temporary directories' removal) and a flush of stdout and stderr. For a
    process with nothing left to do: other threads are not waited for."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a broken pipe: nothing more can be said
            pass
    os._exit(code)
