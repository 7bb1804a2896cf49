"""Per-step state shared by the runner (writer), the attention op and the CUDA
graph wrappers (readers).

The model's forward signature carries only token ids and positions, so that it can
be traced once with the token count as its single dynamic dimension. Everything
else a step needs (where to write K/V, which blocks a request owns, how long each
sequence is, which backend runs attention) travels here, out of band, for the
attention op to pick up.

The context is per thread: only the thread that runs a step sees it.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Protocol

import torch

from kiln.config import CUDAGraphMode

__all__ = [
    "AttentionImpl",
    "BatchDescriptor",
    "ForwardContext",
    "get_forward_context",
    "set_forward_context",
]


@dataclass(frozen=True)
class BatchDescriptor:
    """The key under which a step's CUDA graph is captured and replayed.

    ``num_tokens`` and ``num_reqs`` are padded counts; ``num_reqs`` is None for a
    piecewise graph, whose compute pieces do not depend on it. ``uniform``: every
    request has one query token (a pure decode batch).
    """

    num_tokens: int
    num_reqs: int | None
    uniform: bool


class AttentionImpl(Protocol):
    """What the attention op calls: an attention backend
    (``kiln.attention.backend.AttentionBackend`` implements it; this floor only
    names the call, so that the op needs no import of the backends)."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        out: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: Any,
        scale: float,
        sliding_window: int,
    ) -> None: ...


@dataclass(frozen=True)
class ForwardContext:
    attn_metadata: Any  # the backend's metadata for this step; None: a run with no requests
    kv_caches: list[torch.Tensor]  # per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
    batch_descriptor: BatchDescriptor | None = None
    cudagraph_mode: CUDAGraphMode = CUDAGraphMode.NONE
    attention_backend: AttentionImpl | None = None


_LOCAL = threading.local()


def get_forward_context() -> ForwardContext:
    context = getattr(_LOCAL, "context", None)
    if context is None:
        raise RuntimeError(
            "kiln attention was called outside a forward context; run the model through "
            "the engine's ModelRunner (or wrap the call in kiln.forward_context.set_forward_context)"
        )
    return context


@contextlib.contextmanager
def set_forward_context(context: ForwardContext) -> Iterator[ForwardContext]:
    previous = getattr(_LOCAL, "context", None)
    _LOCAL.context = context
    try:
        yield context
    finally:
        _LOCAL.context = previous
