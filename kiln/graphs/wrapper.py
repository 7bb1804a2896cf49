"""Capture once, replay after: ``CUDAGraphWrapper`` around the whole model (FULL)
or around each compiled compute piece (PIECEWISE).

A wrapper acts only when the forward context's runtime mode is its own; any other
step passes straight through to the wrapped callable. That lets one FULL wrapper
around the model and PIECEWISE wrappers around its pieces coexist, with the
dispatcher's choice deciding which of them replays.

A replayed graph reads the memory its capture read and writes the memory its
capture wrote. So every input must live at a fixed address (the runner's
persistent buffers, parameters, or the outputs of an earlier captured piece) and
the output returned on replay is the tensor captured the first time. Graphs of
every wrapper share one memory pool.

How graphs are made is behind ``GraphCapturer``: ``TorchCUDAGraphs`` on a GPU,
``CpuCallGraphs`` (``kiln.graphs.cpu``) on a CPU; tests substitute a recorder to
check the bookkeeping. A CUDA graph is captured at load, in a step of padding
only; a CPU call graph at the first real step of its size
(``captures_live_steps``), which it computes as it records.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kiln.config import CUDAGraphMode
from kiln.forward_context import BatchDescriptor, get_forward_context

__all__ = ["CUDAGraphWrapper", "GraphCapturer", "TorchCUDAGraphs", "capture_session"]

logger = logging.getLogger(__name__)


class GraphCapturer(Protocol):
    # True: a graph is captured by the first step that needs it, not at load
    captures_live_steps: bool

    def new_pool(self) -> Any:
        """A memory pool handle every graph of a runner shares."""

    def capture(self, fn: Callable[[], Any], pool: Any) -> tuple[Any, Any]:
        """Run ``fn`` under capture; return (graph, fn's output)."""

    def replay(self, graph: Any) -> None: ...


class TorchCUDAGraphs:
    """``torch.cuda.CUDAGraph`` capture and replay on the current stream's device."""

    captures_live_steps = False

    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], Any], pool: Any) -> tuple[Any, Any]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return graph, out

    def replay(self, graph: Any) -> None:
        graph.replay()


_capturing = False


@contextlib.contextmanager
def capture_session() -> Iterator[None]:
    """Where wrappers may capture. ``torch.cuda.graph`` runs a full ``gc.collect``
    and empties the allocator's cache before every capture; after the first one
    that only costs time (hundreds of captures), so both are skipped until the
    session ends."""
    global _capturing
    collect, empty_cache = gc.collect, torch.cuda.empty_cache
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    _capturing = True
    gc.collect = lambda generation=2: 0  # type: ignore[assignment]
    torch.cuda.empty_cache = lambda: None  # type: ignore[assignment]
    try:
        yield
    finally:
        gc.collect, torch.cuda.empty_cache = collect, empty_cache  # type: ignore[assignment]
        _capturing = False
        if gc_was_enabled:
            gc.enable()


@dataclass
class _Entry:
    graph: Any
    output: Any
    input_addresses: tuple[int, ...]


def _addresses(args: tuple[Any, ...]) -> tuple[int, ...]:
    return tuple(a.data_ptr() for a in args if isinstance(a, torch.Tensor))


class CUDAGraphWrapper:
    """Captures ``runnable`` once per ``BatchDescriptor`` while its ``mode`` is the
    step's runtime mode, and replays that graph on later steps with the same
    descriptor. ``check_addresses`` verifies on each replay that the inputs sit
    where they sat at capture (a debugging aid: it costs a little per call)."""

    def __init__(
        self,
        runnable: Callable[..., Any],
        mode: CUDAGraphMode,
        graphs: GraphCapturer,
        pool: Any,
        *,
        name: str = "",
        check_addresses: bool = False,
    ) -> None:
        if mode not in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE):
            raise ValueError(f"a CUDAGraphWrapper is FULL or PIECEWISE, not {mode.value}")
        self.runnable = runnable
        self.mode = mode
        self.graphs = graphs
        self.pool = pool
        self.name = name or getattr(runnable, "__name__", type(runnable).__name__)
        self.check_addresses = check_addresses
        self.entries: dict[BatchDescriptor, _Entry] = {}
        self.replays = 0

    def __call__(self, *args: Any) -> Any:
        ctx = get_forward_context()
        desc = ctx.batch_descriptor
        if ctx.cudagraph_mode is not self.mode or desc is None:
            return self.runnable(*args)
        entry = self.entries.get(desc)
        if entry is None:
            if not (_capturing or self.graphs.captures_live_steps):
                raise RuntimeError(
                    f"{self.name}: no {self.mode.value} CUDA graph for {desc}; graphs are captured at "
                    "load for the dispatcher's capture plan only"
                )
            graph, out = self.graphs.capture(lambda: self.runnable(*args), self.pool)
            self.entries[desc] = _Entry(graph, out, _addresses(args))
            return out
        if self.check_addresses and _addresses(args) != entry.input_addresses:
            raise RuntimeError(
                f"{self.name}: inputs of the {self.mode.value} graph for {desc} moved since capture; "
                "a replay would read stale memory"
            )
        self.graphs.replay(entry.graph)
        self.replays += 1
        return entry.output
