"""What the runner and the compiler call on a model.

A model is token-flattened: ``forward(input_ids[T], positions[T]) -> hidden[T, H]``
for the T tokens of every scheduled request concatenated, T being the only
dynamic dimension. It knows nothing of requests, the KV cache or compilation:
attention is one call of the ``kiln::attention`` op (``kiln.attention.op``), whose
per-step inputs come from the forward context. The LM head is kept apart
(``compute_logits``) so the runner computes logits only for the rows it samples,
and so the compiler can compile it on its own (``logits_inputs``). Linear layers
may be packed (``quantize``, ``kiln.models.quant``).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kiln.checkpoint import CheckpointReader, TensorInfo
from kiln.models.config import ConfigFields, ModelConfig
from kiln.models.quant import QuantFormat

__all__ = ["Architecture", "CausalLM"]


class CausalLM(nn.Module, abc.ABC):
    config: ModelConfig

    @abc.abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states after the final norm, ``[T, hidden_size]``."""

    @abc.abstractmethod
    def logits_weight(self) -> torch.Tensor:
        """The dense LM head's weight ``[vocab, hidden]`` (the embedding's when tied)."""

    def logits_inputs(self) -> tuple[list[torch.Tensor], QuantFormat | None]:
        """The LM head's tensors and their format: ``[logits_weight()]`` and None
        when dense, else the packed tensors (``QuantizedLinear.packed``) and their
        format."""
        return [self.logits_weight()], None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[S, vocab]`` of the hidden rows ``[S, hidden_size]``."""
        return torch.nn.functional.linear(hidden, self.logits_weight())

    def quantize(self, mode: str, tensors: list[TensorInfo]) -> dict[str, str]:
        """On the meta device, before materialising: replace linear layers by
        packed ones as ``mode`` (``kiln.models.quant.QUANTIZATION_MODES``) and the
        checkpoint's stored types (``tensors``) decide. Returns module -> format."""
        raise ValueError(f"{type(self).__name__} has no quantized layers (quantization={mode!r})")

    @abc.abstractmethod
    def load_weights(self, reader: CheckpointReader, *, read: bool = True) -> None:
        """Fill every parameter from ``reader`` exactly once; raise
        ``CheckpointError`` naming the file and tensor for a missing, misshaped
        or unexpected tensor. Without ``read``, only check the names and shapes
        (a compile, whose code does not depend on weight values)."""

    @abc.abstractmethod
    def reset_buffers(self) -> None:
        """Compute the non-persistent buffers (RoPE tables) after the model was
        materialised on its device."""


@dataclass(frozen=True)
class Architecture:
    """One supported architecture, as its module declares it."""

    name: str  # the ``architectures`` entry of config.json
    model_type: str  # config.json's ``model_type``, used when ``architectures`` is missing
    # (typed config fields, generation config) -> ModelConfig
    parse_config: Callable[[ConfigFields, dict[str, Any]], ModelConfig]
    # (config, RoPE table length) -> a model whose weights are still to load
    model_class: Callable[[ModelConfig, int], CausalLM]
