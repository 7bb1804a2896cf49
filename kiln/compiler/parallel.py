"""Running a model's Inductor compilations side by side, in forked workers.

A cold compile is a list of independent jobs (each unique piece for the range
and for every exact size, and the CPU LM heads), and nearly all of a job's time
is one single-threaded C++ build, so jobs run one per core. The workers are
forks of the compiling process, made after the trace and the recording of
example inputs: they inherit the graphs, their metadata and the inputs as they
are, with nothing to serialise or trace again (threads or a spawned pool would
need one or the other; Inductor is not thread-safe). The caller turns off
Inductor's own build threads first: a fork has none of them. Each worker takes the next
job from a shared pipe, compiles it and saves the artifact to a scratch
directory; the parent compiles too, then loads the workers' artifacts (their
kernel libraries are in the shared Inductor cache by then, so a load is quick).
A job whose worker failed is compiled again by the parent. Where ``fork`` is
not available, or one worker is all there is, the jobs run one after another.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import struct
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import fx

__all__ = ["CompileJob", "compile_workers", "end_with_parent", "run_jobs"]

logger = logging.getLogger(__name__)

_INDEX = struct.Struct("<I")
MAX_WORKERS = 8


@dataclass(frozen=True)
class CompileJob:
    label: str  # "piece 1 [4]": what the progress bar and the startup report call it
    graph: fx.GraphModule
    inputs: list[Any]
    dynamic: bool  # the symbolic range rather than the exact sizes of ``inputs``


def end_with_parent(parent: int) -> None:
    """Ask Linux to end this process (SIGTERM) when the thread that started it
    ends, so that no orphan goes on compiling for nobody; ``parent`` is the pid
    that started it, to catch a parent that ended before the request. Elsewhere
    than Linux, nothing happens."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(1)


def compile_workers(jobs: int) -> int:
    """How many processes compile at once: one per usable core (the
    ``KILN_COMPILE_WORKERS`` environment variable overrides it), at most
    ``MAX_WORKERS`` and never more than there are jobs."""
    env = os.environ.get("KILN_COMPILE_WORKERS")
    if env:
        try:
            wanted = int(env)
        except ValueError:
            raise ValueError(f"KILN_COMPILE_WORKERS must be a whole number, got {env!r}") from None
    else:
        wanted = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    can_fork = sys.platform.startswith("linux")
    return max(1, min(wanted if can_fork else 1, MAX_WORKERS, jobs))


Compile = Callable[[CompileJob], Any]  # a job -> its CompiledArtifact


def run_jobs(jobs: list[CompileJob], compile_: Compile, workers: int, scratch: Path,
             done: Callable[[CompileJob, float], None]) -> list[Any]:
    """Every job's compiled artifact, in job order. ``done(job, seconds)`` is
    called in this process as jobs finish (in any order)."""
    if workers <= 1:
        return [_timed(compile_, job, done) for job in jobs]
    read_end, write_end = os.pipe()
    os.write(write_end, b"".join(_INDEX.pack(i) for i in range(len(jobs))))
    os.close(write_end)
    live = [_fork_worker(jobs, compile_, read_end, scratch) for _ in range(workers - 1)]
    results: dict[int, Any] = {}
    reported: set[int] = set()
    try:
        while (i := _next(read_end)) is not None:
            results[i] = _timed(compile_, jobs[i], done)
            reported.add(i)
            _report_finished(jobs, scratch, reported, done)
        failed = _wait(live)
    finally:
        os.close(read_end)
        for pid in live:  # left only when this process is unwinding an error
            _kill(pid)
    _report_finished(jobs, scratch, reported, done)
    for i, job in enumerate(jobs):
        if i in results:
            continue
        path = scratch / f"job-{i}.bin"
        if path.is_file():
            results[i] = SavedArtifact(path)
        else:
            logger.warning("a compile worker did not finish %s (%s); compiling it here", job.label, failed)
            results[i] = _timed(compile_, job, done)
    return [results[i] for i in range(len(jobs))]


class SavedArtifact:
    """A worker's artifact, loaded from the file it saved: callable like the
    ``CompiledArtifact`` it wraps, and saved again by copying that file (a loaded
    ``CompiledArtifact`` keeps no bytes to save)."""

    def __init__(self, path: Path) -> None:
        self.data = path.read_bytes()
        self._fn = torch._inductor.CompiledArtifact.load(path=str(path), format="binary")

    def __call__(self, *args: Any) -> Any:
        return self._fn(*args)

    def save(self, *, path: str, format: str = "binary") -> None:
        if format != "binary":
            raise ValueError(f"a worker's artifact is saved in the binary format only, not {format!r}")
        from kiln.cache.store import atomic_write_bytes

        atomic_write_bytes(Path(path), self.data)


def _timed(compile_: Compile, job: CompileJob, done: Callable[[CompileJob, float], None]) -> Any:
    t0 = time.perf_counter()
    artifact = compile_(job)
    done(job, time.perf_counter() - t0)
    return artifact


def _next(read_end: int) -> int | None:
    data = os.read(read_end, _INDEX.size)  # whole records only: every write and read is one record wide
    return _INDEX.unpack(data)[0] if data else None


def _fork_worker(jobs: list[CompileJob], compile_: Compile, read_end: int, scratch: Path) -> int:
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    status = 1
    try:  # the worker: compile and save until the queue is empty, then leave without cleanup
        end_with_parent(parent)
        # (its thread count stays the parent's: Inductor writes it into the C++ kernels)
        while (i := _next(read_end)) is not None:
            t0 = time.perf_counter()
            compile_(jobs[i]).save(path=str(scratch / f"job-{i}.bin"), format="binary")
            tmp = scratch / f".job-{i}.json"
            tmp.write_text(json.dumps({"seconds": time.perf_counter() - t0}))
            tmp.rename(scratch / f"job-{i}.json")
        status = 0
    except BaseException:  # noqa: BLE001  (reported by the parent, which compiles the job itself)
        traceback.print_exc()
    finally:
        os._exit(status)


def _report_finished(jobs: list[CompileJob], scratch: Path, reported: set[int],
                     done: Callable[[CompileJob, float], None]) -> None:
    """Call ``done`` for the workers' jobs that finished since the last look."""
    for path in scratch.glob("job-*.json"):
        i = int(path.stem.removeprefix("job-"))
        if i not in reported:
            reported.add(i)
            done(jobs[i], json.loads(path.read_text())["seconds"])


def _wait(live: list[int]) -> str:
    """Wait for every worker (emptying ``live``); what went wrong with the ones
    that failed."""
    problems = []
    while live:
        pid = live[0]
        _, status = os.waitpid(pid, 0)
        live.pop(0)
        if status:
            problems.append(f"worker {pid} ended with status {status}")
    return "; ".join(problems) or "no error reported"


def _kill(pid: int) -> None:
    try:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
