"""Serving while compiling: start eager, swap in the compiled pieces when a
background build finishes.

With ``compile="background"`` a compile-cache miss does not make anyone wait:
the engine starts at once on the eager model (the ``-O0`` path) and a
``BackgroundCompile`` runs the build in another process, at a lower CPU
priority, with the code ``kiln compile`` runs (``kiln.engine.loader.
build_compiled``), into the same automatic cache and under the same entry lock,
so that processes starting together on one empty cache build once. When the
process exits, a thread of this one imports what loading needs (Dynamo and
Inductor: seconds of imports that must not stall the engine), and at its next
step the engine loads the entry the build wrote (checked against its manifest:
a half-written entry is never loaded) and swaps the compiled pieces in
(``Engine.step``); requests in flight go on on the compiled pieces, their KV
cache untouched. The load itself runs on the engine's thread, between two
steps, because rebuilding the split graph runs an FX trace, which patches
``torch.nn.Module.__call__`` for the whole process while it runs. If the build fails or is
killed, the engine keeps serving eagerly; the failure is logged once and stays
in ``report()``.

With ``compile="eager-first"`` the engine starts eagerly even when the entry
exists (a bundle's, or the cache's): then there is no build, only the imports
in the thread and the load between two steps. A warm start so serves its first
token at the cost of reading the weights, where loading the compiled pieces
first costs seconds of Dynamo and Inductor imports before it
(bench/results/startup-cpu-*.json, ``eager_first``).

The build process runs ``python -m kiln.engine.background_compile SPEC``, where
SPEC is the JSON of the model path and the ``Runtime.load`` options; it prints
one JSON line with what it did.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kiln.compiler.parallel import end_with_parent
from kiln.quick_exit import exit_now

if TYPE_CHECKING:
    from kiln.compiler.cached import CompiledEntry
    from kiln.engine.runner import ModelRunner

__all__ = ["BackgroundCompile", "BuildSpec", "main", "share_cores"]

logger = logging.getLogger(__name__)

# How much nicer than the engine the build runs: the engine's steps come first.
BUILD_NICENESS = 10
_STDERR_TAIL = 4000
# Python's GIL switch interval while the loading thread imports (seconds; the default is 0.005)
IMPORT_SWITCH_INTERVAL = 0.0002
# How long the imports for an entry already built wait for the engine's first step (seconds)
FIRST_STEP_WAIT = 1.0


@dataclass(frozen=True)
class BuildSpec:
    """What the build process is asked to compile: the model and the load
    options (JSON values only), the entry it must produce, and where; the
    thread count its kernels are written for (the engine's after the swap:
    Inductor writes it into CPU kernels) and how many compile workers it runs."""

    model: str
    options: dict[str, Any]
    key: str  # the entry the parent expects; the build checks it computes the same
    cache_dir: Path
    threads: int
    workers: int | None  # None: one per core

    def argv(self) -> list[str]:
        spec = {"model": self.model, "options": self.options, "key": self.key, "cache_dir": str(self.cache_dir),
                "threads": self.threads}
        return [sys.executable, "-m", "kiln.engine.background_compile", json.dumps(spec)]

    def env(self) -> dict[str, str]:
        env = {**os.environ, "KILN_BACKGROUND_BUILD_PARENT": str(os.getpid())}
        if self.workers is not None:
            env["KILN_COMPILE_WORKERS"] = str(self.workers)
        return env


def share_cores(device_type: str) -> tuple[int, int, int | None]:
    """(the engine's torch threads, those it keeps while the build runs, the
    build's compile workers). On CPU they split the cores; on a GPU the engine
    keeps its threads and the build takes one worker per core."""
    threads = torch.get_num_threads()
    if device_type != "cpu":
        return threads, threads, None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    during = max(1, threads // 2)
    return threads, during, max(1, cores - during)


_switch_lock = threading.Lock()
_switch_users = 0
_switch_saved = 0.005


@contextlib.contextmanager
def _short_switch_interval() -> Iterator[None]:
    """IMPORT_SWITCH_INTERVAL while any loading thread of this process imports;
    the interval found before the first one afterwards."""
    global _switch_users, _switch_saved
    with _switch_lock:
        if _switch_users == 0:
            _switch_saved = sys.getswitchinterval()
            sys.setswitchinterval(IMPORT_SWITCH_INTERVAL)
        _switch_users += 1
    try:
        yield
    finally:
        with _switch_lock:
            _switch_users -= 1
            if _switch_users == 0:
                sys.setswitchinterval(_switch_saved)


class BackgroundCompile:
    """One background build, from its process's start to the swap; without a
    ``spec``, an entry that is already built, loaded the same way.

    ``state`` goes ``building`` -> ``loading`` (importing what loading needs)
    -> ``ready`` (the next step swaps) -> ``swapped``, or ends as ``failed``;
    an entry already built starts at ``loading``.
    ``load`` turns the finished build into the compiled entry (None when it is
    unusable), on the engine's thread; ``after_swap`` runs there right after the
    swap (CUDA graph capture). Seconds in ``report()`` count from ``t0``, the
    start of loading.

    While the build runs the engine steps with ``threads_while_building`` of
    its threads (``engine_threads``), the build's workers having the other
    cores: an OpenMP step whose threads share cores with the build stalls at
    every barrier (eager decode at 3.6 tok/s on 2 cores,
    bench/results/startup-cpu-20261201-082947.json; 11.6 tok/s on one core with
    the cores split, startup-cpu-20261201-091546.json)."""

    def __init__(self, spec: BuildSpec | None, load: Callable[[], "CompiledEntry | None"], *, t0: float,
                 threads_while_building: int, after_swap: Callable[["ModelRunner"], Any] | None = None,
                 found: str | None = None, needs_compiler: Callable[[], bool] = lambda: True) -> None:
        self.spec = spec
        self.found = found  # without a build: where the entry is ("hit": the cache, "bundle")
        # asked when the entry is there: whether its load imports Dynamo and
        # Inductor first (not when its artifacts replay without them, kiln.compiler.replay)
        self._needs_compiler = needs_compiler
        self.threads_while_building = threads_while_building
        self.threads = spec.threads if spec is not None else torch.get_num_threads()
        self.state = "building" if spec is not None else "loading"
        self.error: str | None = None
        self._load = load
        self._after_swap = after_swap
        self._t0 = t0
        self._in_use: "CompiledEntry | None" = None  # swapped in
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None
        self._result: dict[str, Any] = {}
        self._started = time.perf_counter()
        self._build_seconds: float | None = None
        self._swapped_at: float | None = None
        self._pause: float | None = None  # the swap's seconds between two steps
        self._stopped = False
        self._stepped = threading.Event()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "BackgroundCompile":
        """Start the build process, or without a build the loading thread. The
        process is started by the thread that then waits for it: Linux ends
        the build when the thread that started it ends (``PR_SET_PDEATHSIG``),
        and a loading thread ends early."""
        if self.spec is None:
            threading.Thread(target=self._load_after_first_step, name="kiln-background-load", daemon=True).start()
            return self
        started = threading.Event()
        threading.Thread(target=self._watch, args=(self.spec, started), name="kiln-background-compile",
                         daemon=True).start()
        started.wait()
        if self._proc is not None:
            logger.warning("compiling in the background (process %d); serving eagerly until the compiled pieces "
                           "are ready", self._proc.pid)
        return self

    def stop(self) -> None:
        """Kill the build (the engine keeps what it runs now)."""
        self._stopped = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _watch(self, spec: BuildSpec, started: threading.Event) -> None:
        try:
            proc = self._proc = subprocess.Popen(spec.argv(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                 text=True, env=spec.env(), start_new_session=True)
        except OSError as e:
            self._fail(f"the background build could not start: {e}", "")
            return
        finally:
            started.set()
        out, err = proc.communicate()
        self._build_seconds = round(time.perf_counter() - self._started, 3)
        if proc.returncode != 0:
            how = (f"was killed by signal {-proc.returncode}" if proc.returncode < 0
                   else f"exited with status {proc.returncode}")
            self._fail(f"the background build {how}", err)
            return
        try:
            self._result = json.loads(out.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            self._fail("the background build reported nothing", err)
            return
        with self._lock:
            self.state = "loading"
        self._prepare_load()

    def stepped(self) -> None:
        """The engine finished a step (its first tokens are out)."""
        self._stepped.set()

    def _load_after_first_step(self) -> None:
        """An entry already built: the imports wait for the engine's first step
        (or FIRST_STEP_WAIT seconds of an idle engine), so that the first
        tokens come at eager speed; steps taken during the imports are slower
        (the GIL, below)."""
        self._stepped.wait(FIRST_STEP_WAIT)
        self._prepare_load()

    def _prepare_load(self) -> None:
        """Dynamo and Inductor's imports, off the engine's thread; then the next
        step loads and swaps.

        An import holds the GIL, and the engine's thread gives it up at every
        torch op, then waits out Python's switch interval (5 ms) to get it back:
        an eager step of hundreds of ops stalls. A short interval while the
        imports run keeps the engine's pace (IMPORT_SWITCH_INTERVAL)."""
        if not self._needs_compiler():
            with self._lock:
                self.state = "ready"
            return
        try:
            with _short_switch_interval():
                from kiln.compiler.artifacts import warm_up

                warm_up()
        except Exception as e:  # noqa: BLE001  (the engine stays eager)
            self._fail(f"importing the compiler failed: {e}", "")
            return
        with self._lock:
            self.state = "ready"

    def _fail(self, message: str, stderr: str) -> None:
        with self._lock:
            self.state = "failed"
            self.error = message
        if self._stopped:
            return
        tail = stderr.strip()[-_STDERR_TAIL:]
        logger.warning("%s; serving goes on with the eager model%s", message, f":\n{tail}" if tail else "")

    # ------------------------------------------------------------------ the swap
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def pending(self) -> bool:
        """Not yet swapped in, and not failed."""
        return self.state in ("building", "loading", "ready")

    def engine_threads(self) -> int:
        """The torch threads the engine's steps use now: fewer while the build
        runs, all of them (those the kernels were built for) after it."""
        return self.threads_while_building if self.state in ("building", "loading") else self.threads

    def install(self, runner: "ModelRunner") -> None:
        """Load the entry and swap its compiled pieces into ``runner`` (between
        two steps, on the thread that steps the engine); on failure stay eager."""
        t0 = time.perf_counter()
        try:
            entry = self._load()
        except Exception as e:  # noqa: BLE001  (any failure leaves the engine eager)
            logger.debug("loading the background build failed", exc_info=True)
            self._fail(f"{self._entry_name()} could not be loaded: {e}", "")
            return
        if entry is None:
            self._fail(f"{self._entry_name()} is missing or damaged", "")
            return
        # the C kernel's layouts (AMX tiles, fp32 panels) before the first step that can use them
        # (oneDNN's copies follow in a thread): a step on the weights as they are would round
        # some outputs otherwise
        entry.model.reorder_weights(runner.max_num_seqs)
        runner.use_compiled(entry.model)
        if self._after_swap is not None:
            self._after_swap(runner)
        with self._lock:
            self._in_use = entry
            self._swapped_at = round(time.perf_counter() - self._t0, 3)
            self._pause = round(time.perf_counter() - t0, 3)
            self.state = "swapped"
        if self.spec is None:
            logger.info("compiled pieces (%s) swapped in %.1fs after the start (%.2fs between two steps)",
                        self.found, self._swapped_at, self._pause)
            return
        logger.warning("compiled pieces swapped in %.1fs after the start (build %.1fs, %.2fs between two steps)",
                       self._swapped_at, self._build_seconds or 0.0, self._pause)

    def _entry_name(self) -> str:
        return "the background build's entry" if self.spec is not None else f"the compiled entry ({self.found})"

    @property
    def entry(self) -> "CompiledEntry | None":
        """The compiled entry in use, once swapped in."""
        return self._in_use

    def report(self) -> dict[str, Any]:
        """What the build did so far: state, process, seconds, the build's cache state."""
        with self._lock:
            return {
                "state": self.state,
                "pid": self.pid,
                "started_at_seconds": round(self._started - self._t0, 3),
                "build_seconds": self._build_seconds,
                "swapped_at_seconds": self._swapped_at,
                "swap_pause_seconds": self._pause,
                "execution_before": "eager",
                "execution_after": "compiled" if self.state == "swapped" else None,
                "build_cache": self._result.get("compile_cache") if self.spec is not None else self.found,
                "inductor_compiles": self._result.get("inductor_compiles"),
                "error": self.error,
            }


# ---------------------------------------------------------------------- the build process
def main(argv: list[str] | None = None) -> int:
    """Build the entry SPEC names, at a lower priority, into the cache."""
    args = sys.argv[1:] if argv is None else argv
    spec = json.loads(args[0])
    parent = os.environ.get("KILN_BACKGROUND_BUILD_PARENT")
    if parent:
        end_with_parent(int(parent))  # a build nobody will load only takes CPU
    os.nice(BUILD_NICENESS)
    torch.set_num_threads(spec["threads"])  # what the kernels are written for: the engine's after the swap
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from kiln.engine.loader import build_compiled

    record, report = build_compiled(spec["model"], Path(spec["cache_dir"]), **spec["options"])
    if record.entry.name != spec["key"]:
        print(f"kiln: the background build made entry {record.entry.name}, the engine expects {spec['key']}",
              file=sys.stderr)
        return 1
    print(json.dumps({"key": record.entry.name, **{k: report[k] for k in ("compile_cache", "inductor_compiles")},
                      "phases": report["phases"]}))
    return 0


if __name__ == "__main__":
    exit_now(main())  # the engine waits for this process to end before it loads the entry
