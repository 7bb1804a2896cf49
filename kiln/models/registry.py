"""From a checkpoint's config to a model: which architecture, its config, and the
built model with its weights.

Each architecture lives in one module (``llama``, ``mistral``, ``qwen2``,
``qwen3``) that declares an ``Architecture``: its Hugging Face class name, its
``model_type``, how its config reads, and the model class. Adding one is one file
and one line in ``_MODULES``.
"""

from __future__ import annotations

import importlib
import logging
from collections import Counter
from typing import Any

import torch

from kiln.checkpoint import Checkpoint, CheckpointError
from kiln.models.config import ConfigFields, ModelConfig
from kiln.models.interface import Architecture, CausalLM
from kiln.models.memory import materialize

__all__ = ["ARCHITECTURES", "build_model", "config_from_dict", "find_architecture", "parse_model_config"]

logger = logging.getLogger(__name__)


_MODULES = ("llama", "mistral", "qwen2", "qwen3")
ARCHITECTURES: dict[str, Architecture] = {}
for _name in _MODULES:
    _arch: Architecture = importlib.import_module(f"kiln.models.{_name}").ARCHITECTURE
    ARCHITECTURES[_arch.name] = _arch


def find_architecture(raw: dict[str, Any], source: str) -> Architecture:
    """The architecture named by ``architectures`` (else by ``model_type``)."""
    archs = raw.get("architectures") or []
    if not isinstance(archs, list):
        raise CheckpointError(f"{source}: field 'architectures' must be a list, got {archs!r}")
    for a in archs:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    if not archs:
        by_type = {a.model_type: a for a in ARCHITECTURES.values()}
        if raw.get("model_type") in by_type:
            return by_type[raw["model_type"]]
    raise CheckpointError(
        f"{source}: architecture {archs or raw.get('model_type')!r} is not supported; "
        f"kiln runs {', '.join(ARCHITECTURES)}"
    )


def config_from_dict(raw: dict[str, Any], source: str = "config.json",
                     generation_config: dict[str, Any] | None = None) -> ModelConfig:
    """The model config of a ``config.json`` dict (``source`` names it in errors)."""
    arch = find_architecture(raw, source)
    return arch.parse_config(ConfigFields(raw, source), generation_config or {})


def parse_model_config(checkpoint: Checkpoint) -> ModelConfig:
    return config_from_dict(checkpoint.config(), checkpoint.config_source(), checkpoint.generation_config())


def build_model(
    config: ModelConfig, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device, rope_positions: int,
    *, weights: bool = True, quantization: str | None = None,
) -> CausalLM:
    """The model with its weights, on ``device`` in ``dtype``. Built on the meta
    device first (no random init), its linear layers packed as ``quantization``
    asks (``kiln.models.quant``), materialised uninitialised (on CPU in one
    huge-page block, ``kiln.models.memory``), then every parameter is filled
    from the checkpoint exactly once (without ``weights``, only checked against
    the checkpoint's names and shapes and left uninitialised: what a compile
    needs, as compiled code does not depend on weight values)."""
    arch = ARCHITECTURES[config.architecture]
    with checkpoint.reader() as reader:
        with torch.device("meta"):
            model = arch.model_class(config, rope_positions)
            if quantization is not None:
                plan = model.quantize(quantization, reader.tensors())
                counts = sorted(Counter(plan.values()).items())
                logger.info("quantization=%s: %s", quantization,
                            ", ".join(f"{n} {f}" for f, n in counts) or "no layer packed")
        model = materialize(model, device, dtype)
        model.reset_buffers()
        model.load_weights(reader, read=weights)
    model.eval()
    model.requires_grad_(False)
    return model
