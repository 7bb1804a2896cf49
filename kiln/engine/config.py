"""One frozen resolved config: the model, the engine sizes and the compilation
settings every later load step reads, decided once from the user's options, the
checkpoint and the device, and never changed afterwards."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from kiln.cache.keys import cache_factors
from kiln.config import CompilationConfig, EngineConfig, SpeculativeConfig
from kiln.engine.request import SamplingParams
from kiln.models import ModelConfig, parse_dtype
from kiln.models.quant import QUANTIZATION_PLAN_VERSION

__all__ = ["ResolvedConfig", "kv_bytes_per_block", "resolve_engine_sizes", "sampling_defaults"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResolvedConfig:
    model: ModelConfig
    compilation: CompilationConfig  # resolved: every field set
    device: torch.device
    dtype: torch.dtype
    attention_backend: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_kv_blocks: int | None  # None: sized from free GPU memory once the model is built
    kv_cache_memory_bytes: int | None
    gpu_memory_utilization: float
    seed: int
    enable_prefix_caching: bool
    speculative: SpeculativeConfig | None  # speculative decoding (prompt lookup), or None
    # RoPE tables cover every position the checkpoint knows, whatever max_model_len
    # is: the table is a graph input, and its shape must not tie compiled code to
    # one engine setting.
    rope_positions: int
    eos_token_ids: tuple[int, ...]
    # what compiled code depends on beyond the model config (a GGUF's tensor layout)
    checkpoint_identity: dict[str, Any]
    quantization: str | None  # packed linear layers (kiln.models.quant.QUANTIZATION_MODES), or None
    # SamplingParams fields the checkpoint sets for callers that set none, and
    # where each came from ({"temperature": (0.2, "generation_config.json")})
    sampling_defaults: dict[str, tuple[Any, str]]

    def cache_factors(self) -> dict[str, Any]:
        """What the compiled code depends on (the cache key's input)."""
        model_fields = {**self.model.key_fields(), "rope_positions": self.rope_positions,
                        "checkpoint": self.checkpoint_identity}
        if self.quantization is not None:  # absent when dense: keys of dense entries stay as they were
            model_fields["quantization"] = {"mode": self.quantization, "plan": QUANTIZATION_PLAN_VERSION}
        return cache_factors(model_fields, self.dtype, self.compilation.to_dict(), self.device)

    def to_dict(self) -> dict[str, Any]:
        """The readable form, for the startup report."""
        return {
            "architecture": self.model.architecture,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "quantization": self.quantization,
            "attention_backend": self.attention_backend,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "block_size": self.block_size,
            "num_kv_blocks": self.num_kv_blocks,
            "seed": self.seed,
            "enable_prefix_caching": self.enable_prefix_caching,
            "speculative_config": self.speculative.to_dict() if self.speculative is not None else None,
            "eos_token_ids": list(self.eos_token_ids),
            "sampling_defaults": {k: {"value": v, "source": src} for k, (v, src) in self.sampling_defaults.items()},
            "compilation": self.compilation.to_dict(),
        }


def kv_bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * itemsize


def resolve_dtype(dtype: "torch.dtype | str | None", model: ModelConfig, device: torch.device) -> torch.dtype:
    if dtype is not None:
        return parse_dtype(dtype)
    ckpt = model.checkpoint_dtype or torch.float32
    if device.type == "cpu" and ckpt == torch.float16:
        return torch.float32  # CPU fp16 GEMMs are slow and lossy; fp32 is the safe default
    return ckpt


@dataclass(frozen=True)
class EngineSizes:
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_kv_blocks: int | None


def _kv_blocks(user: EngineConfig, per_block: int, useful: int, device: torch.device) -> int | None:
    """Blocks the cache gets: the user's count, else what the memory budget holds
    (never more than every sequence at full length needs); None on a GPU
    without a fixed budget, sized later from free memory."""
    if user.num_kv_blocks is not None:
        return user.num_kv_blocks
    if device.type == "cuda" and user.kv_cache_memory_bytes is None:
        return None
    budget = user.kv_cache_memory_bytes or EngineConfig.DEFAULT_CPU_KV_BYTES
    if budget < per_block:
        raise ValueError(
            f"the KV cache budget ({budget} bytes) holds no block of {per_block} bytes; "
            "raise kv_cache_memory_bytes / gpu_memory_utilization or set num_kv_blocks"
        )
    return min(useful, budget // per_block)


def resolve_engine_sizes(user: EngineConfig, model: ModelConfig, dtype: torch.dtype,
                         device: torch.device) -> EngineSizes:
    """The scheduler's budgets and the KV cache's shape from the user's settings,
    the checkpoint and the memory budget."""
    block = user.block_size or EngineConfig.DEFAULT_BLOCK_SIZE
    default_seqs = EngineConfig.DEFAULT_MAX_NUM_SEQS_CUDA if device.type == "cuda" else EngineConfig.DEFAULT_MAX_NUM_SEQS
    batched = user.max_num_batched_tokens or EngineConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS
    seqs = min(user.max_num_seqs or default_seqs, batched)
    if user.max_model_len is not None and user.max_model_len > model.max_position_embeddings:
        logger.warning("max_model_len=%d exceeds the checkpoint's max_position_embeddings=%d",
                       user.max_model_len, model.max_position_embeddings)
    max_len = user.max_model_len or model.max_position_embeddings
    blocks = _kv_blocks(user, kv_bytes_per_block(model, block, dtype), seqs * -(-max_len // block), device)
    if blocks is not None and max_len > blocks * block:
        if user.max_model_len is not None:
            raise ValueError(
                f"max_model_len={max_len} needs {-(-max_len // block)} KV blocks of {block} tokens, "
                f"the cache holds {blocks}; raise num_kv_blocks or the memory budget, or lower max_model_len"
            )
        logger.warning(
            "max_model_len capped at %d tokens (the checkpoint allows %d): the KV cache holds %d blocks "
            "of %d tokens; raise num_kv_blocks or kv_cache_memory_bytes for longer sequences",
            blocks * block, max_len, blocks, block,
        )
        max_len = blocks * block
    return EngineSizes(max_len, seqs, batched, block, blocks)


# generation_config.json keys that become SamplingParams defaults, as vLLM takes them
_SAMPLING_KEYS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "repetition_penalty": float}


def sampling_defaults(generation_config: dict[str, Any], source: str) -> dict[str, tuple[Any, str]]:
    """The sampling defaults a checkpoint declares (invalid values are ignored
    with a warning: they are advice, not the model's shape)."""
    out: dict[str, tuple[Any, str]] = {}
    for key, kind in _SAMPLING_KEYS.items():
        value = generation_config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            logger.warning("%s: %s=%r is not a %s; ignored", source, key, value, kind.__name__)
            continue
        try:
            SamplingParams(**{key: kind(value)}).validate(source)
        except ValueError as e:
            logger.warning("%s; ignored", e)
            continue
        out[key] = (kind(value), source)
    return out
