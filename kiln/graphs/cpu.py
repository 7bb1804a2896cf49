"""CPU call graphs: a decode step's native calls recorded once, replayed after.

A CPU decode step of a compiled model is a chain of native calls (Inductor's C++
kernels, kiln's C linear and decode-attention kernels) held together by Python:
the split graph's forward, each piece's output code with its buffer
allocations, the attention backend's checks and argument conversion. At one
token of the 135M shape in bf16, 121 linear calls took 7.8 ms of an 11 ms step
and everything else 3-4 ms; the same Python took 1.6 ms with the linears cut
to one output column: the weights streamed through the caches evict the
interpreter's data between calls (scratch timings).

What a CUDA graph does for kernel launches this does for that Python: the
first run of a batch shape (the capture) records every native call with its
arguments; a replay makes the same calls with the same arguments, the buffers
of the capture standing in as fixed intermediate memory. Inputs that change per
step sit at fixed addresses (the runner's persistent input buffers; the decode
kernel's per-step arguments in one structure the attention backend rewrites
each step), so a replay computes the new step. The demo model in bf16 at one
request, one process taking turns with and without: the forward 8.6-9.4 ->
7.5-8.7 ms, the same tokens; against llama.cpp, bf16 decode went from 0.88x to
1.07x (bench/results/llama-cpp-cpu-20261203-210234.json).

A call is recorded only where it goes through a *site*: an attribute or a
namespace entry holding a native function, which ``capture`` swaps for a
recording wrapper while the capture runs (the compiled model lists its sites,
``CompiledModel.native_sites``). Work that goes through no site would be left
out of the replay, so the capture runs under a dispatch mode that refuses
every torch operator but allocations and views (``NotCapturable``): a compiled
model whose step does any other work at that shape is not captured there, and
keeps running uncaptured.

The buffers a capture allocates come from one arena every graph of a
runner shares (``CaptureArena``, the runner's pool), each capture carving
from its start: CPU graphs are whole decode steps (``kiln.config``'s CPU
modes), one at a time, and a step's buffers hold nothing the next step
reads, so the graphs of every size need the memory of the largest, not the
sum. The demo model in bf16, one run whose steps had 64, 48, 32, 16, 8
and 4 requests: its graphs' buffers came to 83.6 MB (about 0.49 MB a row),
which each graph had kept for itself; the shared arena holds 33.6 MB, the
largest graph's rounded up to whole chunks, and the process's resident
memory after the run was 1034 MB against 1078 (scratch, the same tokens).

A replay makes its calls from C where it can (``NativeReplay``, the loop
``kiln_replay`` of the C linear kernel's library): each recorded function is
then a C function known by its address (``kiln.native.c_function``) and each
argument an integer, tensors as their data addresses, which the capture fixed.
The demo model's decode step is 271 calls; one process taking turns between
the two loops, the same tokens (scratch A/B, 2 cores of an AMD EPYC): Q8_0
3.81 -> 3.55 ms a step, bf16 5.92 -> 5.68 ms.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from kiln.native import c_function

__all__ = ["CallGraph", "CaptureArena", "CpuCallGraphs", "NativeReplay", "NativeSite", "NotCapturable", "ReplayError"]

logger = logging.getLogger(__name__)

# A site: (holder, name), where ``holder[name]`` (a dict: a module namespace) or
# ``getattr(holder, name)`` (an object) is a native function.
NativeSite = tuple[Any, str]

# Operators a capture allows besides views: they allocate and compute nothing.
_ALLOCATIONS = frozenset({
    "aten::empty.memory_format", "aten::empty_strided", "aten::empty_like", "aten::new_empty",
    "aten::new_empty_strided",
})


class NotCapturable(RuntimeError):
    """The step did work at capture that a replay would leave out."""


class ReplayError(RuntimeError):
    """A replayed call returned other than at its capture."""


@dataclass
class CallGraph:
    """The recorded calls of one capture: (function, arguments, the return
    code it gave: an int, else None for "not checked"), in order, and the
    tensors the capture allocated outside them (kept, since a call may hold
    only their addresses); ``nbytes``: what it carved from its arena (0
    without one)."""

    calls: tuple[tuple[Callable[..., Any], tuple[Any, ...], Any], ...]
    kept: list[torch.Tensor] = field(default_factory=list)
    native: _NativeCalls | None = None  # the calls as ``NativeReplay.prepare`` made them; None: from Python
    nbytes: int = 0


class CaptureArena:
    """The memory the CPU call graphs of one runner carve their buffers from
    (the module docstring says why they may share it): a list of chunks,
    each capture starting at the first and taking the next allocation where
    it fits, in order, a chunk added where none is left. Graphs that ran
    within one step (pieces of a step) must not share one: CPU graphs are
    whole steps only."""

    CHUNK_BYTES = 8 << 20
    ALIGN = 64  # what torch's CPU allocator gives; the C kernels' vector loads expect no less

    def __init__(self) -> None:
        self.chunks: list[torch.Tensor] = []

    @property
    def nbytes(self) -> int:
        return sum(c.numel() for c in self.chunks)

    def cursor(self) -> _ArenaCursor:
        return _ArenaCursor(self)


class _ArenaCursor:
    """One capture's place in its arena."""

    def __init__(self, arena: CaptureArena) -> None:
        self.arena = arena
        self.chunk = 0
        self.offset = 0
        self.taken = 0

    def take(self, fresh: torch.Tensor) -> torch.Tensor:
        """A tensor of ``fresh``'s dtype, shape and strides in the arena's
        memory, in its place; ``fresh`` itself where it is not a CPU tensor or
        holds no bytes."""
        nbytes = fresh.untyped_storage().nbytes()
        if nbytes == 0 or fresh.device.type != "cpu":
            return fresh
        return self._carve(nbytes, fresh.dtype, fresh.shape, fresh.stride(), fresh.storage_offset())

    def empty_strided(self, size: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """What Inductor's ``empty_strided_cpu`` returns, in the arena."""
        if any(n == 0 for n in size):
            with _disable_current_modes():
                return torch.empty_strided(size, stride, dtype=dtype)
        nbytes = (1 + sum((n - 1) * st for n, st in zip(size, stride))) * dtype.itemsize
        return self._carve(nbytes, dtype, size, stride, 0)

    def _carve(self, nbytes: int, dtype: torch.dtype, size: Sequence[int], stride: Sequence[int],
               storage_offset: int) -> torch.Tensor:
        chunks = self.arena.chunks
        while self.chunk < len(chunks) and self.offset + nbytes > chunks[self.chunk].numel():
            self.chunk, self.offset = self.chunk + 1, 0
        with _disable_current_modes():  # the capture's own mode refuses ``set_``, and would carve the chunk
            if self.chunk == len(chunks):
                chunks.append(torch.empty(max(CaptureArena.CHUNK_BYTES, nbytes), dtype=torch.uint8))
            storage = chunks[self.chunk].untyped_storage()
            out = torch.empty(0, dtype=dtype).set_(storage, self.offset // dtype.itemsize + storage_offset, size,
                                                   stride)
        self.offset += -(-nbytes // CaptureArena.ALIGN) * CaptureArena.ALIGN
        self.taken += nbytes
        return out


class _OnlyAllocations(TorchDispatchMode):
    """Refuses every torch operator but allocations and views; keeps what
    they return."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in torch._disable_dynamo unless
        # this says no; the wrapper's first call imports torch._dynamo, about 2 s
        # (a padded step's capture slicing its rows, on a warm start that
        # otherwise never loads it: its first step of 24 requests took 2.24 s
        # against 0.03). A capture never runs under torch.compile.
        return False

    def __init__(self, arena: CaptureArena | None = None) -> None:
        super().__init__()
        self.kept: list[torch.Tensor] = []
        self.cursor = arena.cursor() if arena is not None else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func.name()
        if not (func.is_view or name in _ALLOCATIONS):
            raise NotCapturable(f"{name} ran while a CPU call graph was captured: a replay would leave it out")
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            _check_aliases(name, args, out)
        elif self.cursor is not None:  # an allocation: its twin in the arena, the fresh one dropped
            out = self.cursor.take(out)
        self.kept.extend(t for t in _tensors(out))
        return out


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _check_aliases(name: str, args: Sequence[Any], out: Any) -> None:
    """A view operator that may copy (``reshape`` of a non-contiguous tensor)
    must not have: its outputs share the input's storage."""
    base = next(_tensors(list(args)), None)
    if base is None:
        return
    storage = base.untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() != storage for t in _tensors(out)):
        raise NotCapturable(f"{name} copied its input while a CPU call graph was captured")


def _get(holder: Any, name: str) -> Any:
    return holder[name] if isinstance(holder, dict) else getattr(holder, name)


def _set(holder: Any, name: str, value: Any) -> None:
    if isinstance(holder, dict):
        holder[name] = value
    else:
        setattr(holder, name, value)


class _Site:
    """What a site holds while captures use it: the original function, and
    each capturing thread's stand-in for it (every other thread calls the
    original)."""

    def __init__(self, original: Callable[..., Any]) -> None:
        self.original = original
        self.routes: dict[int, Callable[..., Any]] = {}

    def __call__(self, *args: Any) -> Any:
        return self.routes.get(threading.get_ident(), self.original)(*args)


# The sites captures hold now, by (id(holder), name), and their holders. Engines
# in one process share the C kernels' sites, and each may capture in its own
# thread while another does: a site is taken over by the first capture that
# uses it and given back by the last (swapping each capture's wrapper over the
# one before would leave a stale wrapper behind when they end out of order).
_TAKEN: dict[tuple[int, str], tuple[Any, _Site]] = {}
_TAKEN_LOCK = threading.Lock()


@contextlib.contextmanager
def _swapped(sites: Sequence[NativeSite], wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """In this thread, every site's function ``fn`` acts as ``wrap(fn)``
    until exit; the original is back in the site once no capture uses it."""
    thread = threading.get_ident()
    mine: list[tuple[tuple[int, str], _Site]] = []
    try:
        with _TAKEN_LOCK:
            for holder, name in sites:
                key = (id(holder), name)
                if key not in _TAKEN:
                    fn = _get(holder, name)
                    if fn is None:
                        continue
                    _TAKEN[key] = (holder, _Site(fn))
                    _set(holder, name, _TAKEN[key][1])
                site = _TAKEN[key][1]
                if thread not in site.routes:  # a site listed twice is wrapped once
                    site.routes[thread] = wrap(site.original)
                    mine.append((key, site))
        yield
    finally:
        with _TAKEN_LOCK:
            for key, site in mine:
                del site.routes[thread]
                if not site.routes:
                    holder, _ = _TAKEN.pop(key)
                    _set(holder, key[1], site.original)


def _recording(sites: Sequence[NativeSite], calls: list[tuple[Callable[..., Any], tuple[Any, ...], Any]],
               ) -> contextlib.AbstractContextManager[None]:
    """Every site's function, in this thread, also appending its calls to
    ``calls``. The sites are shared (the C linear kernel the op calls is one
    per process), so another engine's thread may call them meanwhile: its
    calls are not recorded."""

    def recorder(fn: Callable[..., Any]) -> Callable[..., Any]:
        def record(*args: Any) -> Any:
            result = fn(*args)
            calls.append((fn, args, result if isinstance(result, int) else None))
            return result
        return record

    return _swapped(sites, recorder)


def _allocating(sites: Sequence[NativeSite], cursor: _ArenaCursor | None) -> contextlib.AbstractContextManager[None]:
    """Every allocator site (a function of (size, stride, dtype), as Inductor's
    ``empty_strided_cpu``) carving from ``cursor``'s arena in this thread."""
    if cursor is None:
        return contextlib.nullcontext()
    return _swapped(sites, lambda fn: cursor.empty_strided)


class NativeReplay:
    """A graph's calls made from C by ``loop`` (``kiln_replay`` in
    kiln/compiler/cpu_linear.c, a ctypes function) in one call: an array of
    (C function, its integer arguments, return check) structures, the
    arguments of all the calls side by side in one array followed by
    ``max_args`` zeros (each call passes ``max_args`` integers, its own first)."""

    def __init__(self, loop: Callable[..., int], max_args: int) -> None:
        self.loop = loop
        self.max_args = max_args

    def prepare(self, calls: Sequence[tuple[Callable[..., Any], tuple[Any, ...], Any]]) -> _NativeCalls | str:
        """The calls as the loop takes them; a string saying why not where one
        of them is not a C function of integer arguments (a float, an object,
        more than ``max_args``)."""
        flat: list[int] = []
        made: list[tuple[int, int, Any]] = []  # (C function, start of its arguments in ``flat``, expected)
        for fn, args, expected in calls:
            name = getattr(fn, "__name__", repr(fn))
            address = c_function(fn)
            if address is None:
                return f"{name} is not a known C function"
            if len(args) > self.max_args:
                return f"{name} takes {len(args)} arguments, more than the native loop's {self.max_args}"
            values = [_integer(a) for a in args]
            if None in values:
                return f"an argument of {name} is not an integer, an address or None: {args!r}"
            made.append((address, len(flat), expected))
            flat.extend(values)  # type: ignore[arg-type]
        return _NativeCalls(made, flat + [0] * self.max_args)

    def run(self, native: _NativeCalls, calls: Sequence[tuple[Callable[..., Any], tuple[Any, ...], Any]]) -> None:
        """Make the prepared ``native`` calls; ReplayError names the first of
        ``calls`` (the recorded ones) that returned otherwise."""
        got = ctypes.c_int64()
        index = self.loop(native.calls, len(calls), ctypes.byref(got))
        if index != -1:
            fn, _, expected = calls[index]
            raise ReplayError(f"{getattr(fn, '__name__', fn)} returned {got.value!r} on replay, {expected!r} "
                              "at capture: this step's arguments are outside what it took then")


class _Call(ctypes.Structure):
    """``kiln_replay_call`` in kiln/compiler/cpu_linear.c."""

    _fields_ = [("fn", ctypes.c_void_p), ("args", ctypes.c_void_p), ("check", ctypes.c_int64),
                ("expected", ctypes.c_int64)]


class _NativeCalls:
    """The structures ``kiln_replay`` reads, and the argument array they point into."""

    def __init__(self, made: list[tuple[int, int, Any]], flat: list[int]) -> None:
        self.args = (ctypes.c_int64 * len(flat))(*flat)
        base, size = ctypes.addressof(self.args), ctypes.sizeof(ctypes.c_int64)
        self.calls = (_Call * len(made))()
        for call, (address, start, expected) in zip(self.calls, made):
            call.fn = address
            call.args = base + start * size
            call.check = expected is not None
            call.expected = expected or 0


def _integer(value: Any) -> int | None:
    """``value`` as the C function receives it: a tensor as its data address,
    None as NULL, a bool or an int as itself; None for anything else."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr()
    if value is None:
        return 0
    if isinstance(value, int) and -(1 << 63) <= value < (1 << 63):
        return int(value)
    return None


class CpuCallGraphs:
    """The ``GraphCapturer`` of CPU call graphs (``kiln.graphs.wrapper``).
    ``sites`` lists, when a capture starts, the native functions a step may
    call (asked then, so that it names the kernels the code calls at that
    moment). A graph is captured by the first real step of its size: the
    capture computes that step as it records it, so a load captures nothing
    and pays nothing."""

    captures_live_steps = True

    def __init__(self, sites: Callable[[], Sequence[NativeSite]], native: NativeReplay | None = None,
                 allocators: Callable[[], Sequence[NativeSite]] = lambda: ()) -> None:
        self.sites = sites
        self.native = native  # makes a graph's calls from C where it can
        # where a step's code finds an allocator that bypasses torch's dispatcher
        # (Inductor's ``empty_strided_cpu``), which a capture points at its arena
        self.allocators = allocators

    def new_pool(self) -> CaptureArena:
        return CaptureArena()

    def capture(self, fn: Callable[[], Any], pool: CaptureArena | None) -> tuple[CallGraph, Any]:
        """Run ``fn`` (a whole step) and record it; its buffers from ``pool``
        (None: its own)."""
        calls: list[tuple[Callable[..., Any], tuple[Any, ...], Any]] = []
        guard = _OnlyAllocations(pool)
        t0 = time.perf_counter()
        with _recording(self.sites(), calls), _allocating(self.allocators(), guard.cursor), guard:
            out = fn()
        if not calls:
            raise NotCapturable("the step made no native call through the given sites")
        nbytes = guard.cursor.taken if guard.cursor is not None else 0
        graph = CallGraph(tuple(calls), guard.kept, nbytes=nbytes)
        prepared = self.native.prepare(calls) if self.native is not None else "no native loop"
        if isinstance(prepared, str):
            how = f"replayed from Python: {prepared}"
        else:
            graph.native, how = prepared, "replayed from C"
        logger.info("captured a CPU call graph: %d native calls in %.1f ms, %s%s", len(calls),
                    (time.perf_counter() - t0) * 1e3, how,
                    f"; {nbytes / 1e6:.1f} MB of buffers, the arena every graph shares {pool.nbytes / 1e6:.1f} MB"
                    if pool is not None else "")
        return graph, out

    def replay(self, graph: CallGraph) -> None:
        if graph.native is not None:
            self.native.run(graph.native, graph.calls)  # type: ignore[union-attr]
            return
        for fn, args, expected in graph.calls:
            result = fn(*args)
            if expected is not None and result != expected:
                raise ReplayError(f"{getattr(fn, '__name__', fn)} returned {result!r} on replay, {expected!r} "
                                  "at capture: this step's arguments are outside what it took then")
