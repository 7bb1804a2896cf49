"""Layers shared by the Llama-family decoders."""

from __future__ import annotations

import torch
from torch import nn

from kiln.models.config import ModelConfig

__all__ = ["MergedLinear", "RMSNorm", "RotaryEmbedding"]


class MergedLinear(nn.Linear):
    """A linear layer holding several checkpoint projections side by side along
    the output dimension (q/k/v, gate/up), so one GEMM replaces several."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)

    def shard(self, param: torch.Tensor, index: int) -> torch.Tensor:
        """The rows of ``param`` (this layer's weight or bias) that projection
        ``index`` fills."""
        start = sum(self.output_sizes[:index])
        return param.narrow(0, start, self.output_sizes[index])


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
    """Precomputed fp32 cos/sin for positions ``[0, max_len)`` (half head_dim each)."""

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
        # fp32 whatever the model's dtype: the tables are cast per step, as transformers does
        self.cos = (freqs.cos() * scale).to(self.cos.device)
        self.sin = (freqs.sin() * scale).to(self.sin.device)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
