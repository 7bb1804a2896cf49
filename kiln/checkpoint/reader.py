"""The interfaces every checkpoint format implements.

A ``Checkpoint`` is a model's files: a Hugging Face style ``config.json`` (as a
dict), generation defaults, a tokenizer, and a ``CheckpointReader`` over its
tensors. Readers are lazy: listing names and shapes reads no tensor data, and
``get`` materialises one tensor at a time, so a loader copies each weight once.
Tensor names are Hugging Face's (``model.layers.0.self_attn.q_proj.weight``)
whatever the file format, so one weight loader serves every format.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

__all__ = [
    "Checkpoint", "CheckpointError", "CheckpointReader", "QuantizedTensor", "TensorInfo", "open_checkpoint",
]


class CheckpointError(ValueError):
    """A checkpoint, its config or one of its tensors is unusable. The message
    names the file and the field or tensor at fault."""


@dataclass(frozen=True)
class TensorInfo:
    """A tensor as stored, before it is read."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # the stored type: a torch dtype name, or a quantization format
    file: Path


@dataclass(frozen=True)
class QuantizedTensor:
    """A weight stored as small integers in blocks along its rows, as a file
    holds it (GGUF's Q8_0, Q4_0 and Q4_1) or as kiln quantized it: element
    ``[n, k]`` is ``values[n, k] * scales[n, k // block] + offsets[n, k // block]``
    (no offset term when ``offsets`` is None), with ``block = K // scales.shape[1]``.
    Format-neutral: how a model packs it for its kernels is the model's business."""

    values: torch.Tensor  # [N, K] int8 (8-bit formats) or uint8 in [0, 15] (4-bit ones)
    scales: torch.Tensor  # [N, K / block] float32
    offsets: torch.Tensor | None  # [N, K / block] float32, or None
    bits: int  # 8 or 4
    source: str  # the stored type, for messages: "Q8_0", "Q4_1", "int8"

    @property
    def block(self) -> int:
        return self.values.shape[1] // self.scales.shape[1]


class CheckpointReader(abc.ABC):
    """Lazy access to a checkpoint's tensors, by Hugging Face name."""

    @abc.abstractmethod
    def tensors(self) -> list[TensorInfo]:
        """Every tensor, in file order, without reading data."""

    @abc.abstractmethod
    def get(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as a CPU tensor (dequantized if stored quantized).
        Raises ``CheckpointError`` naming the file when it cannot be read."""

    def get_quantized(self, name: str) -> QuantizedTensor | None:
        """Tensor ``name`` in its stored blocks, undequantized, when it is
        stored in a block format kiln can run packed; else None (``get`` still
        reads it)."""
        return None

    def read_into(self, name: str, dest: torch.Tensor) -> None:
        """Fill ``dest`` (a parameter, or a row block of one) with tensor
        ``name``, converted to ``dest``'s dtype: one copy. Formats that can read
        straight from the file into ``dest`` override this."""
        dest.copy_(self.get(name))

    def close(self) -> None:
        """Release open files (readers also work as context managers)."""

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Checkpoint(abc.ABC):
    """A model's files, however they are stored."""

    format: ClassVar[str]  # "hf" (a directory with config.json and safetensors) or "gguf"
    path: Path  # what the user named (a directory or a file)

    @abc.abstractmethod
    def config(self) -> dict[str, Any]:
        """The model's config as a Hugging Face ``config.json`` dict."""

    @abc.abstractmethod
    def config_source(self) -> str:
        """Where ``config()`` came from, for error messages."""

    @abc.abstractmethod
    def generation_config(self) -> dict[str, Any]:
        """Generation defaults (``generation_config.json``); empty when none."""

    def generation_config_source(self) -> str:
        """Where ``generation_config()`` came from, for the startup report."""
        return "generation_config.json"

    @abc.abstractmethod
    def reader(self) -> CheckpointReader:
        """A reader over the weights."""

    @abc.abstractmethod
    def load_tokenizer(self, cache_dir: Path | None = None) -> Any:
        """A transformers tokenizer, or None when the checkpoint has none.
        ``cache_dir``: where a checkpoint may keep what it derives, to load
        faster next time (a GGUF file's converted tokenizer); None keeps
        nothing."""

    @abc.abstractmethod
    def metadata_files(self) -> list[Path]:
        """Config, generation config and tokenizer files (what every bundle copies)."""

    @abc.abstractmethod
    def weight_files(self) -> list[Path]:
        """The files holding the weights (what ``--include-weights`` copies)."""

    @property
    @abc.abstractmethod
    def weights_dir(self) -> Path:
        """The directory the weight files are in."""

    @property
    def weights_source(self) -> Path:
        """What a bundle built without weights records, to find them again: the
        weights' directory (a GGUF: its file)."""
        return self.weights_dir

    def identity(self) -> dict[str, Any]:
        """What the compiled code depends on beyond the config, for cache keys.
        Weight values never matter (they are graph inputs); formats whose layout
        differs from the config's say so here."""
        return {}


def open_checkpoint(path: Path, weights: Path | None = None) -> Checkpoint:
    """The checkpoint at ``path``: a Hugging Face directory (config.json and
    safetensors), or a ``.gguf`` file. ``weights``: a directory holding the
    safetensors when they are kept apart from the config (a bundle built without
    weights)."""
    from kiln.checkpoint.safetensors import HFCheckpoint

    if not path.exists():
        raise CheckpointError(f"model path {path} does not exist")
    if path.is_dir():
        return HFCheckpoint(path, weights or path)
    if path.suffix.lower() == ".gguf":
        from kiln.checkpoint.gguf import GGUFCheckpoint

        return GGUFCheckpoint(path)
    raise CheckpointError(f"model path {path} is not a checkpoint directory or a .gguf file")
