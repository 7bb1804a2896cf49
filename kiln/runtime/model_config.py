"""Reading a Hugging Face ``config.json`` into the fields kiln's decoder needs.

kiln parses the file itself rather than through ``transformers.AutoConfig`` so that
both spellings of the RoPE settings in the wild (``rope_theta``/``rope_scaling``
from before transformers 5, ``rope_parameters`` after) are handled explicitly, and
so that every error names the file and the field at fault.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ModelConfig",
    "RopeConfig",
    "SUPPORTED_ARCHITECTURES",
    "CheckpointError",
]

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


class CheckpointError(ValueError):
    """A checkpoint directory, its config or one of its tensors is unusable."""


def parse_dtype(value: "torch.dtype | str") -> torch.dtype:
    if isinstance(value, torch.dtype):
        if value not in _DTYPES.values():
            raise ValueError(f"dtype {value} is not supported; use float32, bfloat16 or float16")
        return value
    key = str(value).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"dtype {value!r} is not supported; use float32, bfloat16 or float16")
    return _DTYPES[key]


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def inv_freq_and_scale(self, head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
        """Inverse frequencies ([head_dim // 2], fp32) and the cos/sin multiplier,
        computed as transformers does for each RoPE type."""
        dim = head_dim
        base = self.theta
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if self.rope_type == "default":
            return inv_freq, 1.0
        if self.rope_type == "linear":
            return inv_freq / self.factor, 1.0
        if self.rope_type == "llama3":
            old_len = self.original_max_position_embeddings or max_position_embeddings
            low_wavelen = old_len / self.low_freq_factor
            high_wavelen = old_len / self.high_freq_factor
            wavelen = 2 * math.pi / inv_freq
            scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
            smooth = (old_len / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
            return torch.where(is_medium, smoothed, scaled), 1.0
        if self.rope_type == "yarn":
            return self._yarn(dim, max_position_embeddings)
        raise AssertionError(self.rope_type)  # parse() admits only the types above

    def _yarn(self, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
        base = self.theta
        original = self.original_max_position_embeddings or max_position_embeddings
        factor = self.factor

        def get_mscale(scale: float, mscale: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        attention_factor = self.attention_factor
        if attention_factor is None:
            if self.mscale and self.mscale_all_dim:
                attention_factor = get_mscale(factor, self.mscale) / get_mscale(factor, self.mscale_all_dim)
            else:
                attention_factor = get_mscale(factor)

        def correction_dim(num_rotations: float) -> float:
            return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
        extrapolation = 1.0 / pos_freqs
        interpolation = 1.0 / (factor * pos_freqs)
        extrapolation_factor = 1 - ramp
        inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
        return inv_freq, float(attention_factor)


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a decoder checkpoint, as kiln runs it."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: RopeConfig
    sliding_windows: tuple[int, ...]  # per layer; 0 = full attention
    hidden_act: str
    checkpoint_dtype: torch.dtype | None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bos_token_id: int | None = None

    def key_fields(self) -> dict[str, Any]:
        """The fields that change compiled code (for cache keys)."""
        d = asdict(self)
        d["rope"] = asdict(self.rope)
        d["checkpoint_dtype"] = str(self.checkpoint_dtype)
        d.pop("eos_token_ids")
        d.pop("bos_token_id")
        return d

    @classmethod
    def from_dir(cls, path: Path) -> "ModelConfig":
        if not path.exists():
            raise CheckpointError(f"model directory {path} does not exist")
        if not path.is_dir():
            raise CheckpointError(f"model path {path} is not a directory")
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{cfg_path} is missing: a Hugging Face checkpoint needs its config.json")
        try:
            raw = json.loads(cfg_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{cfg_path} is not readable JSON: {e}") from e
        gen_path = path / "generation_config.json"
        gen: dict[str, Any] = {}
        if gen_path.is_file():
            try:
                gen = json.loads(gen_path.read_text())
            except (OSError, json.JSONDecodeError):
                gen = {}
        return cls.from_dict(raw, source=str(cfg_path), generation_config=gen)

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], source: str = "config.json", generation_config: dict[str, Any] | None = None
    ) -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise CheckpointError(
                f"{source}: architecture {archs or raw.get('model_type')!r} is not supported; "
                f"kiln runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        def need(name: str) -> Any:
            if raw.get(name) is None:
                raise CheckpointError(f"{source}: required field {name!r} is missing")
            return raw[name]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise CheckpointError(
                f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        num_layers = int(need("num_hidden_layers"))
        max_pos = int(raw.get("max_position_embeddings") or 2048)
        act = raw.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise CheckpointError(f"{source}: hidden_act={act!r} is not supported (silu only)")

        dtype_name = raw.get("dtype") or raw.get("torch_dtype")
        checkpoint_dtype = parse_dtype(dtype_name) if dtype_name else None

        # Qwen2 always has q/k/v bias and never an o_proj one; Llama and Qwen3 put
        # `attention_bias` on all four projections; Mistral has none.
        attention_bias = bool(raw.get("attention_bias", False)) and arch != "MistralForCausalLM"
        qkv_bias = arch == "Qwen2ForCausalLM" or attention_bias
        o_proj_bias = attention_bias and arch != "Qwen2ForCausalLM"
        mlp_bias = arch == "LlamaForCausalLM" and bool(raw.get("mlp_bias", False))

        gen = generation_config or {}
        eos = gen.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None)

        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_proj_bias=o_proj_bias,
            mlp_bias=mlp_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            rope=_parse_rope(raw, source, max_pos),
            sliding_windows=_parse_sliding_windows(raw, arch, num_layers),
            hidden_act="silu",
            checkpoint_dtype=checkpoint_dtype,
            eos_token_ids=eos_ids,
            bos_token_id=gen.get("bos_token_id", raw.get("bos_token_id")),
        )


def _parse_rope(raw: dict[str, Any], source: str, max_pos: int) -> RopeConfig:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        # transformers 5 nests per layer type; the four families use one RoPE for all.
        distinct = {json.dumps(v, sort_keys=True) for v in params.values()}
        if len(distinct) != 1:
            raise CheckpointError(f"{source}: per-layer-type rope_parameters are not supported")
        params = next(iter(params.values()))
    if not params:
        params = dict(raw.get("rope_scaling") or {})
    else:
        params = dict(params)
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"{source}: RoPE type {rope_type!r} is not supported; kiln runs {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) not in (1, 1.0, None):
        raise CheckpointError(f"{source}: partial_rotary_factor other than 1.0 is not supported")
    original = params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    if rope_type in ("llama3", "yarn") and original is None:
        original = max_pos
    factor = params.get("factor")
    if rope_type in ("linear", "llama3") and factor is None:
        raise CheckpointError(f"{source}: RoPE type {rope_type!r} needs a 'factor'")
    if rope_type == "yarn" and factor is None:
        factor = max_pos / original
    opt = lambda k, d: d if params.get(k) is None else params[k]  # noqa: E731
    return RopeConfig(
        rope_type=rope_type,
        theta=float(theta),
        factor=float(factor if factor is not None else 1.0),
        low_freq_factor=float(opt("low_freq_factor", 1.0)),
        high_freq_factor=float(opt("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original) if original is not None else None,
        attention_factor=params.get("attention_factor"),
        beta_fast=float(opt("beta_fast", 32.0)),
        beta_slow=float(opt("beta_slow", 1.0)),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(opt("truncate", True)),
    )


def _parse_sliding_windows(raw: dict[str, Any], arch: str, num_layers: int) -> tuple[int, ...]:
    window = raw.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not raw.get("use_sliding_window", False):
        window = None
    if not window:
        return (0,) * num_layers
    layer_types = raw.get("layer_types")
    if layer_types and len(layer_types) == num_layers:
        return tuple(int(window) if t == "sliding_attention" else 0 for t in layer_types)
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        first = int(raw.get("max_window_layers", num_layers))
        return tuple(int(window) if i >= first else 0 for i in range(num_layers))
    return (int(window),) * num_layers
