"""The model config kiln's decoder runs from, and the typed reading of a Hugging
Face ``config.json`` into it.

kiln parses the file itself rather than through ``transformers.AutoConfig`` so that
both spellings of the RoPE settings in the wild (``rope_theta``/``rope_scaling``
from before transformers 5, ``rope_parameters`` after) are handled explicitly, and
so that every error, a wrong type included, names the file and the field at fault.
What differs between architectures (biases, q/k norm, sliding windows) is decided
by each architecture's module (``kiln.models.llama`` and its siblings).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kiln.checkpoint import CheckpointError

__all__ = ["ConfigFields", "ModelConfig", "RopeConfig", "parse_dtype", "parse_common", "sliding_windows"]

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


_MISSING = object()


class ConfigFields:
    """Typed access to a raw ``config.json`` dict: every error names the file
    (``source``) and the field, with the value found."""

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source

    def error(self, message: str) -> CheckpointError:
        return CheckpointError(f"{self.source}: {message}")

    def _get(self, name: str, default: Any) -> Any:
        value = self.raw.get(name)
        if value is None:
            if default is _MISSING:
                raise self.error(f"required field {name!r} is missing")
            return default
        return value

    def int(self, name: str, default: Any = _MISSING, minimum: int = 1) -> int:
        value = self._get(name, default)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(f"field {name!r} must be an integer >= {minimum}, got {value!r}")
        return value

    def float(self, name: str, default: Any = _MISSING) -> float:
        value = self._get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise self.error(f"field {name!r} must be a number, got {value!r}")
        return float(value)

    def bool(self, name: str, default: bool = False) -> bool:
        value = self._get(name, default)
        if not isinstance(value, bool):
            raise self.error(f"field {name!r} must be true or false, got {value!r}")
        return value

    def str(self, name: str, default: Any = _MISSING) -> str:
        value = self._get(name, default)
        if not isinstance(value, str):
            raise self.error(f"field {name!r} must be a string, got {value!r}")
        return value

    def token_ids(self, name: str, generation: dict[str, Any] | None = None) -> tuple[int, ...]:
        """An id or a list of ids (EOS may be either); ``generation`` wins when it sets it."""
        value = (generation or {}).get(name, self.raw.get(name))
        values = value if isinstance(value, list) else [value]
        if any(v is not None and (isinstance(v, bool) or not isinstance(v, int)) for v in values):
            raise self.error(f"field {name!r} must be a token id or a list of them, got {value!r}")
        return tuple(v for v in values if v is not None)


def parse_common(
    f: ConfigFields,
    architecture: str,
    *,
    qkv_bias: bool,
    o_proj_bias: bool,
    mlp_bias: bool,
    qk_norm: bool,
    sliding_windows: tuple[int, ...],
    generation_config: dict[str, Any] | None = None,
) -> ModelConfig:
    """The fields every Llama-family config spells the same way; the
    architecture module decides the rest."""
    hidden = f.int("hidden_size")
    heads = f.int("num_attention_heads")
    kv_heads = f.int("num_key_value_heads", heads)
    if heads % kv_heads:
        raise f.error(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    head_dim = f.int("head_dim", hidden // heads)
    max_pos = f.int("max_position_embeddings", 2048)
    act = f.str("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise f.error(f"hidden_act={act!r} is not supported (silu only)")
    dtype_name = f.raw.get("dtype") or f.raw.get("torch_dtype")
    try:
        checkpoint_dtype = parse_dtype(dtype_name) if dtype_name else None
    except ValueError as e:
        raise f.error(f"field 'torch_dtype': {e}") from None
    bos = f.token_ids("bos_token_id", generation_config)
    return ModelConfig(
        architecture=architecture,
        vocab_size=f.int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=f.int("intermediate_size"),
        num_layers=len(sliding_windows),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=f.float("rms_norm_eps", 1e-6),
        max_position_embeddings=max_pos,
        tie_word_embeddings=f.bool("tie_word_embeddings", False),
        qkv_bias=qkv_bias,
        o_proj_bias=o_proj_bias,
        mlp_bias=mlp_bias,
        qk_norm=qk_norm,
        rope=parse_rope(f, max_pos),
        sliding_windows=sliding_windows,
        checkpoint_dtype=checkpoint_dtype,
        eos_token_ids=f.token_ids("eos_token_id", generation_config),
        bos_token_id=bos[0] if bos else None,
    )


def parse_rope(f: ConfigFields, max_pos: int) -> RopeConfig:
    raw, source = f.raw, f.source
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        # transformers 5 nests per layer type; the four families use one RoPE for all.
        distinct = {json.dumps(v, sort_keys=True) for v in params.values()}
        if len(distinct) != 1:
            raise CheckpointError(f"{source}: per-layer-type rope_parameters are not supported")
        params = next(iter(params.values()))
    if not params:
        params = raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise f.error(f"field 'rope_parameters'/'rope_scaling' must be an object, got {params!r}")
    p = ConfigFields({**{k: raw[k] for k in ("rope_theta", "partial_rotary_factor",
                                              "original_max_position_embeddings") if k in raw}, **params},
                     f"{source} (RoPE settings)")
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"{source}: RoPE type {rope_type!r} is not supported; kiln runs {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if p.float("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError(f"{source}: partial_rotary_factor other than 1.0 is not supported")
    original = p.int("original_max_position_embeddings", max_pos if rope_type in ("llama3", "yarn") else 0,
                     minimum=0) or None
    if rope_type in ("linear", "llama3") and params.get("factor") is None:
        raise CheckpointError(f"{source}: RoPE type {rope_type!r} needs a 'factor'")
    default_factor = max_pos / original if rope_type == "yarn" and original else 1.0
    attention_factor = params.get("attention_factor")
    return RopeConfig(
        rope_type=rope_type,
        theta=p.float("rope_theta", 10000.0),
        factor=p.float("factor", default_factor),
        low_freq_factor=p.float("low_freq_factor", 1.0),
        high_freq_factor=p.float("high_freq_factor", 4.0),
        original_max_position_embeddings=original,
        attention_factor=None if attention_factor is None else p.float("attention_factor"),
        beta_fast=p.float("beta_fast", 32.0),
        beta_slow=p.float("beta_slow", 1.0),
        mscale=None if params.get("mscale") is None else p.float("mscale"),
        mscale_all_dim=None if params.get("mscale_all_dim") is None else p.float("mscale_all_dim"),
        truncate=p.bool("truncate", True),
    )


def sliding_windows(f: ConfigFields, first_layer: int = 0) -> tuple[int, ...]:
    """Each layer's window (0 = full attention): ``sliding_window`` on the layers
    ``layer_types`` marks sliding, else on every layer from ``first_layer`` on."""
    num_layers = f.int("num_hidden_layers")
    window = f.int("sliding_window", 0, minimum=0)
    if not window:
        return (0,) * num_layers
    layer_types = f.raw.get("layer_types")
    if isinstance(layer_types, list) and len(layer_types) == num_layers:
        return tuple(window if t == "sliding_attention" else 0 for t in layer_types)
    return tuple(window if i >= first_layer else 0 for i in range(num_layers))
