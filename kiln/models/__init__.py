"""Models: the interface the runner and compiler call, the Llama-family decoder,
per-architecture config reading, and the registry from a checkpoint's config to
a built model."""

from kiln.models.config import ModelConfig, parse_dtype
from kiln.models.interface import Architecture, CausalLM
from kiln.models.registry import ARCHITECTURES, build_model, config_from_dict, find_architecture, parse_model_config

__all__ = [
    "ARCHITECTURES", "Architecture", "CausalLM", "ModelConfig", "build_model", "config_from_dict", "find_architecture",
    "parse_dtype", "parse_model_config",
]
