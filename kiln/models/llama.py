"""Llama (``LlamaForCausalLM``): optional biases on the attention projections
(``attention_bias``) and on the MLP (``mlp_bias``)."""

from __future__ import annotations

from typing import Any

from kiln.models.config import ConfigFields, ModelConfig, parse_common, sliding_windows
from kiln.models.decoder import DecoderModel
from kiln.models.interface import Architecture


def parse_config(f: ConfigFields, generation: dict[str, Any]) -> ModelConfig:
    bias = f.bool("attention_bias", False)
    return parse_common(
        f, ARCHITECTURE.name, qkv_bias=bias, o_proj_bias=bias, mlp_bias=f.bool("mlp_bias", False),
        qk_norm=False, sliding_windows=sliding_windows(f), generation_config=generation,
    )


ARCHITECTURE = Architecture("LlamaForCausalLM", "llama", parse_config, DecoderModel)
