"""Building a ``DecoderModel`` from safetensors checkpoint files.

The model is constructed on the meta device (no random init), materialised
uninitialised on the target device, then every parameter is filled from the
checkpoint exactly once. A tensor that is missing, mis-shaped or unreadable is an
error naming the file and the tensor.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from kiln.runtime.model import DecoderModel, MergedLinear
from kiln.runtime.model_config import CheckpointError, ModelConfig

__all__ = ["checkpoint_files", "load_model"]

logger = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_PREFIX = "model."


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: by its index when sharded."""
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from e
        files = [path / name for name in sorted(set(weight_map.values()))]
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
            "kiln reads safetensors checkpoints only"
        )
    return files


def _iter_tensors(files: list[Path]) -> Iterator[tuple[Path, str, object]]:
    for f in files:
        try:
            handle = safe_open(str(f), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{f} is not a readable safetensors file: {e}") from e
        with handle:
            for name in handle.keys():
                yield f, name, handle


_LAYER_RE = re.compile(r"^(layers\.\d+\.(?:self_attn|mlp)\.)(\w+)\.(weight|bias)$")


def _target(name: str) -> tuple[str, int | None]:
    """Checkpoint tensor name (without ``model.``) -> (kiln parameter, shard index)."""
    m = _LAYER_RE.match(name)
    if m:
        prefix, proj, kind = m.groups()
        for merged, parts in DecoderModel.STACKED.items():
            if proj in parts:
                return f"{prefix}{merged}.{kind}", parts.index(proj)
    return name, None


def _checkpoint_name(param: str, shard: int | None) -> str:
    """Inverse of ``_target`` for error messages."""
    if shard is not None:
        for merged, parts in DecoderModel.STACKED.items():
            if f".{merged}." in param:
                param = param.replace(f".{merged}.", f".{parts[shard]}.")
    return param if param.startswith("lm_head") else _PREFIX + param


def load_model(
    path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device, max_len: int
) -> DecoderModel:
    files = checkpoint_files(path)
    with torch.device("meta"):
        model = DecoderModel(config, max_len)
    model = model.to_empty(device=device).to(dtype)
    model.rotary.cos = model.rotary.cos.float()
    model.rotary.sin = model.rotary.sin.float()
    model.rotary.reset_cache()

    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    # every (parameter, shard) that must be filled
    expected: set[tuple[str, int | None]] = set()
    for pname in params:
        owner = modules[pname.rsplit(".", 1)[0]]
        if isinstance(owner, MergedLinear):
            expected.update((pname, i) for i in range(len(owner.output_sizes)))
        else:
            expected.add((pname, None))
    loaded: set[tuple[str, int | None]] = set()

    with torch.no_grad():
        for file, raw_name, handle in _iter_tensors(files):
            name = raw_name[len(_PREFIX):] if raw_name.startswith(_PREFIX) else raw_name
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue  # some tied checkpoints store the shared matrix twice
            pname, shard = _target(name)
            if pname not in params:
                if name.endswith((".weight", ".bias")):
                    # A parameter the config does not account for (a bias, say): running
                    # without it would silently give wrong outputs.
                    raise CheckpointError(
                        f"{file}: tensor {raw_name!r} has no place in a {config.architecture} built "
                        "from config.json; the config and the weights disagree"
                    )
                logger.debug("ignoring tensor %s in %s", raw_name, file.name)
                continue
            param = params[pname]
            dest = param.data
            if shard is not None:
                owner = modules[pname.rsplit(".", 1)[0]]
                sizes = owner.output_sizes  # type: ignore[union-attr]
                start = sum(sizes[:shard])
                dest = dest.narrow(0, start, sizes[shard])
            try:
                tensor = handle.get_tensor(raw_name)
            except Exception as e:
                raise CheckpointError(f"{file}: tensor {raw_name!r} could not be read: {e}") from e
            if tuple(tensor.shape) != tuple(dest.shape):
                raise CheckpointError(
                    f"{file}: tensor {raw_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dest.shape)} from config.json"
                )
            dest.copy_(tensor)
            loaded.add((pname, shard))

    missing = sorted(expected - loaded, key=str)
    if missing:
        names = ", ".join(repr(_checkpoint_name(p, s)) for p, s in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        where = ", ".join(f.name for f in files)
        raise CheckpointError(f"{path}: tensor {names}{more} missing from the checkpoint ({where})")
    model.eval()
    model.requires_grad_(False)
    return model
