"""Choosing, per step, which CUDA graph (if any) runs the batch.

The dispatcher turns the configured ``CUDAGraphMode`` into one of three runtime
modes per step, with priority FULL > PIECEWISE > NONE:

* FULL: one graph replays the whole forward. Only when the attention backend
  allows it for this batch shape (uniform decode, or any shape).
* PIECEWISE: each compiled compute piece replays its own graph; attention runs
  eagerly between them, so any backend and any batch shape can use it. Needs
  compiled pieces (level >= 1).
* NONE: plain execution, for token counts above the largest capture size.

A step's token count is padded up to the next capture size; the padded count is
the graph's key. FULL graphs also pad the request count (padding requests own no
query rows), because kernels size their grids by it. CPU call graphs
(``kiln.graphs.cpu``) are padded the same way; their sizes are chosen so that
padding costs little there (``kiln.config.cpu_capture_sizes``).
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

from kiln.config import CUDAGraphMode, CUDAGraphSupport
from kiln.forward_context import BatchDescriptor

__all__ = ["CUDAGraphDispatcher", "Dispatch"]

logger = logging.getLogger(__name__)

_FULL_MODES = (CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE)


@dataclass(frozen=True)
class Dispatch:
    """What a step runs: ``mode`` is NONE, PIECEWISE or FULL; ``descriptor`` keys
    the graph and carries the padded token and request counts."""

    mode: CUDAGraphMode
    descriptor: BatchDescriptor

    @property
    def num_tokens(self) -> int:
        return self.descriptor.num_tokens


def effective_mode(
    requested: CUDAGraphMode, support: CUDAGraphSupport, *, has_pieces: bool
) -> CUDAGraphMode:
    """``requested`` downgraded to what the attention backend (``support``) and the
    compiled model (``has_pieces``: piecewise graphs need compiled pieces) allow."""
    mode = requested
    if support is CUDAGraphSupport.NEVER:
        mode = {
            CUDAGraphMode.FULL: CUDAGraphMode.PIECEWISE,
            CUDAGraphMode.FULL_AND_PIECEWISE: CUDAGraphMode.PIECEWISE,
            CUDAGraphMode.FULL_DECODE_ONLY: CUDAGraphMode.NONE,
        }.get(mode, mode)
    elif support is CUDAGraphSupport.UNIFORM_DECODE and mode is CUDAGraphMode.FULL:
        mode = CUDAGraphMode.FULL_AND_PIECEWISE
    if not has_pieces:
        mode = {
            CUDAGraphMode.PIECEWISE: CUDAGraphMode.NONE,
            CUDAGraphMode.FULL_AND_PIECEWISE: CUDAGraphMode.FULL_DECODE_ONLY,
        }.get(mode, mode)
    return mode


class CUDAGraphDispatcher:
    """Maps a step's (token count, request count, uniform decode) to a ``Dispatch``.

    ``requested`` is the configured mode; it is downgraded once, here, to what the
    attention backend's ``support`` and ``has_pieces`` allow, and the result is
    ``self.mode``. ``capture_sizes`` are the padded token counts graphs exist for;
    ``max_num_seqs`` is what FULL graphs pad the request count up to.
    """

    def __init__(
        self,
        requested: CUDAGraphMode,
        capture_sizes: list[int],
        *,
        support: CUDAGraphSupport,
        has_pieces: bool,
        max_num_seqs: int,
    ) -> None:
        self.requested = requested
        self.support = support
        self.mode = effective_mode(requested, support, has_pieces=has_pieces)
        if self.mode is not requested:
            logger.info(
                "cudagraph_mode %s runs as %s (attention backend graph support: %s, compiled pieces: %s)",
                requested.value, self.mode.value, support.value, has_pieces,
            )
        self.capture_sizes = sorted(set(capture_sizes))
        self.max_num_seqs = max_num_seqs
        if self.mode is not CUDAGraphMode.NONE and not self.capture_sizes:
            raise ValueError(f"cudagraph_mode {self.mode.value} needs at least one capture size")

    @property
    def max_capture_size(self) -> int:
        return self.capture_sizes[-1] if self.capture_sizes else 0

    def padded(self, num_tokens: int) -> int | None:
        """The smallest capture size >= ``num_tokens``; None where there is none."""
        i = bisect.bisect_left(self.capture_sizes, num_tokens)
        if i == len(self.capture_sizes):
            return None
        return self.capture_sizes[i]

    def drop(self, num_tokens: int) -> None:
        """No graph of this size: its capture was refused (``kiln.graphs.cpu.
        NotCapturable``); its steps run without one."""
        self.capture_sizes = [s for s in self.capture_sizes if s != num_tokens]

    def _full_allowed(self, uniform: bool) -> bool:
        if self.mode is CUDAGraphMode.FULL:
            return uniform or self.support is CUDAGraphSupport.ALWAYS
        return self.mode in (CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY) and uniform

    def _piecewise_allowed(self) -> bool:
        return self.mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE)

    def dispatch(self, num_tokens: int, num_reqs: int, uniform_decode: bool) -> Dispatch:
        """``uniform_decode``: every request of the step has exactly one token."""
        unpadded = Dispatch(CUDAGraphMode.NONE, BatchDescriptor(num_tokens, num_reqs, uniform_decode))
        if self.mode is CUDAGraphMode.NONE or num_tokens < 1:
            return unpadded
        padded = self.padded(num_tokens)
        if padded is None:
            return unpadded
        if self._full_allowed(uniform_decode):
            return Dispatch(CUDAGraphMode.FULL, self.full_descriptor(padded, uniform_decode))
        if self._piecewise_allowed():
            return Dispatch(CUDAGraphMode.PIECEWISE, BatchDescriptor(padded, None, False))
        return unpadded

    def full_descriptor(self, num_tokens: int, uniform: bool) -> BatchDescriptor:
        # Uniform decode: one request per token, as many as the buffers hold. Mixed
        # batches: every request row, since their count varies under one token count.
        reqs = min(num_tokens, self.max_num_seqs) if uniform else self.max_num_seqs
        return BatchDescriptor(num_tokens, reqs, uniform)

    def capture_plan(self) -> list[Dispatch]:
        """Every (mode, descriptor) graphs are captured for, largest first.

        A uniform decode batch has at most ``max_num_seqs`` tokens, so its FULL
        graphs stop at the first capture size that holds that many."""
        plan: list[Dispatch] = []
        decode_limit = self.padded(self.max_num_seqs) or self.max_capture_size
        for size in reversed(self.capture_sizes):
            if self.mode is CUDAGraphMode.NONE:
                break
            decode = size <= decode_limit
            if self.mode is CUDAGraphMode.FULL:
                if decode:
                    plan.append(Dispatch(CUDAGraphMode.FULL, self.full_descriptor(size, True)))
                if self.support is CUDAGraphSupport.ALWAYS:
                    plan.append(Dispatch(CUDAGraphMode.FULL, self.full_descriptor(size, False)))
            elif self.mode in (CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY) and decode:
                plan.append(Dispatch(CUDAGraphMode.FULL, self.full_descriptor(size, True)))
            if self._piecewise_allowed():
                plan.append(Dispatch(CUDAGraphMode.PIECEWISE, BatchDescriptor(size, None, False)))
        return plan
