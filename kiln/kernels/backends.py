"""Attention backends: the implementations behind ``kiln::attention``.

The op is fixed in the traced graph; which kernels run behind it is chosen at load
time and handed to the op through the forward context, so one compiled artifact
serves every backend. A backend also declares what it allows inside a captured
CUDA graph, for the dispatcher to downgrade the graph mode to match.

* ``torch``: the reference and the CPU path. It walks requests in Python with
  host-side lengths, so it can never sit inside a FULL graph.
* ``triton``: one varlen kernel for the whole batch plus a scatter kernel for the
  KV write. Both read only device buffers and size their grids from shapes, so a
  FULL graph may hold them for any batch. Runs on CPU only under
  ``TRITON_INTERPRET=1`` (slow; for tests).
"""

from __future__ import annotations

import abc
import importlib.util
import logging
import os
from typing import ClassVar

import torch

from kiln.config import CUDAGraphSupport
from kiln.forward_context import AttentionMetadata

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "TorchAttentionBackend",
    "TritonAttentionBackend",
    "get_attention_backend",
    "resolve_attention_backend",
]

logger = logging.getLogger(__name__)

ENV_VAR = "KILN_ATTENTION_BACKEND"
ATTENTION_BACKENDS = ("auto", "torch", "triton")


class AttentionBackend(abc.ABC):
    """Writes a step's K/V into the paged cache and attends over it."""

    name: ClassVar[str]
    cudagraph_support: ClassVar[CUDAGraphSupport]

    @abc.abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [T, heads, head_dim]
        key: torch.Tensor,  # [T, kv_heads, head_dim]
        value: torch.Tensor,
        out: torch.Tensor,  # [T, heads, head_dim], filled in place
        kv_cache: torch.Tensor,  # [2, blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int,
    ) -> None:
        """``T`` may exceed ``meta.num_actual_tokens`` when a CUDA graph pads the
        batch; padded rows carry slot -1 and their output is never read."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    cudagraph_support = CUDAGraphSupport.NEVER

    def forward(self, query, key, value, out, kv_cache, meta, scale, sliding_window) -> None:  # noqa: ANN001
        from kiln.kernels.attention import paged_attention_torch, write_kv_cache

        # Only real rows: the padding beyond them never reaches the cache, so the
        # write needs no per-step check for negative slots.
        n = meta.num_actual_tokens
        write_kv_cache(key[:n], value[:n], kv_cache, meta.slot_mapping)
        paged_attention_torch(query[:n], kv_cache, out, meta, scale, sliding_window)


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    cudagraph_support = CUDAGraphSupport.ALWAYS

    def __init__(self) -> None:
        # Imported on first use: importing triton costs time an eager CPU start
        # should not pay, and TRITON_INTERPRET is read when the kernels are defined.
        from kiln.kernels import triton_attention

        self._kernels = triton_attention

    def forward(self, query, key, value, out, kv_cache, meta, scale, sliding_window) -> None:  # noqa: ANN001
        k = self._kernels
        k.write_kv_cache_triton(key, value, kv_cache, meta.slot_mapping)
        k.paged_attention_triton(
            query, kv_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_table,
            meta.num_reqs, scale, sliding_window,
        )


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_attention_backend(requested: str | None, device: torch.device) -> str:
    """The backend name to use: ``requested``, else ``KILN_ATTENTION_BACKEND``,
    else ``auto`` (Triton on CUDA, torch elsewhere). Raises ``ValueError`` for an
    unknown name or a backend that cannot run on ``device``."""
    source = "attention_backend"
    if requested is None:
        requested, source = os.environ.get(ENV_VAR) or "auto", ENV_VAR
    name = str(requested).strip().lower()
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"{source}={requested!r} is not one of {list(ATTENTION_BACKENDS)}")
    if name == "auto":
        if device.type == "cuda" and _triton_available():
            return "triton"
        if device.type == "cuda":
            logger.warning("triton is not installed: attention falls back to the torch backend")
        return "torch"
    if name == "triton":
        if not _triton_available():
            raise ValueError(f"{source}='triton' but the triton package is not installed")
        if device.type != "cuda" and not _interpreting():
            raise ValueError(
                f"{source}='triton' on {device.type} needs TRITON_INTERPRET=1 in the environment "
                "before kiln starts (Triton's interpreter: slow, meant for tests); use 'torch' here"
            )
    return name


def get_attention_backend(name: str) -> AttentionBackend:
    """An instance of the backend called ``name`` (``torch`` or ``triton``)."""
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        return TritonAttentionBackend()
    raise ValueError(f"no attention backend {name!r}; choose from {list(ATTENTION_BACKENDS[1:])}")
