"""Per-step state shared by the runner (writer), the attention op and, later, the
CUDA graph wrappers (readers).

The model's forward signature carries only token ids and positions, so that it can
be traced once with the token count as its single dynamic dimension. Everything
else a step needs (where to write K/V, which blocks a request owns, how long each
sequence is) travels here, out of band, for the attention op to pick up.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Protocol

import torch

from kiln.config import CUDAGraphMode

__all__ = [
    "AttentionImpl",
    "AttentionMetadata",
    "BatchDescriptor",
    "ForwardContext",
    "get_forward_context",
    "set_forward_context",
]


@dataclass
class AttentionMetadata:
    """Where each token of the flattened batch belongs.

    Device tensors are views of the runner's persistent buffers; the ``*_cpu``
    lists are host copies of the same values so that a CPU implementation can
    walk requests without reading device memory.
    """

    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32: offsets of each request's tokens
    seq_lens: torch.Tensor  # [num_reqs] int32: context length after this step
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_seq] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot per token, -1 = padding
    query_start_loc_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    num_blocks_cpu: list[int] = field(default_factory=list)


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
    """What the attention op calls (kiln.kernels.backends implements it)."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        out: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int,
    ) -> None: ...


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata | None
    kv_caches: list[torch.Tensor]  # per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
    batch_descriptor: BatchDescriptor | None = None
    cudagraph_mode: CUDAGraphMode = CUDAGraphMode.NONE
    attention_backend: AttentionImpl | None = None  # None: the torch reference


_CONTEXT: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError(
            "kiln attention was called outside a forward context; run the model through "
            "ModelRunner (or wrap the call in kiln.forward_context.set_forward_context)"
        )
    return _CONTEXT


@contextlib.contextmanager
def set_forward_context(context: ForwardContext) -> Iterator[ForwardContext]:
    global _CONTEXT
    previous, _CONTEXT = _CONTEXT, context
    try:
        yield context
    finally:
        _CONTEXT = previous
