"""Hugging Face checkpoint directories: ``config.json``, optional
``generation_config.json``, a tokenizer, and safetensors weights (one file, or
shards listed by ``model.safetensors.index.json``)."""

from __future__ import annotations

import ctypes
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kiln.checkpoint.reader import Checkpoint, CheckpointError, CheckpointReader, TensorInfo

__all__ = ["HFCheckpoint", "SafetensorsReader", "safetensors_files", "INDEX_NAME", "SINGLE_NAME"]

logger = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
# config, generation defaults and tokenizer files a checkpoint may carry
METADATA_FILES = (
    CONFIG_NAME, GENERATION_CONFIG_NAME, "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
    "chat_template.jinja", "chat_template.json",
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def safetensors_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: by its index when sharded."""
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from e
        files = [path / name for name in names]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index} names shard {f.name}, which is missing from {path}")
        return files
    if (path / SINGLE_NAME).is_file():
        return [path / SINGLE_NAME]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"no safetensors weights in {path} (looked for {SINGLE_NAME} and {INDEX_NAME}); "
            "kiln reads safetensors checkpoints and GGUF files"
        )
    return files


# safetensors dtype names -> torch dtypes, for tensors read straight from the file
_FILE_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
                "I64": torch.int64, "I32": torch.int32}


def _data_offsets(path: Path) -> dict[str, tuple[int, torch.dtype | None]]:
    """name -> (absolute offset of its data in the file, torch dtype) from the
    file's header (8 bytes of length, then JSON)."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    return {name: (8 + length + info["data_offsets"][0], _FILE_DTYPES.get(info["dtype"]))
            for name, info in header.items() if name != "__metadata__"}


def _pread_into(fd: int, dest: torch.Tensor, offset: int) -> None:
    """Read ``dest.nbytes`` bytes of the file at ``offset`` into ``dest``'s memory."""
    view = memoryview((ctypes.c_char * dest.nbytes).from_address(dest.data_ptr())).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"unexpected end of file at byte {offset + done}")
        done += n


class SafetensorsReader(CheckpointReader):
    """Memory-mapped safetensors files. ``get`` returns a view of the map;
    ``read_into`` reads a tensor whose dtype is the run dtype straight from the
    file into its parameter: one copy, from the page cache, with no page fault
    on a map (the 135M shape's -O0 ``load_weights`` phase: 0.56 s, transformers'
    ``from_pretrained`` 2.83 s, bench/results/startup-cpu-20261201-091546.json)."""

    def __init__(self, files: list[Path]) -> None:
        self._handles: dict[Path, Any] = {}
        self._where: dict[str, Path] = {}
        self._infos: list[TensorInfo] = []
        self._offsets: dict[str, tuple[int, torch.dtype | None]] = {}
        self._fds: dict[Path, int] = {}
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt", device="cpu")
                self._offsets.update(_data_offsets(f))
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"{f} is not a readable safetensors file: {e}") from e
            self._handles[f] = handle
            for name in handle.keys():
                sl = handle.get_slice(name)
                self._where[name] = f
                self._infos.append(TensorInfo(name, tuple(sl.get_shape()), str(sl.get_dtype()), f))

    def tensors(self) -> list[TensorInfo]:
        return list(self._infos)

    def get(self, name: str) -> torch.Tensor:
        f = self._where.get(name)
        if f is None:
            raise CheckpointError(f"tensor {name!r} is not in {', '.join(p.name for p in self._handles)}")
        try:
            return self._handles[f].get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{f}: tensor {name!r} could not be read: {e}") from e

    def read_into(self, name: str, dest: torch.Tensor) -> None:
        offset, dtype = self._offsets.get(name, (0, None))
        if dtype != dest.dtype or dest.device.type != "cpu" or not dest.is_contiguous():
            dest.copy_(self.get(name))
            return
        f = self._where[name]
        if f not in self._fds:
            self._fds[f] = os.open(f, os.O_RDONLY)
        try:
            _pread_into(self._fds[f], dest, offset)
        except OSError as e:
            raise CheckpointError(f"{f}: tensor {name!r} could not be read: {e}") from e

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._handles.clear()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not readable JSON: {e}") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


class HFCheckpoint(Checkpoint):
    """A Hugging Face checkpoint directory. ``weights`` is where the safetensors
    live when they are apart from the config (a bundle built without weights)."""

    format = "hf"

    def __init__(self, path: Path, weights: Path | None = None) -> None:
        if not path.is_dir():
            raise CheckpointError(f"model path {path} is not a directory")
        self.path = path
        self._weights_dir = weights or path
        if not (path / CONFIG_NAME).is_file():
            raise CheckpointError(
                f"{path / CONFIG_NAME} is missing: a Hugging Face checkpoint needs its config.json"
            )

    def config(self) -> dict[str, Any]:
        return _read_json(self.path / CONFIG_NAME)

    def config_source(self) -> str:
        return str(self.path / CONFIG_NAME)

    def generation_config(self) -> dict[str, Any]:
        path = self.path / GENERATION_CONFIG_NAME
        if not path.is_file():
            return {}
        try:
            return _read_json(path)
        except CheckpointError as e:
            logger.warning("%s; generation defaults ignored", e)
            return {}

    @property
    def weights_dir(self) -> Path:
        return self._weights_dir

    def reader(self) -> SafetensorsReader:
        return SafetensorsReader(safetensors_files(self.weights_dir))

    def load_tokenizer(self, cache_dir: Path | None = None) -> Any:
        if not any((self.path / n).is_file() for n in _TOKENIZER_FILES):
            return None
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        except Exception as e:  # transformers raises many types here
            raise CheckpointError(f"{self.path}: the tokenizer could not be loaded: {e}") from e

    def metadata_files(self) -> list[Path]:
        return [self.path / n for n in METADATA_FILES if (self.path / n).is_file()]

    def weight_files(self) -> list[Path]:
        index = self.weights_dir / INDEX_NAME
        return safetensors_files(self.weights_dir) + ([index] if index.is_file() else [])
