"""Triton kernels for the paged KV cache: the K/V scatter and varlen paged attention.

Both entry points are meant to run inside a captured CUDA graph, which dictates
their shape more than speed does:

* **No host round trips and no allocation.** A graph replays the launches it
  recorded, so anything computed on the host from tensor *values* (``.item()``,
  ``.tolist()``, a max query length, a per-request loop) would be frozen at capture
  time, and an allocation during capture would come from the graph's private pool.
  The Python wrappers therefore only look at shapes, dtypes and strides, and each
  launches exactly one kernel whose grid depends only on ``query.shape[0]``,
  ``num_reqs`` and compile-time constants.

* **One launch for the whole mixed batch.** Prefill chunks (which attend to their
  cached prefix and causally to themselves) and single-token decodes go through
  the same kernel. Per-request work is discovered *in the kernel*: request ``i``
  is given the virtual tiles ``qsl[i] // BLOCK_Q + i ...``, an upper bound on the
  ``ceil(q_len / BLOCK_Q)`` tiles it needs that is monotone in ``i``; a program
  binary-searches ``query_start_loc`` for the request owning its tile id. Summed
  over requests this is at most ``T // BLOCK_Q + num_reqs`` tiles, so that is the
  grid; programs whose tile lies past their request's queries return at once.
  The surplus is cheap (an early exit) and buys a value-independent grid.

* **Grouped-query heads are folded into the tile rows.** A program owns one KV
  head and ``BLOCK_Q`` query tokens of one request, i.e. ``BLOCK_Q * group`` rows
  (row ``m`` is token ``m // group``, query head ``m % group`` of the KV head's
  group). Every K/V tile loaded from the cache then serves the whole group, which
  is where a decode step spends its time; it also keeps the MMA's M dimension at
  a tensor-core friendly size even for single-token decodes when group > 1.

* **K/V are read through the block table one logical tile at a time.** A KV tile
  of ``TILE_N`` consecutive context positions gathers each position's physical
  block from the block table, so the tile size is independent of the cache's
  block size (any power of two >= 8 works). The loop covers only tiles that can
  be unmasked for some row of the query tile: it stops at the tile's last
  query position (causal) and, with a sliding window, starts at the first
  position the tile's first query can still see. Softmax is the online
  (flash) formulation with fp32 statistics and accumulator, in base 2
  (``exp2`` with ``scale * log2(e)`` folded into the logits).

* **Head sizes are padded** to a power of two (>= 16, the smallest ``tl.dot``
  operand) and masked, so 80 and 96 work without special cases.

Interpreter mode: Triton decides between compiling and interpreting when a
function is *decorated* with ``@triton.jit`` -- ``triton.jit`` consults
``triton.knobs.runtime.interpret`` (which reads ``TRITON_INTERPRET`` from the
environment on every access) and returns an ``InterpretedFunction`` instead of a
``JITFunction`` when it is set. So ``TRITON_INTERPRET=1`` must be in the
environment before this module is first imported; setting it afterwards has no
effect on these kernels. The interpreter keeps bfloat16 values as raw uint16
bits and its ``tl.dot`` is a plain ``numpy.matmul`` over them, which would
multiply bit patterns; under the interpreter bf16 operands are therefore
widened to fp32 just before each ``tl.dot`` (``UPCAST_DOT``), which matches
the GPU's bf16 x bf16 -> fp32 MMA up to summation order. Compiled kernels never
take that path.

Tile sizes are sensible defaults for current NVIDIA GPUs (similar to vLLM's
unified attention kernel), not tuned values.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

__all__ = ["attention_tile_sizes", "paged_attention_triton", "write_kv_cache_triton"]

# Decided at the same moment triton.jit decides below (import time); see the docstring.
_INTERPRETING: bool = bool(triton.knobs.runtime.interpret)

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256
_INDEX_DTYPES = (torch.int32, torch.int64)


# --------------------------------------------------------------------------- kernels


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_c_kv,
    stride_c_blk,
    stride_c_off,
    stride_c_head,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0)
    head_block = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_PAD)
    mask = (heads < num_kv_heads)[:, None] & (dims < HEAD_DIM)[None, :]

    row = token.to(tl.int64)
    k = tl.load(key_ptr + row * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value_ptr + row * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    dst = cache_ptr + block * stride_c_blk + offset * stride_c_off + heads[:, None] * stride_c_head + dims[None, :]
    tl.store(dst, k, mask=mask)
    tl.store(dst + stride_c_kv, v, mask=mask)


@triton.jit
def _find_request(qsl_ptr, num_reqs, tile_id, BLOCK_Q: tl.constexpr):
    """Largest i < num_reqs with qsl[i] // BLOCK_Q + i <= tile_id (qsl[0] == 0, so i >= 0)."""
    lo = tl.full([], 0, tl.int32)
    hi = lo + num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        go_right = first_tile <= tile_id
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right, hi, mid)
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    cache_ptr,
    out_ptr,
    qsl_ptr,
    seq_lens_ptr,
    block_table_ptr,
    num_reqs,
    qk_scale,  # softmax scale * log2(e)
    sliding_window,  # <= 0: none
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt_req,
    stride_bt_blk,
    stride_c_kv,
    stride_c_blk,
    stride_c_off,
    stride_c_head,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # cache block size
    BLOCK_M: tl.constexpr,  # tile rows = BLOCK_Q tokens x GROUP heads (+ unused rows)
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,  # context positions per KV tile
    UPCAST_DOT: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)

    req = _find_request(qsl_ptr, num_reqs, tile_id, BLOCK_Q)
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    q_tile = tile_id - (q_start // BLOCK_Q + req)
    if q_tile * BLOCK_Q >= q_len:  # surplus tile, or a padding request with q_len 0
        return
    if seq_len <= 0:  # padding request
        return

    rows = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + rows // GROUP  # token index within the request
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    dims = tl.arange(0, HEAD_PAD)
    dim_valid = dims < HEAD_DIM

    context_len = seq_len - q_len  # cached prefix before this step's tokens
    q_pos = context_len + tok  # absolute position of each row's token

    q_rows = (q_start + tok).to(tl.int64)
    q_offs = q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    io_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(q_ptr + q_offs, mask=io_mask, other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)

    # KV tiles that some row of this query tile can see.
    first_q_pos = context_len + q_tile * BLOCK_Q
    last_q_pos = context_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len) - 1
    tile_hi = last_q_pos // TILE_N + 1
    tile_lo = tl.where(sliding_window > 0, tl.maximum(first_q_pos - sliding_window + 1, 0) // TILE_N, 0)

    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt_req
    cols = tl.arange(0, TILE_N)
    for kv_tile in range(tile_lo, tile_hi):
        k_pos = kv_tile * TILE_N + cols
        k_valid = k_pos < seq_len
        phys = tl.load(bt_row + (k_pos // BLOCK_SIZE) * stride_bt_blk, mask=k_valid, other=0).to(tl.int64)
        kv_offs = phys * stride_c_blk + (k_pos % BLOCK_SIZE) * stride_c_off + kv_head * stride_c_head
        # K loaded transposed, [HEAD_PAD, TILE_N]; V as [TILE_N, HEAD_PAD]
        k_mask = dim_valid[:, None] & k_valid[None, :]
        k = tl.load(cache_ptr + kv_offs[None, :] + dims[:, None], mask=k_mask, other=0.0)
        v_mask = k_valid[:, None] & dim_valid[None, :]
        v = tl.load(cache_ptr + stride_c_kv + kv_offs[:, None] + dims[None, :], mask=v_mask, other=0.0)
        if UPCAST_DOT:
            k = k.to(tl.float32)
        if FP32_DOT:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * qk_scale

        visible = row_valid[:, None] & k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
        in_window = (sliding_window <= 0) | (k_pos[None, :] > q_pos[:, None] - sliding_window)
        visible = visible & in_window
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # rows with nothing visible yet keep m == -inf; use 0 so exp2 gives 0, not nan
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        p_cast = p.to(v.dtype)
        if UPCAST_DOT:
            p_cast = p_cast.to(tl.float32)
            v = v.to(tl.float32)
        if FP32_DOT:
            acc = tl.dot(p_cast, v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p_cast, v, acc)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    o_offs = q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=io_mask)


# --------------------------------------------------------------------------- host side


def _check_block_size(block_size: int) -> None:
    if block_size < 8 or block_size & (block_size - 1):
        raise ValueError(f"KV cache block size {block_size} is not supported: it must be a power of two >= 8")


def _check_head_dim(head_dim: int) -> int:
    if not 1 <= head_dim <= _MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is not supported: it must be in [1, {_MAX_HEAD_DIM}]")
    return max(16, triton.next_power_of_2(head_dim))


def _check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last dimension, got shape {tuple(t.shape)} stride {t.stride()}"
        )


def _check_kv_cache(kv_cache: torch.Tensor) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], got shape {tuple(kv_cache.shape)}"
        )
    if not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache must be contiguous, got shape {tuple(kv_cache.shape)} stride {kv_cache.stride()}")
    if kv_cache.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} is not supported (expected one of {_SUPPORTED_DTYPES})")


def _check_index(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...], min_len: int) -> None:
    if t.dim() != 1 or t.shape[0] < min_len:
        raise ValueError(f"{name} must be 1-D with at least {min_len} entries, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {dtypes}, got {t.dtype}")
    if t.shape[0] > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride()}")


def _check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def write_kv_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter this step's K/V rows into the paged cache, in one launch.

    key/value: [T, num_kv_heads, head_dim] (row stride may be arbitrary, last dim contiguous);
    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim] contiguous (index 0 = K, 1 = V);
    slot_mapping: int64 [>= T]; token t goes to flat slot s = slot_mapping[t] (block = s // block_size,
    offset = s % block_size). Tokens whose slot is negative (-1 = padding) are not written.
    T = key.shape[0].
    """
    _check_kv_cache(kv_cache)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(
                f"{name} must be [T, {num_kv_heads}, {head_dim}] to match kv_cache {tuple(kv_cache.shape)}, "
                f"got {tuple(t.shape)}"
            )
        if t.dtype != kv_cache.dtype:
            raise ValueError(f"{name} dtype {t.dtype} does not match kv_cache dtype {kv_cache.dtype}")
        _check_last_dim_contiguous(name, t)
    if key.shape[0] != value.shape[0]:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} have different token counts")
    num_tokens = key.shape[0]
    _check_index("slot_mapping", slot_mapping, (torch.int64,), num_tokens)
    _check_same_device(key=key, value=value, kv_cache=kv_cache, slot_mapping=slot_mapping)
    head_pad = _check_head_dim(head_dim)
    if num_tokens == 0:
        return

    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 4096 // head_pad))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _write_kv_cache_kernel[grid](
        key,
        value,
        kv_cache,
        slot_mapping,
        num_kv_heads,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        BLOCK_H=block_h,
        num_warps=4,
    )


def attention_tile_sizes(head_dim: int, group: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_Q, TILE_N) the attention kernel uses; the grid's first
    dimension is ``T // BLOCK_Q + num_reqs``."""
    head_pad = _check_head_dim(head_dim)
    block_m = max(32 if head_pad <= 128 else 16, triton.next_power_of_2(group))
    tile_n = 32 if head_pad <= 128 else 16
    return block_m, block_m // group, tile_n


def paged_attention_triton(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    num_reqs: int,
    scale: float,
    sliding_window: int,
) -> None:
    """Attention of every query row over its request's paged context, in one launch.

    query/out: [T, num_heads, head_dim] (row strides may differ from contiguous; last dim contiguous);
    query_start_loc: int32 [>= num_reqs + 1], request i owns query rows query_start_loc[i]:query_start_loc[i+1];
    seq_lens: int32 [>= num_reqs], context length of request i AFTER this step (cached prefix + this step's tokens);
    block_table: int32 [>= num_reqs, max_blocks] (row stride arbitrary): the cache blocks of request i in order.
    Query row j of request i (q_len = qsl[i+1]-qsl[i]) has position seq_lens[i] - q_len + j and attends to key
    positions p with p <= its position and, if sliding_window > 0, p > position - sliding_window.
    GQA/MQA: query head h uses kv head h // (num_heads // num_kv_heads).
    Rows of `out` at or beyond query_start_loc[num_reqs] (padding) are not written; a request with q_len 0
    or seq_len 0 (padding request) writes nothing.
    """
    _check_kv_cache(kv_cache)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    _check_block_size(block_size)
    head_pad = _check_head_dim(head_dim)
    if query.dim() != 3 or query.shape[2] != head_dim:
        raise ValueError(
            f"query must be [T, num_heads, {head_dim}] to match kv_cache {tuple(kv_cache.shape)}, "
            f"got {tuple(query.shape)}"
        )
    num_tokens, num_heads = query.shape[0], query.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(
            f"query has {num_heads} heads, not a multiple of the {num_kv_heads} KV heads of kv_cache "
            f"{tuple(kv_cache.shape)}"
        )
    if out.shape != query.shape:
        raise ValueError(f"out shape {tuple(out.shape)} does not match query shape {tuple(query.shape)}")
    if query.dtype != kv_cache.dtype or out.dtype != query.dtype:
        raise ValueError(
            f"query ({query.dtype}), out ({out.dtype}) and kv_cache ({kv_cache.dtype}) must share one dtype"
        )
    _check_last_dim_contiguous("query", query)
    _check_last_dim_contiguous("out", out)
    if not isinstance(num_reqs, int) or num_reqs < 0:
        raise ValueError(f"num_reqs must be a non-negative int, got {num_reqs!r}")
    _check_index("query_start_loc", query_start_loc, _INDEX_DTYPES, num_reqs + 1)
    _check_index("seq_lens", seq_lens, _INDEX_DTYPES, num_reqs)
    if block_table.dim() != 2 or block_table.shape[0] < num_reqs:
        raise ValueError(
            f"block_table must be [>= num_reqs ({num_reqs}), max_blocks], got shape {tuple(block_table.shape)}"
        )
    if block_table.dtype not in _INDEX_DTYPES:
        raise ValueError(f"block_table must have dtype in {_INDEX_DTYPES}, got {block_table.dtype}")
    _check_same_device(
        query=query,
        kv_cache=kv_cache,
        out=out,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=block_table,
    )
    if num_tokens == 0 or num_reqs == 0:
        return

    group = num_heads // num_kv_heads
    block_m, block_q, tile_n = attention_tile_sizes(head_dim, group)
    grid = (num_tokens // block_q + num_reqs, num_kv_heads)
    _paged_attention_kernel[grid](
        query,
        kv_cache,
        out,
        query_start_loc,
        seq_lens,
        block_table,
        num_reqs,
        float(scale) * math.log2(math.e),
        int(sliding_window),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
        block_table.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=tile_n,
        UPCAST_DOT=_INTERPRETING and query.dtype == torch.bfloat16,
        FP32_DOT=query.dtype == torch.float32,
        num_warps=4 if head_pad <= 128 else 8,
    )
