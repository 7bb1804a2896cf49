"""The torch backend's batched decode call against a dense reference.

Steps mix single-query requests (batched into one call) with prefill chunks
that follow a cached prefix (one call each), in the scheduler's order and out
of it, with and without a sliding window, with grouped-query heads.
"""

from __future__ import annotations

import ctypes
from dataclasses import replace

import numpy as np
import pytest
import torch

from kiln.attention import torch_backend
from kiln.attention.backend import CommonAttentionMetadata
from kiln.attention.cpu_attention import DecodeStep
from kiln.attention.torch_backend import TorchAttentionBackend, write_kv_cache
from tests.conftest import KERNEL_BUILDS

BLOCK_SIZE = 4
NUM_BLOCKS = 64
KV_HEADS, GROUP, HEAD_DIM = 2, 3, 8


def _step(q_lens: list[int], seq_lens: list[int], seed: int = 0, kv_heads: int = KV_HEADS, group: int = GROUP,
          head_dim: int = HEAD_DIM, block_size: int = BLOCK_SIZE):
    """A random paged cache, block tables and queries for requests with these
    query and context lengths; also each request's dense K/V."""
    g = torch.Generator().manual_seed(seed)
    kv_cache = torch.randn(2, NUM_BLOCKS, block_size, kv_heads, head_dim, generator=g)
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    max_blocks = max(-(-n // block_size) for n in seq_lens) + 2
    # Stale ids past each context, as the engine's buffers hold them.
    block_table = torch.tensor(perm[:max_blocks * len(q_lens)], dtype=torch.int32).view(len(q_lens), max_blocks)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    total = int(qsl[-1])
    slots = []
    for i, (q, n) in enumerate(zip(q_lens, seq_lens)):
        for p in range(n - q, n):
            slots.append(int(block_table[i, p // block_size]) * block_size + p % block_size)
    common = CommonAttentionMetadata(
        num_actual_tokens=total, num_reqs=len(q_lens), max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_start_loc=torch.from_numpy(qsl), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table, slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=qsl, seq_lens_cpu=np.asarray(seq_lens, dtype=np.int32), block_size=block_size,
    )
    query = torch.randn(total, kv_heads * group, head_dim, generator=g)
    key = torch.randn(total, kv_heads, head_dim, generator=g)
    value = torch.randn(total, kv_heads, head_dim, generator=g)
    return kv_cache, common, query, key, value


def _dense(kv_cache, common, query, window: int, scale: float) -> torch.Tensor:
    """Attention of each query over its request's context, one head at a time."""
    kv_heads, head_dim = kv_cache.shape[-2], kv_cache.shape[-1]
    group = query.shape[1] // kv_heads
    out = torch.zeros_like(query)
    for i in range(common.num_reqs):
        start, end = int(common.query_start_loc_cpu[i]), int(common.query_start_loc_cpu[i + 1])
        n = int(common.seq_lens_cpu[i])
        bs = common.block_size
        slots = [int(common.block_table[i, p // bs]) * bs + p % bs for p in range(n)]
        k = kv_cache[0].reshape(-1, kv_heads, head_dim)[slots]
        v = kv_cache[1].reshape(-1, kv_heads, head_dim)[slots]
        for t in range(start, end):
            pos = n - (end - t)
            keep = torch.arange(n) <= pos
            if window > 0:
                keep &= torch.arange(n) > pos - window
            for h in range(kv_heads * group):
                s = (k[:, h // group] @ query[t, h]) * scale
                s = s.masked_fill(~keep, float("-inf"))
                out[t, h] = torch.softmax(s, 0) @ v[:, h // group]
    return out


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize(
    "q_lens, seq_lens",
    [
        ([1, 1, 1, 1], [3, 17, 9, 1]),  # decodes only, contiguous
        ([1, 1, 6, 1, 1], [12, 5, 10, 20, 2]),  # a prefill chunk after a cached prefix splits them
        ([7, 1, 1, 0], [7, 30, 4, 0]),  # a fresh prefill, then decodes, then a padding row
    ],
)
def test_batched_decode_equals_dense_attention(q_lens, seq_lens, window: int) -> None:
    kv_cache, common, query, key, value = _step(q_lens, seq_lens)
    backend = TorchAttentionBackend()
    meta = backend.build_metadata(common)
    assert meta.decode is not None and meta.decode.blocks.shape[0] == sum(q == 1 for q in q_lens)
    out = torch.zeros_like(query)
    backend.forward(query, key, value, out, kv_cache, meta, 0.3, window)
    # forward wrote the step's keys into the cache; the reference reads them there
    torch.testing.assert_close(out, _dense(kv_cache, common, query, window, 0.3), atol=1e-5, rtol=1e-5)


def test_a_single_decode_is_attended_alone() -> None:
    kv_cache, common, query, key, value = _step([1, 5], [9, 5], seed=1)
    backend = TorchAttentionBackend()
    meta = backend.build_metadata(common)
    assert meta.decode is None and meta.per_request == (0, 1)
    out = torch.zeros_like(query)
    backend.forward(query, key, value, out, kv_cache, meta, 0.3, 0)
    torch.testing.assert_close(out, _dense(kv_cache, common, query, 0, 0.3), atol=1e-5, rtol=1e-5)


# the kernel's builds this CPU runs (no-bf16-dot has no code of its own here), and its plain C loops, which
# a CPU without AVX2 runs
_ATTENTION_BUILDS = [b for b in KERNEL_BUILDS if b[0] != "no-bf16-dot"] + [("no-avx2", ("-mno-avx2", "-mno-fma"))]


@pytest.fixture(scope="module", params=_ATTENTION_BUILDS, ids=[name for name, _ in _ATTENTION_BUILDS])
def decode_kernel(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The C decode-attention kernel, built with this machine's compiler: each
    build this CPU runs (its AVX-512, AVX2 and plain C code)."""
    from kiln.attention.cpu_attention import SOURCE, CpuAttentionKernel

    root = tmp_path_factory.mktemp("inductor")
    return CpuAttentionKernel(root / SOURCE.build(root, request.param[1]))


@pytest.fixture
def kernel_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch path's KV write and decode attention fail if called: the
    kernel must have taken the layer (the prefill chunks still go to SDPA)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the torch path ran where the C kernel should have")

    monkeypatch.setattr(torch_backend, "write_kv_cache", refuse)
    monkeypatch.setattr(torch_backend, "paged_attention_torch", refuse)


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("kv_heads, group, head_dim",
                         [(2, 3, 8), (3, 3, 64), (1, 4, 128), (4, 1, 16), (2, 7, 64), (1, 9, 64), (1, 2, 256)])
@pytest.mark.parametrize(
    "q_lens, seq_lens",
    [
        ([1], [13]),  # one request: a work item per KV head
        ([1, 1, 6, 1, 1], [12, 5, 10, 20, 2]),  # rows not contiguous (a prefill chunk between)
        ([1] * 9, [3, 17, 9, 1, 20, 4, 5, 13, 8]),  # enough requests for all heads in one item
        ([4, 1, 7, 3], [4, 9, 12, 3]),  # chunks with and without a cached prefix, rows of the kernel
    ],
)
# the chunks by SDPA, some by each (the 7-token chunk has 63 pairs), all by the kernel
@pytest.mark.parametrize("chunk_pairs", [0, 30, TorchAttentionBackend.native_chunk_pairs])
def test_the_c_decode_kernel_equals_dense_attention(decode_kernel, kernel_only, q_lens, seq_lens, window: int,
                                                    kv_heads: int, group: int, head_dim: int,
                                                    chunk_pairs: int) -> None:
    kv_cache, common, query, key, value = _step(q_lens, seq_lens, seed=2, kv_heads=kv_heads, group=group,
                                                head_dim=head_dim)
    # the query as the model hands it over: a view of the fused q/k/v projection, rows strided
    fused = torch.zeros(query.shape[0], (kv_heads * group + 2 * kv_heads), head_dim)
    fused[:, : kv_heads * group] = query
    query = fused[:, : kv_heads * group]
    backend = TorchAttentionBackend().with_decode_kernel(decode_kernel)
    backend.native_chunk_pairs = chunk_pairs
    meta = backend.build_metadata(common)
    # a row for each decode and for each token of the chunks short enough, fresh prompts aside where the
    # build has the causal prefill, which takes every other chunk
    prefills = decode_kernel.prefills
    short = {i for i, (q, n) in enumerate(zip(q_lens, seq_lens))
             if q > 1 and not (prefills and q == n) and q * (n - q) + q * (q + 1) // 2 <= chunk_pairs}
    prefill = {i for i, q in enumerate(q_lens) if q > 1 and i not in short} if prefills else set()
    assert set(meta.prefill) == prefill
    assert set(meta.per_request) - set(meta.left_by_native) == short | prefill
    rows = sum(q for i, q in enumerate(q_lens) if q == 1 or i in short)
    assert meta.native is not None and meta.native.num_rows == rows
    out = torch.full_like(query, float("nan"))  # every row is written: by the kernel, or the chunks by SDPA
    backend.forward(query, key, value, out, kv_cache, meta, 0.3, window)
    torch.testing.assert_close(out, _dense(kv_cache, common, query, window, 0.3), atol=1e-5, rtol=1e-5)


def _chunks(common, requests) -> torch.Tensor:
    """The prefill kernel's rows for these requests: first query row, rows, context, block-table row."""
    qsl, seq_lens = common.query_start_loc_cpu, common.seq_lens_cpu
    return torch.tensor([[int(qsl[i]), int(qsl[i + 1] - qsl[i]), int(seq_lens[i]), i] for i in requests],
                        dtype=torch.int64)


@pytest.mark.parametrize("kv_heads, group, head_dim",
                         [(3, 3, 64), (1, 1, 16), (2, 7, 64), (1, 48, 32), (4, 2, 128), (1, 3, 256)])
@pytest.mark.parametrize("block_size", [16, 12])  # 12: a step of 8 keys spans two blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_prefill_kernel_equals_dense_attention(decode_kernel, kv_heads: int, group: int, head_dim: int,
                                                   block_size: int, dtype) -> None:
    """Fresh prompts of 17 to 60 tokens and chunks after a cached prefix,
    read from the paged cache; a decode between them whose row no chunk
    covers (left as it was); query rows strided as the fused projection
    hands them over. Every build that lacks the kernel declines, writing
    nothing."""
    q_lens, seq_lens = [17, 1, 48, 60, 5, 30], [17, 30, 48, 60, 70, 90]
    kv_cache, common, query, key, value = _step(q_lens, seq_lens, seed=kv_heads * group + head_dim,
                                                kv_heads=kv_heads, group=group, head_dim=head_dim,
                                                block_size=block_size)
    fused = torch.zeros(query.shape[0], kv_heads * (group + 2), head_dim)
    fused[:, : kv_heads * group] = query
    query = fused[:, : kv_heads * group]
    kv_cache, query = kv_cache.to(dtype), query.to(dtype)
    chunks = [0, 2, 3, 4, 5]
    out = torch.full_like(query, float("nan"))
    taken = decode_kernel.prefill(query, out, kv_cache, common.block_table, _chunks(common, chunks), 0.3)
    assert taken == decode_kernel.prefills
    if not taken:
        assert out.isnan().all()
        return
    assert out[17].isnan().all()  # the decode's row
    want = _dense(kv_cache.float(), common, query.float(), 0, 0.3)
    rows = torch.ones(query.shape[0], dtype=torch.bool)
    rows[17] = False
    if dtype == torch.float32:  # sums in another order: scores of up to about 5 at head dim 256
        torch.testing.assert_close(out[rows], want[rows], atol=5e-5, rtol=5e-5)
    else:  # fp32 sums, rounded once: one bf16 step from the rounded reference
        torch.testing.assert_close(out[rows].float(), want[rows].to(dtype).float(), atol=1e-2, rtol=2 ** -7)


def test_the_prefill_kernel_refuses_chunks_outside_its_tensors(decode_kernel) -> None:
    """Rows, table rows, contexts past the table's blocks, or block ids past
    the cache: an error naming the chunks, nothing written; a build without
    the kernel declines first."""
    kv_cache, common, query, key, value = _step([4, 6], [4, 30], seed=9, kv_heads=1, group=3, head_dim=16)
    blocks = kv_cache.shape[1]
    bad_table = common.block_table.clone()
    bad_table[1, 0] = blocks  # past the cache
    out = torch.zeros_like(query)
    for chunks, table in (([[0, 4, 4, 0], [4, 7, 30, 1]], common.block_table),  # past the 10 query rows
                          ([[0, 4, 4, 2]], common.block_table),  # no third table row
                          ([[0, 4, 3, 0]], common.block_table),  # a context shorter than the chunk
                          ([[0, 4, 10_000, 0]], common.block_table),  # past the table's blocks
                          ([[0, 0, 4, 0]], common.block_table),  # empty
                          ([[4, 6, 30, 1]], bad_table)):
        spec = torch.tensor(chunks, dtype=torch.int64)
        if decode_kernel.prefills:
            with pytest.raises(IndexError, match=r"prefill chunks .* outside the 10 query rows"):
                decode_kernel.prefill(query, out, kv_cache, table, spec, 1.0)
        else:
            assert decode_kernel.prefill(query, out, kv_cache, table, spec, 1.0) is False
    assert (out == 0).all()
    if decode_kernel.prefills:
        with pytest.raises(ValueError, match=r"\[n, 4\] int64"):
            decode_kernel.prefill(query, out, kv_cache, common.block_table,
                                  torch.tensor([[0, 4, 4, 0]], dtype=torch.int32), 1.0)


def _spy(kernel) -> list:
    """The chunk lists of ``kernel.prefill``'s calls, which still run (undo with ``del kernel.prefill``)."""
    calls = []
    real = kernel.prefill
    kernel.prefill = lambda *args: calls.append(args[4].tolist()) or real(*args)
    return calls


@pytest.mark.parametrize("window", [0, 6, 40])
def test_prefill_chunks_that_a_window_cuts_go_to_sdpa(decode_kernel, kernel_only, window: int) -> None:
    """A sliding window shorter than a chunk's context is not plain causal
    attention: every prefill chunk of the step then goes to SDPA."""
    kv_cache, common, query, key, value = _step([1, 12, 30, 1], [9, 12, 30, 4], seed=3, kv_heads=2, group=3,
                                                head_dim=64)
    backend = TorchAttentionBackend().with_decode_kernel(decode_kernel)
    meta = backend.build_metadata(common)
    assert meta.prefill == ((1, 2) if decode_kernel.prefills else ())
    calls = _spy(decode_kernel)
    try:
        out = torch.full_like(query, float("nan"))
        backend.forward(query, key, value, out, kv_cache, meta, 0.3, window)
    finally:
        del decode_kernel.prefill
    assert calls == ([[[1, 12, 12, 1], [13, 30, 30, 2]]] if decode_kernel.prefills and not 0 < window < 30 else [])
    torch.testing.assert_close(out, _dense(kv_cache, common, query, window, 0.3), atol=1e-5, rtol=1e-5)


def test_in_bf16_only_the_smaller_chunks_go_to_the_prefill_kernel(decode_kernel, kernel_only) -> None:
    """Larger ones take SDPA's bf16 kernel (``native_prefill_bf16_pairs``);
    a short chunk after a cached prefix stays rows of the decode call."""
    kv_cache, common, query, key, value = _step([40, 1, 9, 25, 3], [40, 6, 9, 25, 30], seed=4, kv_heads=1, group=3,
                                                head_dim=64)
    kv_cache, query, key, value = (t.to(torch.bfloat16) for t in (kv_cache, query, key, value))
    backend = TorchAttentionBackend().with_decode_kernel(decode_kernel)
    backend.native_prefill_bf16_pairs = 25 * 26 // 2
    meta = backend.build_metadata(common)
    if decode_kernel.prefills:
        assert meta.prefill == (2, 3, 0) and meta.prefill_contexts == (9, 25, 40) and meta.prefill_bf16 == 2
        assert meta.left_by_native == ()  # the 3-token chunk: rows of the decode call
    calls = _spy(decode_kernel)
    try:
        out = torch.full_like(query, float("nan"))
        backend.forward(query, key, value, out, kv_cache, meta, 0.3, 0)
    finally:
        del decode_kernel.prefill
    assert calls == ([[[41, 9, 9, 2], [50, 25, 25, 3]]] if decode_kernel.prefills else [])
    want = _dense(kv_cache.float(), common, query.float(), 0, 0.3)
    torch.testing.assert_close(out.float(), want.to(torch.bfloat16).float(), atol=1e-2, rtol=2 ** -7)


@pytest.mark.parametrize("window", [0, 21])
@pytest.mark.parametrize("block_size", [16, 32, 48])  # one, two and three (the last partial) batches of 16 rows
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_decode_kernel_with_large_blocks(decode_kernel, kernel_only, block_size: int, window: int,
                                               dtype) -> None:
    kv_cache, common, query, key, value = _step([1, 1, 1], [45, 7, 100], seed=7, kv_heads=2, group=3, head_dim=64,
                                                block_size=block_size)
    kv_cache, query, key, value = (t.to(dtype) for t in (kv_cache, query, key, value))
    backend = TorchAttentionBackend().with_decode_kernel(decode_kernel)
    out = torch.full_like(query, float("nan"))
    backend.forward(query, key, value, out, kv_cache, backend.build_metadata(common), 0.3, window)
    want = _dense(kv_cache.float(), common, query.float(), window, 0.3)
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out.float(), want.to(torch.bfloat16).float(), atol=1e-2, rtol=2 ** -7)


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("kv_heads, group, head_dim", [(2, 3, 8), (3, 3, 64), (1, 4, 128)])
@pytest.mark.parametrize("q_lens, seq_lens", [([1], [13]), ([1, 1, 6, 1, 1], [12, 5, 10, 20, 2])])
def test_the_c_decode_kernel_in_bf16_equals_fp32_attention_of_the_same_values(
        decode_kernel, kernel_only, q_lens, seq_lens, window: int, kv_heads: int, group: int, head_dim: int) -> None:
    kv_cache, common, query, key, value = _step(q_lens, seq_lens, seed=5, kv_heads=kv_heads, group=group,
                                                head_dim=head_dim)
    kv_cache, query, key, value = (t.to(torch.bfloat16) for t in (kv_cache, query, key, value))
    backend = TorchAttentionBackend().with_decode_kernel(decode_kernel)
    out = torch.full_like(query, float("nan"))
    backend.forward(query, key, value, out, kv_cache, backend.build_metadata(common), 0.3, window)
    # every row by the kernel (the chunk's too: it is short), every score and
    # sum in fp32 from the bf16 values, the output rounded once
    want = _dense(kv_cache.float(), common, query.float(), window, 0.3)
    torch.testing.assert_close(out.float(), want.to(torch.bfloat16).float(), atol=1e-2, rtol=2 ** -7)


def _share(kernel, seq_lens: list[int], heads: int, kv_heads: int, block_size: int, window: int,
           threads: int) -> tuple[int, int]:
    """The kernel's split of a step's work: (KV heads an item, runs a request)."""
    lib = ctypes.CDLL(str(kernel.path))
    lens = (ctypes.c_int32 * len(seq_lens))(*seq_lens)
    out = (ctypes.c_int64 * 2)()
    i = ctypes.c_int64
    lib.kiln_decode_share.argtypes = [i, i, i, i, i, ctypes.c_void_p, i, ctypes.c_void_p]
    lib.kiln_decode_share(len(seq_lens), heads, kv_heads, block_size, window, lens, threads, out)
    return out[0], out[1]


@pytest.mark.parametrize("threads", [2, 3, 4])
@pytest.mark.parametrize("window", [0, 90])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads, group, seq_lens", [(3, 3, [200]), (1, 9, [150]), (1, 4, [130, 201])])
def test_the_c_decode_kernel_splits_long_requests_among_idle_threads(
        decode_kernel, kernel_only, threads: int, window: int, dtype, kv_heads: int, group: int,
        seq_lens: list[int]) -> None:
    """Fewer requests x KV heads than twice the threads: each request's blocks
    are cut into runs, a work item each, and the runs' softmaxes merged."""
    block_size, head_dim = 16, 64
    runs = _share(decode_kernel, seq_lens, kv_heads * group, kv_heads, block_size, window, threads)
    attended = max(min(n, window or n) for n in seq_lens)
    want_runs = min(-(-threads // len(seq_lens)), (attended + block_size - 1) // block_size // 4)
    assert runs == ((kv_heads, want_runs) if want_runs > 1 else (1, 1))
    kv_cache, common, query, key, value = _step([1] * len(seq_lens), seq_lens, seed=11, kv_heads=kv_heads,
                                                group=group, head_dim=head_dim, block_size=block_size)
    _check_on_threads(decode_kernel, threads, dtype, kv_cache, common, query, key, value, window)


def _check_on_threads(kernel, threads: int, dtype, kv_cache, common, query, key, value, window: int) -> None:
    """The kernel's step on ``threads`` threads in ``dtype`` against dense attention."""
    kv_cache, query, key, value = (t.to(dtype) for t in (kv_cache, query, key, value))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # DecodeStep hands the kernel torch's thread count
    try:
        backend = TorchAttentionBackend().with_decode_kernel(kernel)
        out = torch.full_like(query, float("nan"))
        backend.forward(query, key, value, out, kv_cache, backend.build_metadata(common), 0.3, window)
    finally:
        torch.set_num_threads(before)
    want = _dense(kv_cache.float(), common, query.float(), window, 0.3)
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out.float(), want.to(torch.bfloat16).float(), atol=1e-2, rtol=2 ** -7)


def test_the_c_decode_kernel_keeps_short_requests_whole(decode_kernel) -> None:
    """A run is at least 4 blocks: shorter requests keep a KV head an item,
    and enough requests or KV heads keep the threads busy unsplit."""
    assert _share(decode_kernel, [63], 9, 3, 16, 0, 2) == (1, 1)  # 4 blocks: one run
    assert _share(decode_kernel, [200], 9, 3, 16, 20, 2) == (1, 1)  # the window's 2 blocks
    assert _share(decode_kernel, [128], 9, 3, 16, 0, 2) == (3, 2)
    assert _share(decode_kernel, [500, 500], 9, 3, 16, 0, 2) == (1, 1)  # 6 items for 2 threads
    assert _share(decode_kernel, [500] * 4, 9, 3, 16, 0, 2) == (3, 1)  # a request an item


def _thread_shares(kernel, seq_lens: list[int], block_size: int, window: int, threads: int) -> list[tuple[int, int]]:
    """The items [first, last) each thread takes, a request an item."""
    lib = ctypes.CDLL(str(kernel.path))
    lens = (ctypes.c_int32 * len(seq_lens))(*seq_lens)
    i = ctypes.c_int64
    lib.kiln_decode_thread_share.argtypes = [ctypes.c_void_p, i, i, i, i, i, i, i, ctypes.c_void_p]
    shares = []
    for t in range(threads):
        out = (ctypes.c_int64 * 2)()
        lib.kiln_decode_thread_share(lens, window, block_size, 1, 1, len(seq_lens), t, threads, out)
        shares.append((out[0], out[1]))
    return shares


@pytest.mark.parametrize("threads", [2, 3, 5])
@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("seq_lens", [[600] * 32 + [60] * 32, list(range(670, 30, -10)), [330] * 64, [5, 900, 7, 3]])
def test_the_c_decode_kernel_shares_requests_by_their_length(decode_kernel, seq_lens: list[int], window: int,
                                                             threads: int) -> None:
    """Each thread takes a contiguous run of the requests, together all of them
    once, each run within one request's cost of an equal share of the
    positions (a block's worth added per request): a batch whose oldest
    requests are the longest no longer leaves one thread waiting."""
    block_size = 16
    shares = _thread_shares(decode_kernel, seq_lens, block_size, window, threads)
    nonempty = [(a, b) for a, b in shares if a < b]
    assert [i for a, b in nonempty for i in range(a, b)] == list(range(len(seq_lens)))
    cost = [min(n, window or n) + block_size for n in seq_lens]
    fair = sum(cost) / threads
    for a, b in shares:
        assert abs(sum(cost[a:b]) - fair) <= max(cost), (shares, fair)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_decode_kernel_over_requests_of_very_different_lengths(decode_kernel, kernel_only, threads: int,
                                                                     dtype) -> None:
    seq_lens = [90, 75, 40, 17, 2, 1]  # a request an item for 2 and 3 threads; the first ones the longest
    kv_cache, common, query, key, value = _step([1] * len(seq_lens), seq_lens, seed=15, kv_heads=3, group=3,
                                                head_dim=64, block_size=16)
    _check_on_threads(decode_kernel, threads, dtype, kv_cache, common, query, key, value, 0)


def test_a_decode_step_over_the_same_buffers_reuses_its_kernel_step(decode_kernel, kernel_only) -> None:
    """The runner's inputs are the same tensors each step: the backend hands
    the kernel the same DecodeStep, which reads what the buffers hold now (the
    next token's length and slot, written in place)."""
    kv_cache, common, query, key, value = _step([1, 1], [13, 9], seed=12)
    backend = TorchAttentionBackend().with_decode_kernel(decode_kernel)
    first = backend.build_metadata(common)
    out = torch.full_like(query, float("nan"))
    backend.forward(query, key, value, out, kv_cache, first, 0.3, 0)
    torch.testing.assert_close(out, _dense(kv_cache, common, query, 0, 0.3), atol=1e-5, rtol=1e-5)

    # the next step: request 0 one token further, written into the same tensors
    common.seq_lens[0] = 14
    common.slot_mapping[0] = int(common.block_table[0, 13 // BLOCK_SIZE]) * BLOCK_SIZE + 13 % BLOCK_SIZE
    common = replace(common, seq_lens_cpu=common.seq_lens.numpy().copy(), max_seq_len=14)
    second = backend.build_metadata(common)
    assert second.native is first.native
    g = torch.Generator().manual_seed(13)
    query, key, value = (torch.randn(t.shape, generator=g) for t in (query, key, value))
    out = torch.full_like(query, float("nan"))
    backend.forward(query, key, value, out, kv_cache, second, 0.3, 0)
    torch.testing.assert_close(out, _dense(kv_cache, common, query, 0, 0.3), atol=1e-5, rtol=1e-5)

    # other tensors, or requests no longer consecutive: a step of their own
    assert backend.build_metadata(replace(common, seq_lens=common.seq_lens.clone())).native is not first.native
    mixed = backend.build_metadata(_step([1, 3, 1], [5, 8, 6], seed=14)[1]).native
    assert mixed is not first.native and mixed.num_rows == 5  # 2 decodes and the chunk's 3 tokens


def test_the_c_decode_kernel_leaves_other_dtypes_to_the_torch_path(decode_kernel) -> None:
    kv_cache, common, query, key, value = _step([1, 1, 3], [6, 9, 3], seed=3)
    kv_cache, query, key, value = (t.to(torch.float16) for t in (kv_cache, query, key, value))
    backend = TorchAttentionBackend().with_decode_kernel(decode_kernel)
    out = torch.zeros_like(query)
    meta = backend.build_metadata(common)
    before = kv_cache.clone()
    assert not decode_kernel.layer(query, key, value, out, kv_cache, meta.native, 0.3, 0)
    assert torch.equal(kv_cache, before)  # refused before anything was written
    backend.forward(query, key, value, out, kv_cache, meta, 0.3, 0)
    reference = _dense(kv_cache.float(), common, query.float(), 0, 0.3)
    torch.testing.assert_close(out.float(), reference, atol=3e-2, rtol=3e-2)


def test_the_kv_cache_starts_zeroed_even_on_reused_memory() -> None:
    # Batched decode reads slots no request wrote (masked padding); NaN there
    # would still poison the softmax, so the loader's cache must start as zeros
    # even where the allocator hands back memory that held NaN.
    from types import SimpleNamespace

    from kiln.engine.loader import allocate_kv_cache

    config = SimpleNamespace(model=SimpleNamespace(num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, num_layers=3),
                             block_size=BLOCK_SIZE, dtype=torch.float32, device=torch.device("cpu"))
    numel = 2 * NUM_BLOCKS * BLOCK_SIZE * KV_HEADS * HEAD_DIM
    for _ in range(3):
        garbage = [torch.full((numel,), float("nan")) for _ in range(3)]
        del garbage
        caches = allocate_kv_cache(config, NUM_BLOCKS)
        assert [tuple(c.shape) for c in caches] == [(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)] * 3
        assert all(int(torch.count_nonzero(c)) == 0 for c in caches)
        caches[0].fill_(1.0)  # writable, and the layers do not overlap
        assert int(torch.count_nonzero(caches[1])) == 0


def test_the_c_kv_write_equals_index_copy(decode_kernel) -> None:
    """Keys and values as the model hands them over (views of the fused q/k/v
    projection, rows strided) land where ``write_kv_cache`` puts them."""
    torch.manual_seed(4)
    blocks, block_size, kv_heads, head_dim, tokens = 6, 4, 2, 8, 5
    fused = torch.randn(tokens, 3 * kv_heads, head_dim)
    key, value = fused[:, kv_heads:2 * kv_heads], fused[:, 2 * kv_heads:]
    slots = torch.tensor([3, 17, 0, 22, 9])
    want = torch.zeros(2, blocks, block_size, kv_heads, head_dim)
    write_kv_cache(key, value, want, slots)

    def layer(key, value, cache, slots) -> bool:  # a step of new tokens and no single-query request
        step = DecodeStep(torch.empty(0, dtype=torch.int64), torch.zeros(0, 1, dtype=torch.int32),
                          torch.empty(0, dtype=torch.int32), slots, tokens)
        query = fused[:, :kv_heads].to(key.dtype)
        return decode_kernel.layer(query, key, value, torch.empty_like(query), cache, step, 1.0, 0)

    got = torch.zeros_like(want)
    assert layer(key, value, got, slots)
    assert torch.equal(got, want)
    with pytest.raises(IndexError, match="outside the cache's 24 slots"):
        layer(key, value, got, torch.tensor([3, 17, 0, 24, 9]))
    want16, got16 = want.to(torch.bfloat16), torch.zeros_like(want, dtype=torch.bfloat16)
    assert layer(key.to(torch.bfloat16), value.to(torch.bfloat16), got16, slots)
    assert torch.equal(got16, want16)
    # what the kernel does not take is left to the torch path
    assert not layer(key.double(), value.double(), got.double(), slots)


def test_a_library_built_before_the_prefill_kernel_still_decodes(tmp_path) -> None:
    """A library an older kiln built (an entry or a bundle naming it) has no
    prefill: the kernel says so and the backend keeps its other paths."""
    from kiln.attention.cpu_attention import SOURCE, CpuAttentionKernel
    from kiln.native import NativeSource

    source = SOURCE.path.read_text()
    old = tmp_path / "cpu_attention.c"
    cut = source.index("------------------------ prefill")  # the prefill section's opening comment
    old.write_text(source[: source.rindex("/*", 0, cut)])
    kernel = CpuAttentionKernel(tmp_path / NativeSource(old, "old-attention").build(tmp_path))
    assert not kernel.prefills
    kv_cache, common, query, key, value = _step([1, 12, 1], [9, 12, 4], seed=6, kv_heads=2, group=3, head_dim=64)
    backend = TorchAttentionBackend().with_decode_kernel(kernel)
    meta = backend.build_metadata(common)
    assert meta.prefill == () and meta.native is not None
    out = torch.full_like(query, float("nan"))
    backend.forward(query, key, value, out, kv_cache, meta, 0.3, 0)
    torch.testing.assert_close(out, _dense(kv_cache, common, query, 0, 0.3), atol=1e-5, rtol=1e-5)
