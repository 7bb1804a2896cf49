"""Qwen3 (``Qwen3ForCausalLM``): RMSNorm on each head's q and k before RoPE;
optional biases on the attention projections (``attention_bias``); Qwen's
sliding-window rule."""

from __future__ import annotations

from typing import Any

from kiln.models.config import ConfigFields, ModelConfig, parse_common
from kiln.models.decoder import DecoderModel
from kiln.models.interface import Architecture
from kiln.models.qwen2 import qwen_sliding_windows


def parse_config(f: ConfigFields, generation: dict[str, Any]) -> ModelConfig:
    bias = f.bool("attention_bias", False)
    return parse_common(
        f, ARCHITECTURE.name, qkv_bias=bias, o_proj_bias=bias, mlp_bias=False, qk_norm=True,
        sliding_windows=qwen_sliding_windows(f), generation_config=generation,
    )


ARCHITECTURE = Architecture("Qwen3ForCausalLM", "qwen3", parse_config, DecoderModel)
