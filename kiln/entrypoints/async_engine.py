"""The asynchronous front-end: one engine thread steps the engine core while
requests arrive from an asyncio event loop (the server's).

Requests are handed to the engine thread through a small inbox; they join the
running batch at the next step. After each step the thread detokenizes (the
output processor) and hands every request's new text and tokens to its
collector on the event loop (``loop.call_soon_threadsafe``); a collector merges
what arrived while its consumer was busy, so a slow client never slows the
engine and never loses output. A consumer that goes away (a cancelled task, a
client disconnect) aborts its request: its KV blocks are free before the next
step. If the engine thread dies, every request in flight gets ``EngineDeadError``
and ``healthy`` turns False.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from kiln.engine.loader import LoadedEngine
from kiln.engine.output_processor import OutputProcessor
from kiln.engine.outputs import EngineStats, StreamDelta
from kiln.engine.request import SamplingParams

__all__ = ["AsyncEngine", "EngineDeadError", "RequestTimes"]

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an error; no request can be served."""


@dataclass
class RequestTimes:
    """Monotonic timestamps of one request, for latency metrics."""

    arrival: float
    scheduled: float | None = None  # first step that ran it (queue time ends)
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each output delta arrived
    finished: float | None = None


class _Collector:
    """One request's output on the event loop: merged deltas and an event."""

    def __init__(self, times: RequestTimes) -> None:
        self.pending: StreamDelta | None = None
        self.error: BaseException | None = None
        self.ready = asyncio.Event()
        self.times = times

    def put(self, delta: StreamDelta, at: float) -> None:
        if delta.token_ids:
            self.times.first_token = self.times.first_token or at
            self.times.token_times.append(at)
        if delta.finished:
            self.times.finished = at
        p = self.pending
        if p is None:
            self.pending = delta
        else:  # the consumer is behind: merge
            logprobs = None if p.logprobs is None else p.logprobs + (delta.logprobs or [])
            self.pending = StreamDelta(p.request_id, p.text + delta.text, p.token_ids + delta.token_ids,
                                       delta.finish_reason, logprobs, p.prompt_logprobs or delta.prompt_logprobs)
        self.ready.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.ready.set()

    async def get(self) -> StreamDelta:
        """What arrived since the last call (waiting for something); the
        engine's error once everything before it was taken."""
        while self.pending is None and self.error is None:
            self.ready.clear()
            await self.ready.wait()
        if self.pending is None:
            raise self.error  # type: ignore[misc]
        delta, self.pending = self.pending, None
        return delta


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    cache_salt: str | None


class AsyncEngine:
    """Serves one loaded engine to asyncio callers. ``start`` must be called
    from the event loop that will consume the outputs."""

    def __init__(self, loaded: LoadedEngine) -> None:
        self.engine = loaded.engine
        self.tokenizer = loaded.tokenizer
        self.config = loaded.config
        self._loaded = loaded
        self._processor = OutputProcessor(loaded.tokenizer)
        self._inbox: list[_Add | str] = []  # adds, and aborts by request id
        self._inbox_lock = threading.Lock()
        self._wake = threading.Event()
        self._collectors: dict[str, _Collector] = {}  # event-loop side
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._ids = itertools.count()
        self.dead: BaseException | None = None
        self.stats: EngineStats = self.engine.stats()  # refreshed after every step

    @property
    def startup_report(self) -> dict[str, Any]:
        """The load's report, with a background compile's state as of now."""
        return self._loaded.report()

    @property
    def healthy(self) -> bool:
        return self.dead is None and self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kiln-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._loaded.close()
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for a request the engine would refuse (nothing queued)."""
        self.engine.check_request(prompt_token_ids, params)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, *, prompt: str | None = None,
                       request_id: str | None = None, times: RequestTimes | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[StreamDelta]:
        """Queue a request and yield what each step adds to it (merged when the
        consumer lags); the last delta carries the finish reason. Closing the
        iterator early aborts the request."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead}")
        self.check_request(prompt_token_ids, params)
        rid = request_id or f"req-{next(self._ids)}"
        collector = _Collector(times or RequestTimes(time.monotonic()))
        self._collectors[rid] = collector
        self._send(_Add(rid, list(prompt_token_ids), params, prompt, cache_salt))
        finished = False
        try:
            while not finished:
                delta = await collector.get()
                finished = delta.finished
                yield delta
        finally:
            self._collectors.pop(rid, None)
            if not finished:
                self._send(rid)  # abort: the consumer went away

    def _send(self, item: _Add | str) -> None:
        with self._inbox_lock:
            self._inbox.append(item)
        self._wake.set()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    # idle: a background build's pieces are swapped in without waiting for a request
                    pending = self.engine.background_pending()
                    self._wake.wait(timeout=0.5 if pending else None)
                    self._wake.clear()
                    if pending:
                        self.engine.swap_if_ready()
                        self.stats = self.engine.stats()
                    continue
                self._step()
        except BaseException as e:  # noqa: BLE001  (reported to every request and to /health)
            logger.exception("the engine thread died")
            self.dead = e
            self._call_soon(self._fail_all, e)

    def _drain_inbox(self) -> None:
        with self._inbox_lock:
            items, self._inbox = self._inbox, []
        aborted = [item for item in items if isinstance(item, str)]
        for item in items:
            if isinstance(item, _Add) and item.request_id not in aborted:
                self.engine.add_request(item.request_id, item.prompt_token_ids, item.params, item.cache_salt)
                self._processor.add_request(item.request_id, item.prompt, item.prompt_token_ids, item.params)
        if aborted:
            self.engine.abort(aborted)
            for rid in aborted:
                self._processor.release(rid)
            self.stats = self.engine.stats()

    def _step(self) -> None:
        outputs = self.engine.step()
        processed = self._processor.process(outputs)
        if processed.to_abort:
            self.engine.abort(processed.to_abort)
        for delta in processed.deltas:
            if delta.finished:
                self._processor.release(delta.request_id)
        self.stats = self.engine.stats()
        self._call_soon(self._deliver, time.monotonic(), outputs.first_scheduled, processed.deltas)

    def _call_soon(self, fn: Any, *args: Any) -> None:
        if self._loop is None:
            raise RuntimeError("AsyncEngine.start() was not called from an event loop")
        self._loop.call_soon_threadsafe(fn, *args)

    # ------------------------------------------------------------------ event loop
    def _deliver(self, at: float, first_scheduled: list[str], deltas: list[StreamDelta]) -> None:
        for rid in first_scheduled:
            if rid in self._collectors:
                self._collectors[rid].times.scheduled = at
        for delta in deltas:
            collector = self._collectors.get(delta.request_id)  # type: ignore[arg-type]
            if collector is not None:
                collector.put(delta, at)

    def _fail_all(self, error: BaseException) -> None:
        for collector in self._collectors.values():
            collector.fail(EngineDeadError(f"the engine stopped: {error}"))
