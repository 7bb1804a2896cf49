"""Mistral (``MistralForCausalLM``): no biases; a sliding window on every layer
when ``sliding_window`` is set."""

from __future__ import annotations

from typing import Any

from kiln.models.config import ConfigFields, ModelConfig, parse_common, sliding_windows
from kiln.models.decoder import DecoderModel
from kiln.models.interface import Architecture


def parse_config(f: ConfigFields, generation: dict[str, Any]) -> ModelConfig:
    return parse_common(
        f, ARCHITECTURE.name, qkv_bias=False, o_proj_bias=False, mlp_bias=False, qk_norm=False,
        sliding_windows=sliding_windows(f), generation_config=generation,
    )


ARCHITECTURE = Architecture("MistralForCausalLM", "mistral", parse_config, DecoderModel)
