"""The torch attention backend: the reference, and the CPU path.

It walks requests in Python with host-side lengths (one SDPA call per request),
so it can never sit inside a FULL CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kiln.attention.backend import AttentionBackend, CommonAttentionMetadata
from kiln.config import CUDAGraphSupport

__all__ = ["TorchAttentionBackend", "TorchAttentionMetadata", "paged_attention_torch", "write_kv_cache"]


@dataclass(frozen=True)
class TorchAttentionMetadata:
    num_actual_tokens: int
    num_reqs: int
    query_start_loc: list[int]  # host
    seq_lens: list[int]  # host
    num_blocks: list[int]  # host: blocks each request's context spans
    block_table: torch.Tensor  # device
    slot_mapping: torch.Tensor  # device


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` rows ([T, kv_heads, head_dim]) into the cache
    ([2, blocks, block_size, kv_heads, head_dim]) at ``slot_mapping[:T]``.

    Every slot must be a real one: callers pass only the step's actual tokens
    (padding rows, slot -1, are sliced off before), which spares a device-to-host
    check of the slots on every layer of every step."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    slots = slot_mapping[:num_tokens]
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    flat[0].index_copy_(0, slots, key)
    flat[1].index_copy_(0, slots, value)


def paged_attention_torch(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    meta: TorchAttentionMetadata,
    scale: float,
    sliding_window: int,
) -> None:
    """Reference attention over the paged cache, one SDPA call per request.

    Queries of a request are the last ``q_len`` positions of its ``seq_len``-long
    context, so a prefill chunk sees its cached prefix plus itself causally and a
    decode token sees everything. Grouped-query heads are folded into the query
    length instead of repeating K/V.
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[-2]
    group = num_heads // num_kv_heads
    qsl, seq_lens, nblocks = meta.query_start_loc, meta.seq_lens, meta.num_blocks
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    for i in range(meta.num_reqs):
        start, end = qsl[i], qsl[i + 1]
        q_len, ctx = end - start, seq_lens[i]
        if q_len == 0:
            continue
        blocks = meta.block_table[i, : nblocks[i]]
        k = key_cache.index_select(0, blocks).flatten(0, 1)[:ctx]
        v = value_cache.index_select(0, blocks).flatten(0, 1)[:ctx]
        mask = _mask(ctx, q_len, sliding_window, group, query.device)
        # [q_len, H, D] -> [1, KV, group * q_len, D]: each KV head serves `group` query
        # heads. 4-D inputs let SDPA take its fused CPU kernel.
        q = query[start:end].view(q_len, num_kv_heads, group, head_dim)
        q = q.permute(1, 2, 0, 3).reshape(1, num_kv_heads, group * q_len, head_dim)
        o = F.scaled_dot_product_attention(
            q, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=scale
        )
        o = o.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)
        out[start:end].copy_(o.reshape(q_len, num_heads, head_dim))


def _mask(ctx: int, q_len: int, sliding_window: int, group: int, device: torch.device) -> torch.Tensor | None:
    """Causal (and sliding-window) mask of ``q_len`` queries at the end of a
    ``ctx``-long context, repeated per grouped head; None when nothing is masked."""
    if q_len == 1 and not (sliding_window > 0 and ctx > sliding_window):
        return None
    q_pos = torch.arange(ctx - q_len, ctx, device=device)[:, None]
    k_pos = torch.arange(ctx, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window > 0:
        mask &= k_pos > q_pos - sliding_window
    return mask.repeat(group, 1)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    cudagraph_support = CUDAGraphSupport.NEVER

    def build_metadata(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        seq_lens = common.seq_lens_cpu.tolist()
        bs = common.block_size
        return TorchAttentionMetadata(
            num_actual_tokens=common.num_actual_tokens,
            num_reqs=common.num_reqs,
            query_start_loc=common.query_start_loc_cpu.tolist(),
            seq_lens=seq_lens,
            num_blocks=[-(-n // bs) for n in seq_lens],
            block_table=common.block_table,
            slot_mapping=common.slot_mapping,
        )

    def forward(self, query, key, value, out, kv_cache, meta, scale, sliding_window) -> None:  # noqa: ANN001
        # Only real rows: the padding beyond them never reaches the cache, so the
        # write needs no per-step check for negative slots.
        n = meta.num_actual_tokens
        write_kv_cache(key[:n], value[:n], kv_cache, meta.slot_mapping)
        paged_attention_torch(query[:n], kv_cache, out, meta, scale, sliding_window)
