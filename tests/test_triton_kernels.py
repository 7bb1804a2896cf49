"""The Triton KV-cache write and paged attention kernels against dense references.

Without CUDA the kernels run under Triton's interpreter on CPU tensors. Triton
picks interpreter vs. compiler when ``@triton.jit`` decorates a kernel, i.e. when
``kiln.attention.triton_kernels`` is imported, so ``TRITON_INTERPRET`` is set first.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from kiln.attention import triton_kernels as ta

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and not ta._INTERPRETING:
    raise RuntimeError(
        "kiln.attention.triton_kernels was imported before TRITON_INTERPRET=1 was set; "
        "without CUDA its kernels can only run under the interpreter"
    )

TOLERANCES = {
    torch.float32: {"atol": 2e-4, "rtol": 1e-4},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2},
}
OUT_SENTINEL = -768.0  # exactly representable in fp32, fp16 and bf16


@dataclass
class Batch:
    query: torch.Tensor  # [T, H, D] view with a row stride wider than H * D
    out: torch.Tensor  # [T, H, D] view into out_buf
    out_buf: torch.Tensor
    kv_cache: torch.Tensor
    qsl: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor  # [num_reqs(+), max_blocks] view into a wider buffer
    num_reqs: int
    keys: list[torch.Tensor]  # per request, [seq_len, KV, D] (unpaged)
    values: list[torch.Tensor]
    q_lens: list[int]
    seq_lens_list: list[int]


def make_batch(
    seq_lens: list[int],
    q_lens: list[int],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    pad_tokens: int = 0,
    seed: int = 0,
) -> Batch:
    """A varlen batch whose K/V already sit in a paged cache under a shuffled
    block table. Unused cache slots hold NaN, so reading one poisons the output."""
    assert len(seq_lens) == len(q_lens)
    g = torch.Generator().manual_seed(seed)
    num_reqs = len(seq_lens)
    nblocks = [math.ceil(s / block_size) for s in seq_lens]
    max_blocks = max(max(nblocks), 1)
    num_blocks = sum(nblocks) + 3  # a few never-referenced blocks
    perm = torch.randperm(num_blocks, generator=g)

    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    # row-strided block table: a slice of a wider buffer, unused entries out of range
    bt_buf = torch.full((num_reqs + 1, max_blocks + 5), num_blocks + 1000, dtype=torch.int32)
    block_table = bt_buf[:num_reqs, :max_blocks]
    keys, values = [], []
    used = 0
    for i, (s, n) in enumerate(zip(seq_lens, nblocks)):
        ids = perm[used : used + n]
        used += n
        block_table[i, :n] = ids.to(torch.int32)
        k = torch.randn(s, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(s, num_kv_heads, head_dim, generator=g).to(dtype)
        keys.append(k)
        values.append(v)
        for p in range(s):
            kv_cache[0, ids[p // block_size], p % block_size] = k[p]
            kv_cache[1, ids[p // block_size], p % block_size] = v[p]

    num_actual = sum(q_lens)
    num_tokens = num_actual + pad_tokens
    qsl_list = [0]
    for n in q_lens:
        qsl_list.append(qsl_list[-1] + n)
    # entries past num_reqs + 1 / num_reqs are garbage: the kernel must not read them
    qsl = torch.tensor(qsl_list + [10**6, 7], dtype=torch.int32)
    seq_lens_t = torch.tensor(list(seq_lens) + [10**6], dtype=torch.int32)

    fused_width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, fused_width, generator=g).to(dtype).to(DEVICE)
    out_buf = torch.full((num_tokens, num_heads + 1, head_dim), OUT_SENTINEL, dtype=dtype, device=DEVICE)
    bt_buf = bt_buf.to(DEVICE)
    return Batch(
        query=qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim),
        out=out_buf[:, :num_heads],
        out_buf=out_buf,
        kv_cache=kv_cache.to(DEVICE),
        qsl=qsl.to(DEVICE),
        seq_lens=seq_lens_t.to(DEVICE),
        block_table=bt_buf[:num_reqs, :max_blocks],
        num_reqs=num_reqs,
        keys=keys,
        values=values,
        q_lens=list(q_lens),
        seq_lens_list=list(seq_lens),
    )


def reference_attention(b: Batch, scale: float, sliding_window: int) -> torch.Tensor:
    """Dense masked softmax attention per request over its unpaged sequence, fp32."""
    query = b.query.float().cpu()
    ref = torch.full(query.shape, float("nan"))
    num_heads = query.shape[1]
    start = 0
    for q_len, s, k, v in zip(b.q_lens, b.seq_lens_list, b.keys, b.values):
        if q_len == 0 or s == 0:
            start += q_len
            continue
        group = num_heads // k.shape[1]
        k = k.float().repeat_interleave(group, dim=1)  # [s, H, D]
        v = v.float().repeat_interleave(group, dim=1)
        q = query[start : start + q_len]  # [q_len, H, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(s - q_len, s)[:, None]
        k_pos = torch.arange(s)[None, :]
        mask = k_pos <= q_pos
        if sliding_window > 0:
            mask &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~mask, float("-inf"))
        ref[start : start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        start += q_len
    return ref


def run_and_check(b: Batch, *, sliding_window: int = 0, scale: float | None = None) -> None:
    head_dim = b.query.shape[-1]
    scale = head_dim**-0.5 if scale is None else scale
    cache_before = b.kv_cache.clone()
    ta.paged_attention_triton(
        b.query, b.kv_cache, b.out, b.qsl, b.seq_lens, b.block_table, b.num_reqs, scale, sliding_window
    )
    ref = reference_attention(b, scale, sliding_window)
    out = b.out.float().cpu()
    dtype = b.query.dtype
    start = 0
    for q_len, s in zip(b.q_lens, b.seq_lens_list):
        rows = slice(start, start + q_len)
        if s == 0:  # padding request: its rows stay untouched
            assert bool((out[rows] == OUT_SENTINEL).all())
        else:
            torch.testing.assert_close(out[rows], ref[rows], **TOLERANCES[dtype])
        start += q_len
    # padding rows and the spare head column of out_buf are never written
    assert bool((out[start:] == OUT_SENTINEL).all())
    assert bool((b.out_buf[:, -1].float() == OUT_SENTINEL).all())
    # attention never writes the cache
    assert torch.equal(b.kv_cache.isnan(), cache_before.isnan())
    assert torch.equal(b.kv_cache.nan_to_num(0.0), cache_before.nan_to_num(0.0))


# --------------------------------------------------------------------------- attention

MIXED = {"seq_lens": [1, 23, 40, 9, 17], "q_lens": [1, 1, 12, 9, 17]}  # decodes, chunked prefill, prefills


@pytest.mark.parametrize(
    "seq_lens,q_lens",
    [
        pytest.param([5, 33, 17, 1], [1, 1, 1, 1], id="decode-only"),
        pytest.param([7, 40, 16], [7, 40, 16], id="prefill-only"),
        pytest.param([37, 20], [5, 19], id="chunked-prefill"),
        pytest.param(MIXED["seq_lens"], MIXED["q_lens"], id="mixed"),
    ],
)
def test_batch_kinds(seq_lens: list[int], q_lens: list[int]) -> None:
    torch.manual_seed(0)
    run_and_check(make_batch(seq_lens, q_lens, seed=1))


@pytest.mark.parametrize(
    "num_heads,num_kv_heads", [(4, 2), (4, 1), (6, 2), (2, 2)], ids=["gqa", "mqa", "group3", "mha"]
)
def test_head_grouping(num_heads: int, num_kv_heads: int) -> None:
    torch.manual_seed(0)
    run_and_check(make_batch(**MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, seed=2))


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_head_dims(head_dim: int) -> None:
    torch.manual_seed(0)
    run_and_check(make_batch([26, 3], [10, 1], head_dim=head_dim, block_size=16, seed=3))


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_block_sizes(block_size: int) -> None:
    torch.manual_seed(0)
    run_and_check(make_batch(**MIXED, head_dim=64, block_size=block_size, seed=4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_dtypes(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    b = make_batch(**MIXED, num_heads=4, num_kv_heads=1, head_dim=96, block_size=32, dtype=dtype, seed=5)
    run_and_check(b)
    assert b.out.dtype == dtype


@pytest.mark.parametrize(
    "window,dtype", [(1, torch.float32), (5, torch.float32), (16, torch.float16), (64, torch.float32)]
)
def test_sliding_window(window: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    # contexts longer than the window on both sides of a KV tile boundary
    b = make_batch([40, 35, 12, 3], [1, 20, 12, 1], dtype=dtype, block_size=16, seed=6)
    run_and_check(b, sliding_window=window)


def test_window_changes_result() -> None:
    """The window must actually drop keys (guards against the test's own reference
    and the kernel both ignoring it)."""
    b = make_batch([40], [1], seed=7)
    ta.paged_attention_triton(b.query, b.kv_cache, b.out, b.qsl, b.seq_lens, b.block_table, 1, 0.125, 4)
    windowed = b.out.clone()
    ta.paged_attention_triton(b.query, b.kv_cache, b.out, b.qsl, b.seq_lens, b.block_table, 1, 0.125, 0)
    assert (windowed[:1] - b.out[:1]).abs().max() > 1e-2


def test_padding_rows_and_requests() -> None:
    """CUDA-graph padding: rows past query_start_loc[num_reqs], a request with
    q_len 0 in the middle, and a trailing padding request with q_len 0 / seq_len 0."""
    torch.manual_seed(0)
    b = make_batch([30, 12, 1, 25, 0], [3, 0, 1, 25, 0], pad_tokens=11, block_size=16, seed=8)
    assert b.query.shape[0] == 29 + 11
    run_and_check(b)


def test_request_with_empty_context_writes_nothing() -> None:
    """seq_len 0 marks a padding request even when query rows are assigned to it."""
    torch.manual_seed(0)
    b = make_batch([9, 0, 14], [1, 3, 14], seed=14)
    run_and_check(b)
    assert bool((b.out[1:4].float() == OUT_SENTINEL).all())
    assert not bool((b.out[4:18].float() == OUT_SENTINEL).any())


def test_long_prefill_many_tiles_mqa_bf16() -> None:
    """A prefill spanning several query tiles and KV tiles, with the group folded in."""
    torch.manual_seed(0)
    b = make_batch([45, 2], [45, 1], num_heads=4, num_kv_heads=1, dtype=torch.bfloat16, block_size=8, seed=9)
    run_and_check(b)


def test_empty_batch_is_a_no_op() -> None:
    b = make_batch([4], [4], seed=10)
    ta.paged_attention_triton(b.query, b.kv_cache, b.out, b.qsl, b.seq_lens, b.block_table, 0, 0.1, 0)
    assert bool((b.out_buf.float() == OUT_SENTINEL).all())


@pytest.mark.parametrize("block_size", [12, 4])
def test_rejects_unsupported_block_size(block_size: int) -> None:
    cache = torch.zeros(2, 3, block_size, 1, 64, device=DEVICE)
    q = torch.zeros(2, 1, 64, device=DEVICE)
    idx = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=f"block size {block_size} "):
        ta.paged_attention_triton(q, cache, q.clone(), idx, idx, idx.view(2, 1), 1, 1.0, 0)


def test_rejects_mismatched_shapes() -> None:
    cache = torch.zeros(2, 3, 16, 2, 64, device=DEVICE)
    idx = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    q = torch.zeros(2, 3, 64, device=DEVICE)
    with pytest.raises(ValueError, match=r"query has 3 heads.*\(2, 3, 16, 2, 64\)"):
        ta.paged_attention_triton(q, cache, q.clone(), idx, idx, idx.view(2, 1), 1, 1.0, 0)
    q = torch.zeros(2, 4, 32, device=DEVICE)
    with pytest.raises(ValueError, match=r"query must be \[T, num_heads, 64\].*\(2, 4, 32\)"):
        ta.paged_attention_triton(q, cache, q.clone(), idx, idx, idx.view(2, 1), 1, 1.0, 0)
    q = torch.zeros(2, 4, 64, device=DEVICE)
    with pytest.raises(ValueError, match="out shape"):
        ta.paged_attention_triton(q, cache, q[:1].clone(), idx, idx, idx.view(2, 1), 1, 1.0, 0)
    with pytest.raises(ValueError, match="query_start_loc"):
        ta.paged_attention_triton(q, cache, q.clone(), idx[:1], idx, idx.view(2, 1), 1, 1.0, 0)
    with pytest.raises(ValueError, match="dtype"):
        ta.paged_attention_triton(q.half(), cache, q.half(), idx, idx, idx.view(2, 1), 1, 1.0, 0)
    key = torch.zeros(2, 3, 64, device=DEVICE)
    with pytest.raises(ValueError, match=r"key must be \[T, 2, 64\].*\(2, 3, 64\)"):
        ta.write_kv_cache_triton(key, key, cache, idx.long())
    key = torch.zeros(2, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        ta.write_kv_cache_triton(key, key, cache, idx)  # int32 slots


# --------------------------------------------------------------------------- KV write


def _fused_kv(
    num_tokens: int, num_heads: int, num_kv: int, head_dim: int, dtype: torch.dtype, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """key/value as views into a fused qkv projection (row stride > KV * D)."""
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv) * head_dim, generator=g).to(dtype).to(DEVICE)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv) * head_dim].view(num_tokens, num_kv, head_dim)
    v = qkv[:, (num_heads + num_kv) * head_dim :].view(num_tokens, num_kv, head_dim)
    return k, v


@pytest.mark.parametrize(
    "dtype,num_kv,head_dim,block_size",
    [(torch.float32, 2, 64, 16), (torch.float16, 1, 80, 32), (torch.bfloat16, 3, 128, 8)],
    ids=["fp32", "fp16", "bf16"],
)
def test_write_kv_cache(dtype: torch.dtype, num_kv: int, head_dim: int, block_size: int) -> None:
    g = torch.Generator().manual_seed(11)
    num_blocks, num_tokens = 5, 13
    key, value = _fused_kv(num_tokens, 4, num_kv, head_dim, dtype, g)
    assert not key.is_contiguous() and key.stride(0) > num_kv * head_dim
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[2, 7, 12]] = -1  # padding tokens, including the last
    # slot_mapping longer than T: the tail must be ignored
    slot_mapping = torch.cat([slots, torch.tensor([0, 1])]).to(DEVICE)
    cache = torch.randn(2, num_blocks, block_size, num_kv, head_dim, generator=g).to(dtype).to(DEVICE)
    before = cache.clone()

    ta.write_kv_cache_triton(key, value, cache, slot_mapping)

    flat = cache.view(2, -1, num_kv, head_dim).cpu()
    expected = before.view(2, -1, num_kv, head_dim).cpu().clone()
    valid = slots >= 0
    expected[0, slots[valid]] = key.cpu()[valid]
    expected[1, slots[valid]] = value.cpu()[valid]
    assert torch.equal(flat, expected)
    assert not torch.equal(flat, before.view(2, -1, num_kv, head_dim).cpu())


def test_write_kv_cache_no_tokens() -> None:
    cache = torch.zeros(2, 2, 16, 1, 64, device=DEVICE)
    empty = torch.zeros(0, 1, 64, device=DEVICE)
    ta.write_kv_cache_triton(empty, empty, cache, torch.zeros(4, dtype=torch.int64, device=DEVICE))
    assert bool((cache == 0).all())


def test_write_then_attend_with_padding() -> None:
    """One engine step: scatter this step's K/V (with padding slots) into a cache
    holding the cached prefixes, then attend; compare with the dense reference."""
    g = torch.Generator().manual_seed(12)
    num_heads, num_kv, head_dim, block_size = 4, 2, 64, 16
    seq_lens, q_lens, pad = [19, 6, 33], [1, 6, 4], 5
    b = make_batch(seq_lens, q_lens, num_heads=num_heads, num_kv_heads=num_kv, pad_tokens=pad, seed=13)
    # forget this step's tokens in the cache (as if not yet written) ...
    slots = []
    bt = b.block_table.cpu()
    for i, (s, n) in enumerate(zip(seq_lens, q_lens)):
        for p in range(s - n, s):
            slots.append(int(bt[i, p // block_size]) * block_size + p % block_size)
    slots_t = torch.tensor(slots + [-1] * pad)
    flat = b.kv_cache.view(2, -1, num_kv, head_dim)
    true_kv = flat[:, slots_t[: len(slots)]].clone()
    flat[:, slots_t[: len(slots)]] = float("nan")
    # ... and write them from a fused qkv view, padding rows holding junk
    key, value = _fused_kv(sum(q_lens) + pad, num_heads, num_kv, head_dim, torch.float32, g)
    key[: len(slots)] = true_kv[0]
    value[: len(slots)] = true_kv[1]
    before = b.kv_cache.clone()
    ta.write_kv_cache_triton(key, value, b.kv_cache, slots_t.to(DEVICE))

    written = torch.zeros(flat.shape[1], dtype=torch.bool)
    written[slots_t[: len(slots)]] = True
    after_flat, before_flat = b.kv_cache.view(2, -1, num_kv, head_dim), before.view(2, -1, num_kv, head_dim)
    assert torch.equal(after_flat[:, slots_t[: len(slots)].to(DEVICE)], true_kv)
    keep = (~written).to(DEVICE)
    assert torch.equal(after_flat[:, keep].isnan(), before_flat[:, keep].isnan())
    assert torch.equal(after_flat[:, keep].nan_to_num(0.0), before_flat[:, keep].nan_to_num(0.0))

    run_and_check(b)
