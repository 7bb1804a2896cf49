"""Qwen2 (``Qwen2ForCausalLM``): biases on q/k/v, never on o_proj; a sliding
window only with ``use_sliding_window``, on the layers from
``max_window_layers`` on."""

from __future__ import annotations

from typing import Any

from kiln.models.config import ConfigFields, ModelConfig, parse_common, sliding_windows
from kiln.models.decoder import DecoderModel
from kiln.models.interface import Architecture


def qwen_sliding_windows(f: ConfigFields) -> tuple[int, ...]:
    """Qwen's rule, shared with Qwen3."""
    num_layers = f.int("num_hidden_layers")
    if not f.bool("use_sliding_window", False):
        return (0,) * num_layers
    return sliding_windows(f, first_layer=f.int("max_window_layers", num_layers, minimum=0))


def parse_config(f: ConfigFields, generation: dict[str, Any]) -> ModelConfig:
    return parse_common(
        f, ARCHITECTURE.name, qkv_bias=True, o_proj_bias=False, mlp_bias=False, qk_norm=False,
        sliding_windows=qwen_sliding_windows(f), generation_config=generation,
    )


ARCHITECTURE = Architecture("Qwen2ForCausalLM", "qwen2", parse_config, DecoderModel)
