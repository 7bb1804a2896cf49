"""One decoder for the Llama family: Llama, Mistral, Qwen2 and Qwen3.

Token-flattened: ``forward(input_ids[T], positions[T]) -> hidden[T, hidden_size]``
where the T tokens of every scheduled request are concatenated. The model knows
nothing about requests, the KV cache or compilation: attention is one call to
``torch.ops.kiln.attention``, which finds its per-step metadata in the forward
context (through ``attend``). The differences between the families are config fields (QKV bias,
q/k RMSNorm, head_dim, tied embeddings, RoPE scaling, sliding window).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.kernels.attention import attend
from kiln.runtime.model_config import ModelConfig

__all__ = ["DecoderModel", "MergedLinear"]


class MergedLinear(nn.Linear):
    """A linear layer holding several checkpoint projections side by side along
    the output dimension (q/k/v, gate/up), so one GEMM replaces several."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics, then back to the activation dtype, as the checkpoints were trained.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin for positions ``[0, max_len)`` (half head_dim each)."""

    def __init__(self, config: ModelConfig, max_len: int) -> None:
        super().__init__()
        self.config = config
        self.max_len = max_len
        self.register_buffer("cos", torch.empty(max_len, config.head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_len, config.head_dim // 2), persistent=False)

    @torch.no_grad()
    def reset_cache(self) -> None:
        inv_freq, scale = self.config.rope.inv_freq_and_scale(
            self.config.head_dim, self.config.max_position_embeddings
        )
        t = torch.arange(self.max_len, dtype=torch.float32)
        freqs = t[:, None] * inv_freq[None, :]
        self.cos.copy_(freqs.cos() * scale)
        self.sin.copy_(freqs.sin() * scale)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.sliding_window = config.sliding_windows[layer_idx]
        self.qkv_proj = MergedLinear(
            config.hidden_size, [self.q_size, self.kv_size, self.kv_size], bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm: RMSNorm | None = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        out = torch.empty_like(q)
        attend(q, k, v, out, self.layer_idx, self.scale, self.sliding_window)
        return self.o_proj(out.view(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = MergedLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=config.mlp_bias
        )
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), positions, rotary)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    """The causal LM. Parameter names follow the checkpoint's, minus the ``model.``
    prefix, with q/k/v and gate/up merged (see ``MergedLinear``)."""

    # merged parameter -> the checkpoint projections it holds, in order
    STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, config: ModelConfig, max_len: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config, max_len)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, positions, self.rotary)
        return self.norm(h)

    def logits_weight(self) -> torch.Tensor:
        """The LM head's weight: the embedding's when they are tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.logits_weight())
