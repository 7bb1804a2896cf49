"""The attention backend interface: what runs behind ``kiln::attention``.

The op is fixed in the traced graph; which kernels run behind it is chosen at load
time and handed to the op through the forward context, so one compiled artifact
serves every backend. Each step the runner builds one ``CommonAttentionMetadata``
(device buffers, plus host copies of the per-request offsets) and the backend
turns it into its own metadata: the torch backend keeps host-side lists to walk
requests in Python, the Triton backend only device tensors. A backend also
declares what it allows inside a captured CUDA graph, for the dispatcher to
downgrade the graph mode to match.
"""

from __future__ import annotations

import abc
import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from kiln.config import CUDAGraphSupport

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "CommonAttentionMetadata",
    "create_attention_backend",
    "resolve_attention_backend",
]

logger = logging.getLogger(__name__)

ENV_VAR = "KILN_ATTENTION_BACKEND"
ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class CommonAttentionMetadata:
    """Where each token of the flattened batch belongs, for every backend.

    Device tensors are views of the runner's persistent buffers (fixed addresses,
    as CUDA graph replay needs); the ``*_cpu`` arrays are host copies of the
    same values, for backends that walk requests on the host. ``num_reqs`` and
    the tensors' lengths include the padding requests of a FULL graph."""

    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32: offsets of each request's tokens
    seq_lens: torch.Tensor  # [num_reqs] int32: context length after this step
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_seq] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot per token, -1 = padding
    query_start_loc_cpu: np.ndarray
    seq_lens_cpu: np.ndarray
    block_size: int


class AttentionBackend(abc.ABC):
    """Writes a step's K/V into the paged cache and attends over it."""

    name: ClassVar[str]
    # what the backend allows inside a graph; an instance may allow more than
    # its class (the torch backend with the CPU decode kernel)
    cudagraph_support: CUDAGraphSupport

    @abc.abstractmethod
    def build_metadata(self, common: CommonAttentionMetadata) -> Any:
        """This backend's per-step metadata, built once per step on the host."""

    def with_decode_kernel(self, kernel: Any) -> AttentionBackend:
        """This backend using ``kernel``, the CPU decode-attention kernel a
        compiled entry brings (``kiln.attention.cpu_attention``); backends with no
        use for it return themselves."""
        return self

    @abc.abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [T, heads, head_dim]
        key: torch.Tensor,  # [T, kv_heads, head_dim]
        value: torch.Tensor,
        out: torch.Tensor,  # [T, heads, head_dim], filled in place
        kv_cache: torch.Tensor,  # [2, blocks, block_size, kv_heads, head_dim]
        meta: Any,  # what build_metadata returned
        scale: float,
        sliding_window: int,
    ) -> None:
        """``T`` may exceed the step's real token count when a CUDA graph pads
        the batch; padded rows carry slot -1 and their output is never read."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


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


def create_attention_backend(name: str) -> AttentionBackend:
    """An instance of the backend called ``name`` (``torch`` or ``triton``).
    Imported on demand: importing triton costs time an eager CPU start should
    not pay."""
    if name == "torch":
        from kiln.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from kiln.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"no attention backend {name!r}; choose from {list(ATTENTION_BACKENDS[1:])}")
