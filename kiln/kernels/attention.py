"""The one attention op every kiln model calls.

``torch.ops.kiln.attention(q, k, v, out, layer_idx, scale, sliding_window)``
writes this step's K/V into the paged cache and fills ``out`` with attention over
each request's cached context. Its per-step inputs (slot mapping, block table,
sequence lengths) come from the forward context, so the op's signature, and with it
the traced graph, does not change from step to step. Dynamo keeps it as one opaque
node, which is where the compiler splits the graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.forward_context import AttentionMetadata, get_forward_context
from kiln.kernels.backends import TorchAttentionBackend

__all__ = ["EAGER_IMPLEMENTATIONS", "attend", "attention", "write_kv_cache", "paged_attention_torch"]


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
    meta: AttentionMetadata,
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
    qsl, seq_lens, nblocks = meta.query_start_loc_cpu, meta.seq_lens_cpu, meta.num_blocks_cpu
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    for i in range(meta.num_reqs):
        start, end = qsl[i], qsl[i + 1]
        q_len, ctx = end - start, seq_lens[i]
        if q_len == 0:
            continue
        blocks = meta.block_table[i, : nblocks[i]]
        k = key_cache.index_select(0, blocks).flatten(0, 1)[:ctx]
        v = value_cache.index_select(0, blocks).flatten(0, 1)[:ctx]
        first_pos = ctx - q_len
        mask = None
        if q_len > 1 or (sliding_window > 0 and ctx > sliding_window):
            q_pos = torch.arange(first_pos, ctx, device=query.device)[:, None]
            k_pos = torch.arange(ctx, device=query.device)[None, :]
            mask = k_pos <= q_pos
            if sliding_window > 0:
                mask &= k_pos > q_pos - sliding_window
            mask = mask.repeat(group, 1)
        # [q_len, H, D] -> [1, KV, group * q_len, D]: each KV head serves `group` query
        # heads. 4-D inputs let SDPA take its fused CPU kernel.
        q = query[start:end].view(q_len, num_kv_heads, group, head_dim)
        q = q.permute(1, 2, 0, 3).reshape(1, num_kv_heads, group * q_len, head_dim)
        o = F.scaled_dot_product_attention(
            q, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=scale
        )
        o = o.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)
        out[start:end].copy_(o.reshape(q_len, num_heads, head_dim))


def _attention_impl(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    layer_idx: int,
    scale: float,
    sliding_window: int,
) -> None:
    """Paged attention for layer ``layer_idx``; ``sliding_window <= 0`` means none.
    The backend comes from the forward context (torch when it names none)."""
    ctx = get_forward_context()
    meta = ctx.attn_metadata
    if meta is None:  # a profiling or tracing run with no requests behind it
        out.zero_()
        return
    backend = ctx.attention_backend or _TORCH_BACKEND
    backend.forward(query, key, value, out, ctx.kv_caches[layer_idx], meta, scale, sliding_window)


def _attention_fake(query, key, value, out, layer_idx, scale, sliding_window) -> None:  # noqa: ANN001
    return None


_TORCH_BACKEND = TorchAttentionBackend()

# Registered through torch.library.Library rather than @custom_op: the decorator's
# Python dispatch layers cost ~90 us a call, paid by every layer of every eager step.
_LIB = torch.library.Library("kiln", "FRAGMENT")
_LIB.define(
    "attention(Tensor query, Tensor key, Tensor value, Tensor(a!) out, int layer_idx, "
    "float scale, int sliding_window) -> ()"
)
for _key in ("CPU", "CUDA"):
    _LIB.impl("attention", _attention_impl, _key)
torch.library.register_fake("kiln::attention", _attention_fake, lib=_LIB)

attention = torch.ops.kiln.attention
# op name -> the Python function behind it, for the compiler to call directly in
# the eager attention pieces (skipping the dispatcher's round trip, ~80 us a call)
EAGER_IMPLEMENTATIONS = {"kiln::attention": _attention_impl}


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    layer_idx: int,
    scale: float,
    sliding_window: int,
) -> None:
    """What model code calls. Under tracing it records the ``kiln::attention`` op
    (the compiler's split point); run eagerly it calls the implementation
    directly, skipping the dispatcher's round trip through Python."""
    if torch.compiler.is_compiling():
        torch.ops.kiln.attention(query, key, value, out, layer_idx, scale, sliding_window)
    else:
        _attention_impl(query, key, value, out, layer_idx, scale, sliding_window)
