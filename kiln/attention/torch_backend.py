"""The torch attention backend: the reference, and the CPU path.

Decode tokens (one query each) of a step go through one batched SDPA call over
their blocks gathered and padded to the longest context, or, on CPU with the C
kernel a compiled entry brings (``kiln.attention.cpu_attention``), through that
kernel, which writes the layer's new keys and values and reads the cache in
place in one call; prefill chunks walk their requests in Python with host-side
lengths, one SDPA call each, except that with the kernel a short chunk of a
longer context has its tokens as rows of the decode call
(``TorchAttentionBackend.native_chunk_pairs``) and the other chunks are one
call of its causal prefill over the cache. Host-side lengths mean it can
never sit inside a FULL CUDA graph.

With the C kernel, a step of single-query requests is one kernel call a
layer whose per-step values (rows, block tables, lengths, slots) the kernel
reads from one structure at a fixed address, rewritten by each step's
``build_metadata``: a CPU call graph (``kiln.graphs.cpu``) replays those calls
for uniform decode steps.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kiln.attention.backend import AttentionBackend, CommonAttentionMetadata
from kiln.attention.cpu_attention import CpuAttentionKernel, DecodeStep, StepArgs
from kiln.config import CUDAGraphSupport

__all__ = ["TorchAttentionBackend", "TorchAttentionMetadata", "paged_attention_torch", "write_kv_cache"]


@dataclass(frozen=True)
class DecodeBatch:
    """The step's single-query requests, attended to in one batched call.

    Row ``b`` is the query token at ``rows[b]``; its keys are the cache blocks
    ``blocks[b]`` laid end to end, of which the first ``seq_lens[b]`` positions
    are real (``valid[b]``); the rest is padding up to the longest context."""

    rows: torch.Tensor | slice  # query token rows, a slice when they are contiguous
    blocks: torch.Tensor  # [B, max_blocks] block ids (columns past a context: any valid id)
    seq_lens: torch.Tensor  # [B] context lengths, on the device
    positions: torch.Tensor  # [max_blocks * block_size]: 0, 1, ... (sliding windows compare to them)
    valid: torch.Tensor  # [B, 1, 1, max_blocks * block_size] bool: the real key positions


@dataclass(frozen=True)
class TorchAttentionMetadata:
    num_actual_tokens: int
    num_reqs: int
    query_start_loc: list[int]  # host
    seq_lens: list[int]  # host
    num_blocks: list[int]  # host: blocks each request's context spans
    block_table: torch.Tensor  # device
    slot_mapping: torch.Tensor  # device
    per_request: tuple[int, ...]  # requests attended to one by one (all of them when decode is None)
    # the step for the C kernel, when the backend has one: the new tokens' slots,
    # the single-query requests (those of ``decode``, or none) and, a row per
    # token, the short chunks (those of ``per_request`` neither in ``prefill`` nor in ``left_by_native``)
    native: DecodeStep | None = None
    # the requests of ``per_request`` left to SDPA when the C kernel takes the
    # layer: the chunks too long for it (``native_chunk_pairs``) where it has no prefill
    left_by_native: tuple[int, ...] = ()
    # the chunks of ``per_request`` for the C kernel's causal prefill, fewest
    # (query, key) pairs first, with their context lengths and, for the kernel,
    # [first row, rows, context, block-table row] ([n, 4] int64); in bf16 it
    # takes the first ``prefill_bf16`` (``TorchAttentionBackend.native_prefill_bf16_pairs``)
    prefill: tuple[int, ...] = ()
    prefill_contexts: tuple[int, ...] = ()
    prefill_chunks: torch.Tensor | None = None
    prefill_bf16: int = 0
    # what ``decode`` is gathered from, on its first use: the step's metadata and
    # the batched single-query requests (empty: none)
    common: CommonAttentionMetadata | None = None
    decodes: tuple[int, ...] = ()

    @functools.cached_property
    def decode(self) -> DecodeBatch | None:
        """The batched single-query requests for the torch path, when there are
        several (or any, with the C kernel). Gathered on first use: with the C
        kernel no layer needs it, and making it cost 0.15 ms a step (cProfile,
        a batch-1 bf16 decode of the demo model)."""
        if not self.decodes or self.common is None:
            return None
        return _decode_batch(self.common, list(self.decodes), self.query_start_loc, self.seq_lens, self.num_blocks)


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
    *,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Attention over the paged cache: the decode batch in one SDPA call, every
    other request in one SDPA call of its own. ``new_kv``: the step's keys and
    values ([T, kv_heads, head_dim]), already written to the cache, which a
    chunk with no cached prefix then reads as they are instead of gathering
    its blocks.

    Queries of a request are the last ``q_len`` positions of its ``seq_len``-long
    context, so a prefill chunk sees its cached prefix plus itself causally and a
    decode token sees everything. Grouped-query heads share their KV head
    without a copy of it: folded into the query length in the decode batch,
    SDPA's ``enable_gqa`` in the others.
    """
    if meta.decode is not None:
        _decode_attention(query, kv_cache[0], kv_cache[1], out, meta.decode, scale, sliding_window)
    _attend_each(query, kv_cache, out, meta, scale, sliding_window, new_kv, meta.per_request)


def _attend_each(query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, meta: TorchAttentionMetadata,
                 scale: float, sliding_window: int, new_kv: tuple[torch.Tensor, torch.Tensor] | None,
                 requests: tuple[int, ...]) -> None:
    """The ``requests`` (of ``meta.per_request``), one SDPA call each, its grouped
    query heads sharing their KV head inside SDPA (``enable_gqa``). A chunk
    with no cached prefix and no window cut is plainly causal (``is_causal``),
    which lets SDPA's fused kernel skip the blocks above the diagonal where a
    mask makes it compute and discard them. One layer of the 135M shape in
    bf16, 2 threads, against the queries folded into one KV head's rows and
    a mask: a 512-token prompt 1.0 against 1.65 ms, 2048 tokens 10.0 against
    23.9 ms, a prefill step of 21 prompts of 16-128 tokens 2.6-2.9 ms against
    4.6 (scratch timings)."""
    if not requests:
        return
    grouped = query.shape[1] != kv_cache.shape[-2]  # query heads against KV heads
    qsl, seq_lens, nblocks = meta.query_start_loc, meta.seq_lens, meta.num_blocks
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    if new_kv is not None and new_kv[0].dtype != kv_cache.dtype:
        new_kv = None  # the cache holds other values than the step computed: read them there
    for i in requests:
        start, end = qsl[i], qsl[i + 1]
        q_len, ctx = end - start, seq_lens[i]
        if q_len == 0:
            continue
        if new_kv is not None and ctx == q_len:  # no cached prefix: the chunk's own keys and values
            k, v = new_kv[0][start:end], new_kv[1][start:end]
        else:
            blocks = meta.block_table[i, : nblocks[i]]
            k = key_cache.index_select(0, blocks).flatten(0, 1)[:ctx]
            v = value_cache.index_select(0, blocks).flatten(0, 1)[:ctx]
        # [ctx, KV, D] -> [1, KV, ctx, D]; the queries [q_len, H, D] -> [1, H, q_len, D]:
        # 4-D inputs let SDPA take its fused CPU kernel
        k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        q = query[start:end].transpose(0, 1).unsqueeze(0)
        causal = q_len == ctx and q_len > 1 and not (sliding_window > 0 and ctx > sliding_window)
        mask = None if causal else _mask(ctx, q_len, sliding_window, query.device)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                           enable_gqa=grouped)
        out[start:end].copy_(o[0].transpose(0, 1))


def _decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    batch: DecodeBatch,
    scale: float,
    sliding_window: int,
) -> None:
    """One SDPA call for all single-query requests: [B, KV, group, D] queries
    against their gathered blocks, padding masked out.

    One call per request paid the gather's and SDPA's fixed cost for every
    request on every layer: 64 requests of the 135M shape decoded at about 540
    ms a step that way and about 405 ms batched, run back to back
    (bench/results/decode-throughput-cpu-20261201-111605.json against
    -111731.json). The padding up to the longest context costs little: the
    keys are a few MB a layer."""
    num_b, max_blocks = batch.blocks.shape
    block_size, num_kv_heads, head_dim = key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    flat = batch.blocks.reshape(-1)
    # [B * max_blocks, bs, KV, D] -> [B, KV, L, D]
    k = key_cache.index_select(0, flat).view(num_b, max_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)
    v = value_cache.index_select(0, flat).view(num_b, max_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)
    valid = batch.valid
    if sliding_window > 0:
        valid = valid & (batch.positions > batch.seq_lens[:, None] - 1 - sliding_window)[:, None, None, :]
    q = query[batch.rows].view(num_b, num_kv_heads, group, head_dim)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=valid, scale=scale)
    out[batch.rows] = o.reshape(num_b, num_heads, head_dim)


def _decode_batch(common: CommonAttentionMetadata, decodes: list[int], qsl: list[int], seq_lens: list[int],
                  num_blocks: list[int]) -> DecodeBatch:
    """Gather the decode requests' rows, blocks and key mask once per step (all
    layers share them); ``qsl``, ``seq_lens`` and ``num_blocks`` are host lists.

    Block-table columns past a request's last block hold zeros or ids of earlier
    requests: valid block ids whose keys the mask hides, so they need no fixing."""
    device = common.block_table.device
    contiguous = decodes[-1] - decodes[0] == len(decodes) - 1
    index = slice(decodes[0], decodes[-1] + 1) if contiguous else torch.tensor(decodes, device=device)
    # A single-query request's token sits at its query start; consecutive
    # requests' tokens are consecutive rows.
    rows = (slice(qsl[decodes[0]], qsl[decodes[0]] + len(decodes)) if contiguous
            else torch.tensor([qsl[i] for i in decodes], device=device))
    max_blocks = max(num_blocks[i] for i in decodes)
    blocks = common.block_table[index, :max_blocks].to(torch.int64)
    lens = torch.tensor([seq_lens[i] for i in decodes], device=device)
    positions = torch.arange(max_blocks * common.block_size, device=device)
    valid = (positions[None, :] < lens[:, None])[:, None, None, :]
    return DecodeBatch(rows=rows, blocks=blocks, seq_lens=lens, positions=positions, valid=valid)


class _NativeSteps:
    """Each step as the C kernel takes it (a ``DecodeStep``), written into one
    ``StepArgs``: its address stays fixed for CPU call graphs, which replay the
    kernel's calls with the address they captured.

    A decode step over the same rows as the step before (the runner's inputs
    are views of persistent buffers, the same tensors each step) hands back the
    same ``DecodeStep``, since its pointers and sizes would all be the same:
    building one took 33 us of a batch-1 Q8_0 CPU step, its torch calls slow
    between kernels that leave the caches cold (scratch timing)."""

    def __init__(self) -> None:
        self.args = StepArgs()
        self._last: DecodeStep | None = None
        self._last_key: tuple[int, ...] = ()  # what the last step was built from, with:
        self._last_tensors: tuple[torch.Tensor, ...] = ()  # compared by identity

    def step(self, common: CommonAttentionMetadata, decodes: list[int], qsl: list[int],
             seq_lens: list[int], chunks: list[int]) -> DecodeStep:
        """The single-query requests' rows, block tables and lengths (none in a
        step of prefills only), then a row for each token of the ``chunks``
        (requests of several query tokens), of the length its causal context
        has, and the new tokens' slots."""
        if chunks or not (decodes and decodes[-1] - decodes[0] == len(decodes) - 1):
            self._last = None
            rows, owners, lens = [qsl[i] for i in decodes], list(decodes), [seq_lens[i] for i in decodes]
            for i in chunks:
                start, q_len = qsl[i], qsl[i + 1] - qsl[i]
                first = seq_lens[i] - q_len + 1  # the chunk's first token sees the cached prefix and itself
                rows.extend(range(start, start + q_len))
                owners.extend([i] * q_len)
                lens.extend(range(first, first + q_len))
            # the columns the longest context spans: a prefill step's rows number in the thousands
            width = max(-(-seq_lens[i] // common.block_size) for i in (*decodes, *chunks)) if owners else 0
            table = common.block_table[torch.tensor(owners, dtype=torch.int64), :width]
            return DecodeStep(torch.tensor(rows, dtype=torch.int64), table, torch.tensor(lens, dtype=torch.int32),
                              common.slot_mapping, common.num_actual_tokens, self.args)
        # consecutive requests: consecutive rows, and views of the step's buffers
        first, d0, d1 = qsl[decodes[0]], decodes[0], decodes[-1] + 1
        key = (first, d0, d1, common.num_actual_tokens, torch.get_num_threads())
        tensors = (common.block_table, common.seq_lens, common.slot_mapping)
        if (self._last is not None and key == self._last_key
                and all(a is b for a, b in zip(tensors, self._last_tensors))):
            return self._last
        self._last = DecodeStep(torch.arange(first, first + len(decodes)), common.block_table[d0:d1],
                                common.seq_lens[d0:d1], common.slot_mapping, common.num_actual_tokens, self.args)
        self._last_key, self._last_tensors = key, tensors
        return self._last


def _pairs(q_len: int, ctx: int) -> int:
    """The (query, key) pairs of a chunk of ``q_len`` tokens at the end of a
    ``ctx``-long context, each token seeing those before it and itself."""
    return q_len * (ctx - q_len) + q_len * (q_len + 1) // 2


def _mask(ctx: int, q_len: int, sliding_window: int, device: torch.device) -> torch.Tensor | None:
    """Causal (and sliding-window) mask ``[q_len, ctx]`` of ``q_len`` queries at
    the end of a ``ctx``-long context; None when nothing is masked."""
    if q_len == 1 and not (sliding_window > 0 and ctx > sliding_window):
        return None
    q_pos = torch.arange(ctx - q_len, ctx, device=device)[:, None]
    k_pos = torch.arange(ctx, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window > 0:
        mask &= k_pos > q_pos - sliding_window
    return mask


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    cudagraph_support = CUDAGraphSupport.NEVER
    #: Fewest single-query requests that go through the batched call; below it
    #: each is attended to alone (one request needs no padding or mask). With
    #: the C kernel every single-query request goes through it.
    min_decode_batch = 2
    #: With the C kernel, the most (query, key) pairs a chunk of several
    #: tokens may have for the kernel to attend to it, a row per token, in its
    #: call for the layer (``_pairs``); longer chunks take one SDPA call each.
    #: The kernel reads the chunk's keys again for each of its tokens, where
    #: SDPA's fused kernel multiplies tiles of them, but SDPA's call with the
    #: views around it takes 70-80 us a chunk a layer even for a short one,
    #: and the kernel's rows about 30 ns a pair (4 us for 16 tokens, 60 for
    #: 64). Prefill steps of the 135M shape in bf16, 2 threads of an Intel
    #: Xeon, median of 7 taking turns (scratch A/B, 2026-12-05), against SDPA
    #: for every chunk: 16 prompts of 24 tokens 92 against 118 ms, 32 of 40
    #: tokens 267 against 321, 12 of 90 tokens 265 against 285, 8 of 64 tokens
    #: 130 against 133, one of 20 tokens 18.9 against 21.1.
    native_chunk_pairs = 4096
    #: With the C kernel, the most (query, key) pairs a chunk in bf16 may have
    #: for its causal prefill (a fresh prompt of 256 tokens); larger ones take
    #: one SDPA call each. The kernel's sums run in fp32 vector lanes, where
    #: SDPA's bf16 kernel multiplies bf16 tiles: one prompt of the 135M shape,
    #: 2 threads of an Intel Xeon (scratch timings, 2026-12-07), 128 tokens
    #: 0.12 ms against SDPA's 0.10 (and 20 us of Python a call in the loop),
    #: 512 tokens 1.15 against 0.98, 2048 17.4 against 7.9; in fp32 the kernel
    #: was ahead at all three (0.10 against 0.18, 1.3 against 2.3, 17 against
    #: 20 ms).
    native_prefill_bf16_pairs = 256 * 257 // 2

    def __init__(self, decode_kernel: CpuAttentionKernel | None = None) -> None:
        self.decode_kernel = decode_kernel
        self.native_steps = _NativeSteps()
        if decode_kernel is not None:
            # a uniform decode step's attention is then the kernel's calls alone (CPU call graphs)
            self.cudagraph_support = CUDAGraphSupport.UNIFORM_DECODE

    def with_decode_kernel(self, kernel: CpuAttentionKernel | None) -> TorchAttentionBackend:
        return self if kernel is self.decode_kernel else TorchAttentionBackend(kernel)

    def build_metadata(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        seq_lens = common.seq_lens_cpu.tolist()
        qsl = common.query_start_loc_cpu.tolist()
        bs = common.block_size
        num_blocks = [-(-n // bs) for n in seq_lens]
        reqs = range(common.num_reqs)
        decodes = [i for i in reqs if qsl[i + 1] - qsl[i] == 1]
        native = self.decode_kernel is not None
        batched = len(decodes) >= (1 if native else self.min_decode_batch)
        per_request = tuple(i for i in reqs if qsl[i + 1] - qsl[i] != 1) if batched else tuple(reqs)
        pairs = {i: _pairs(qsl[i + 1] - qsl[i], seq_lens[i]) for i in per_request} if native else {}
        # a short chunk of a longer context: a row a token in the decode call; where the kernel has its
        # prefill, every other chunk (a fresh prompt, a longer chunk) goes to the prefill call, else to SDPA
        prefills = native and self.decode_kernel.prefills
        chunks = [i for i in per_request if pairs[i] <= self.native_chunk_pairs
                  and not (prefills and seq_lens[i] == qsl[i + 1] - qsl[i] > 0)] if native else []
        rows = set(chunks)
        rest = tuple(i for i in per_request if i not in rows)
        prefill = tuple(sorted(rest, key=pairs.__getitem__)) if prefills else ()
        return TorchAttentionMetadata(
            num_actual_tokens=common.num_actual_tokens,
            num_reqs=common.num_reqs,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            num_blocks=num_blocks,
            block_table=common.block_table,
            slot_mapping=common.slot_mapping,
            per_request=per_request,
            native=self.native_steps.step(common, decodes, qsl, seq_lens, chunks) if native else None,
            left_by_native=() if prefills else rest,
            prefill=prefill,
            prefill_contexts=tuple(seq_lens[i] for i in prefill),
            prefill_chunks=torch.tensor([[qsl[i], qsl[i + 1] - qsl[i], seq_lens[i], i] for i in prefill],
                                        dtype=torch.int64) if prefill else None,
            prefill_bf16=bisect.bisect_right([pairs[i] for i in prefill], self.native_prefill_bf16_pairs),
            common=common,
            decodes=tuple(decodes) if batched else (),
        )

    def forward(self, query, key, value, out, kv_cache, meta, scale, sliding_window) -> None:  # noqa: ANN001
        # Only real rows: the padding beyond them never reaches the cache, so the
        # write needs no per-step check for negative slots.
        n = meta.num_actual_tokens
        if key.shape[0] != n:
            query, key, value = query[:n], key[:n], value[:n]
        step, kernel = meta.native, self.decode_kernel
        if step is not None and kernel is not None and kernel.layer(query, key, value, out, kv_cache, step, scale,
                                                                    sliding_window):
            left = meta.left_by_native
            if meta.prefill:
                taken = meta.prefill_bf16 if query.dtype == torch.bfloat16 else len(meta.prefill)
                if taken and (0 < sliding_window < max(meta.prefill_contexts[:taken])  # a window cuts: not causal
                              or not kernel.prefill(query, out, kv_cache, meta.block_table,
                                                    meta.prefill_chunks[:taken], scale)):
                    taken = 0
                left = left + meta.prefill[taken:]
            _attend_each(query, kv_cache, out, meta, scale, sliding_window, (key, value), left)
            return
        if n:
            write_kv_cache(key, value, kv_cache, meta.slot_mapping)
        paged_attention_torch(query, kv_cache, out, meta, scale, sliding_window, new_kv=(key, value))
