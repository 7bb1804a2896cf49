"""kiln's Triton attention kernels on a GPU: paged decode, paged prefill, KV write.

Run from the repository root on a CUDA machine::

    python -m bench.attention_kernels                 # the full cases below, bf16
    python -m bench.attention_kernels --tiny          # small shapes (a quick check)

Without CUDA it exits with status 2. ``--device cpu --tiny`` is a smoke test of
this script only: the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``
is set before they are imported) and the timings mean nothing.

Cases (bf16, head_dim 128, KV cache block size 16, block tables a random
permutation of the cache's blocks, unused cache slots NaN):

* ``decode``: ``paged_attention_triton`` for 32 requests x 2048 context positions,
  one query token each, at two head layouts: 32 query / 8 KV heads (GQA group 4,
  Llama-3-8B's) and 16 / 8 (group 2, Qwen3-0.6B's). Reported as GB/s over the
  fewest bytes the step must move (every cached K/V row once, q, out, block
  table) against the H200's copy bandwidth (``--peak-gbps``, 4300 by default: a
  device-to-device copy measured on this workplace's H200; datasheet 4800).
  ``torch.nn.functional.scaled_dot_product_attention`` on dense, unpaged tensors
  of the same shapes is timed alongside (same byte count: an effective rate).
* ``prefill``: ``paged_attention_triton`` causal over 4096 tokens of one request
  and over 4 requests x 1024, 32 / 8 heads, no cached prefix (the prompt's K/V are
  already in the cache, as kiln writes them before attending). Reported as TFLOP/s
  counting ``2 * 2 * T * T / 2 * heads * head_dim`` per request (QK^T and PV,
  causal half) against SDPA(``is_causal=True``) on the dense equivalent tensors,
  timed the same way (with GQA, the faster of ``enable_gqa=True`` and K/V heads
  repeated beforehand; both are in the JSON), and against ``--peak-tflops`` (790 by default: a bf16 matrix
  product measured on this workplace's H200; datasheet about 990).
* ``kv-write``: ``write_kv_cache_triton`` of 32 and of 4096 tokens (8 KV heads) to
  random distinct slots. GB/s over K and V read once and written once plus the
  slot mapping. 32 tokens move 256 KiB: that row measures launch latency.

Before timing, each kernel's output is checked once against a dense fp32
reference computed from the same bf16 inputs (SDPA in fp32 per request, the
K/V heads repeated for GQA); the maximum absolute error is printed and asserted
within the bf16 tolerance of ``tests/test_triton_kernels.py`` (atol 3e-2, rtol
2e-2); the output is poisoned with NaN beforehand so an unwritten element fails.
The KV write is checked exactly, and that it wrote nothing else.

Timing: CUDA events around each call, median (and 20th/80th percentiles) of as
many calls as fit in ``--rep-ms`` after ``--warmup-ms`` of warm-up, a 256 MiB
buffer zeroed before every call so that no input is served from L2 (the method
of ``triton.testing.do_bench``).

It prints a table and writes JSON to
``bench/results/attention-kernels-<device>-<timestamp>.json`` (and
``attention-kernels-<device>-latest.json``). Exit status: 0 when every check
passed, 1 when one failed (the JSON is written all the same), 2 when the device
is not usable.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.common.harness import timing_summary
from bench.common.report import RESULTS_DIR, RunRecord, fmt, format_table, publish

H200_COPY_GBPS = 4300.0  # device-to-device copy, bytes read + written, measured here (datasheet 4800)
H200_BF16_TFLOPS = 790.0  # 8192^3 bf16 matmul on random data, measured here (datasheet ~990)
TOLERANCE = {"atol": 3e-2, "rtol": 2e-2}  # bf16, as tests/test_triton_kernels.py
FLUSH_BYTES = 256 * 2**20  # > the H200's 60 MB L2
SEED = 0


# ----------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class AttentionCase:
    """One paged attention launch: ``q_lens[i]`` query tokens of request ``i``,
    whose context (cached K/V, this step's tokens included) is ``seq_lens[i]``."""

    name: str
    kind: str  # "decode" | "prefill"
    q_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    @property
    def shape(self) -> str:
        reqs = len(self.q_lens)
        if self.kind == "decode":
            return (f"{reqs} req x ctx {self.seq_lens[0]}, heads {self.num_heads}/{self.num_kv_heads} kv, "
                    f"d {self.head_dim}")
        lens = f"{reqs} x {self.q_lens[0]}" if reqs > 1 else f"{self.q_lens[0]}"
        return f"{lens} tokens causal, heads {self.num_heads}/{self.num_kv_heads} kv, d {self.head_dim}"


@dataclass(frozen=True)
class WriteCase:
    name: str
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int

    @property
    def shape(self) -> str:
        return f"{self.num_tokens} tokens, {self.num_kv_heads} kv heads, d {self.head_dim}"


def full_cases() -> tuple[list[AttentionCase], list[WriteCase]]:
    d, bs = 128, 16
    attn = [
        AttentionCase("decode-b32-ctx2048-h32kv8", "decode", (1,) * 32, (2048,) * 32, 32, 8, d, bs),
        AttentionCase("decode-b32-ctx2048-h16kv8", "decode", (1,) * 32, (2048,) * 32, 16, 8, d, bs),
        AttentionCase("prefill-1x4096-h32kv8", "prefill", (4096,), (4096,), 32, 8, d, bs),
        AttentionCase("prefill-4x1024-h32kv8", "prefill", (1024,) * 4, (1024,) * 4, 32, 8, d, bs),
    ]
    # a cache of 8192 blocks (131072 slots, 512 MiB in bf16) for the writes to scatter into
    writes = [WriteCase("kv-write-32", 32, 8, d, bs, 8192), WriteCase("kv-write-4096", 4096, 8, d, bs, 8192)]
    return attn, writes


def tiny_cases() -> tuple[list[AttentionCase], list[WriteCase]]:
    """Small shapes with the full cases' structure (GQA, a partial last block,
    several requests): for the interpreter on CPU, or a quick GPU check."""
    d, bs = 32, 16
    attn = [
        AttentionCase("decode-b3-ctx37-h4kv2", "decode", (1,) * 3, (37,) * 3, 4, 2, d, bs),
        AttentionCase("prefill-1x40-h4kv2", "prefill", (40,), (40,), 4, 2, d, bs),
        AttentionCase("prefill-4x10-h4kv2", "prefill", (10,) * 4, (10,) * 4, 4, 2, d, bs),
    ]
    writes = [WriteCase("kv-write-3", 3, 2, d, bs, 16), WriteCase("kv-write-40", 40, 2, d, bs, 16)]
    return attn, writes


# --------------------------------------------------------------------------- inputs


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, H, D]
    out: torch.Tensor  # [T, H, D]
    kv_cache: torch.Tensor  # [2, blocks, block_size, KV, D]
    query_start_loc: torch.Tensor  # int32 [R + 1]
    seq_lens: torch.Tensor  # int32 [R]
    block_table: torch.Tensor  # int32 [R, max_blocks]
    keys: list[torch.Tensor] = field(default_factory=list)  # per request [seq_len, KV, D], unpaged
    values: list[torch.Tensor] = field(default_factory=list)


def _slots(block_row: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(length, device=block_row.device)
    return block_row[pos // block_size].long() * block_size + pos % block_size


def build_batch(case: AttentionCase, dtype: torch.dtype, device: torch.device, seed: int) -> PagedBatch:
    """The case's queries, and its requests' K/V scattered into a NaN-filled paged
    cache under a random block table."""
    gen = torch.Generator(device=device).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    bs, kv, d = case.block_size, case.num_kv_heads, case.head_dim
    nblocks = [math.ceil(s / bs) for s in case.seq_lens]
    num_blocks = sum(nblocks) + 8  # a few never-referenced blocks
    perm = torch.randperm(num_blocks, generator=cpu_gen).to(torch.int32)
    block_table = torch.zeros(len(nblocks), max(nblocks), dtype=torch.int32)
    used = 0
    for i, n in enumerate(nblocks):
        block_table[i, :n] = perm[used : used + n]
        used += n
    block_table = block_table.to(device)

    kv_cache = torch.full((2, num_blocks, bs, kv, d), float("nan"), dtype=dtype, device=device)
    flat = kv_cache.view(2, -1, kv, d)
    keys, values = [], []
    for i, s in enumerate(case.seq_lens):
        k = torch.randn(s, kv, d, generator=gen, device=device).to(dtype)
        v = torch.randn(s, kv, d, generator=gen, device=device).to(dtype)
        slots = _slots(block_table[i], s, bs)
        flat[0, slots] = k
        flat[1, slots] = v
        keys.append(k)
        values.append(v)

    qsl = [0]
    for n in case.q_lens:
        qsl.append(qsl[-1] + n)
    num_tokens = qsl[-1]
    query = torch.randn(num_tokens, case.num_heads, d, generator=gen, device=device).to(dtype)
    out = torch.full_like(query, float("nan"))
    return PagedBatch(
        query=query,
        out=out,
        kv_cache=kv_cache,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(case.seq_lens, dtype=torch.int32, device=device),
        block_table=block_table,
        keys=keys,
        values=values,
    )


# ------------------------------------------------------------------------ references


def _dense_per_request(case: AttentionCase, b: PagedBatch, dtype: torch.dtype | None) -> list[tuple[Any, ...]]:
    """Per request: (q [1, H, q_len, D], k, v [1, KV, s, D], causal), in ``dtype``
    (None: as stored). Queries are the last ``q_len`` positions of the context:
    a prefill without cached prefix (q_len == s, causal) or a decode (q_len 1)."""
    items = []
    for i, (q_len, s) in enumerate(zip(case.q_lens, case.seq_lens)):
        if q_len != 1 and q_len != s:
            raise ValueError(f"{case.name}: the reference handles decodes and whole prefills only")
        start = int(sum(case.q_lens[:i]))
        q = b.query[start : start + q_len].transpose(0, 1).unsqueeze(0)
        k = b.keys[i].transpose(0, 1).unsqueeze(0)
        v = b.values[i].transpose(0, 1).unsqueeze(0)
        if dtype is not None:
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        items.append((q.contiguous(), k.contiguous(), v.contiguous(), q_len > 1))
    return items


def reference_attention(case: AttentionCase, b: PagedBatch, scale: float) -> torch.Tensor:
    """Dense fp32 attention per request, [T, H, D]; K/V heads repeated for GQA."""
    group = case.num_heads // case.num_kv_heads
    outs = []
    for q, k, v, causal in _dense_per_request(case, b, torch.float32):
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


def sdpa_baselines(case: AttentionCase, b: PagedBatch, scale: float) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    """Callables running ``scaled_dot_product_attention`` on dense bf16 tensors of
    the case's shapes (requests batched: all have one length), with labels. With
    GQA there are two: ``enable_gqa=True`` (when this torch accepts it) and the K/V
    heads repeated beforehand (outside the timed call), since which one gets the
    faster kernel depends on the torch build; the caller keeps the faster."""
    if len(set(case.q_lens)) != 1 or len(set(case.seq_lens)) != 1:
        raise ValueError(f"{case.name}: the SDPA baseline needs equal lengths")
    items = _dense_per_request(case, b, None)
    q = torch.cat([it[0] for it in items]).contiguous()  # [R, H, q_len, D]
    k = torch.cat([it[1] for it in items]).contiguous()  # [R, KV, s, D]
    v = torch.cat([it[2] for it in items]).contiguous()
    causal = items[0][3]
    group = case.num_heads // case.num_kv_heads
    if group == 1:
        return [("MHA", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale))]
    variants: list[tuple[str, Callable[[], torch.Tensor]]] = []
    try:
        F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
        variants.append(("enable_gqa=True", lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, enable_gqa=True)))
    except (TypeError, RuntimeError) as e:
        print(f"  sdpa enable_gqa=True unavailable: {e}", file=sys.stderr)
    k_rep = k.repeat_interleave(group, dim=1).contiguous()
    v_rep = v.repeat_interleave(group, dim=1).contiguous()
    variants.append(("K/V heads repeated", lambda: F.scaled_dot_product_attention(
        q, k_rep, v_rep, is_causal=causal, scale=scale)))
    return variants


def check_close(actual: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    """Max absolute error of ``actual`` against ``ref`` (NaN counts as a failure),
    and whether every element is within the bf16 tolerance."""
    a = actual.float().cpu()
    r = ref.float().cpu()
    diff = (a - r).abs()
    finite = bool(torch.isfinite(a).all())
    within = bool((diff <= TOLERANCE["atol"] + TOLERANCE["rtol"] * r.abs()).all()) and finite
    max_abs = float(diff.nan_to_num(nan=float("inf")).max()) if diff.numel() else 0.0
    return {"max_abs_error": max_abs, "all_finite": finite, "within_tolerance": within,
            "ref_max_abs": float(r.abs().max()) if r.numel() else 0.0}


# --------------------------------------------------------------------------- timing


def time_cuda(fn: Callable[[], Any], warmup_ms: float, rep_ms: float) -> dict[str, Any]:
    """Median (and 20th/80th percentile) milliseconds of ``fn`` by CUDA events,
    with L2 flushed before each call."""
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush.zero_()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 5, 1e-3)
    n_warm = max(1, int(warmup_ms / estimate))
    n_rep = min(5000, max(20, int(rep_ms / estimate)))
    for _ in range(n_warm):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    for s, e in zip(starts, ends):
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    del flush
    return {**timing_summary(times, "cuda events, L2 flushed before each call"), "calls": len(times)}


def time_host(fn: Callable[[], Any], warmup: int = 1, reps: int = 3) -> dict[str, Any]:
    """Wall-clock milliseconds of ``fn`` (CPU smoke test: the numbers mean nothing)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return {**timing_summary(sorted(times), "host wall clock (interpreter: not a measurement)"),
            "calls": len(times)}


# ------------------------------------------------------------------------- measuring


@dataclass
class Settings:
    device: torch.device
    dtype: torch.dtype
    warmup_ms: float
    rep_ms: float
    peak_gbps: float
    peak_tflops: float

    def time(self, fn: Callable[[], Any]) -> dict[str, Any]:
        if self.device.type == "cuda":
            return time_cuda(fn, self.warmup_ms, self.rep_ms)
        return time_host(fn)


def _rates(timing: dict[str, Any], *, nbytes: int | None = None, flops: int | None = None,
           s: Settings) -> dict[str, Any]:
    sec = timing["median_ms"] / 1e3
    out: dict[str, Any] = {}
    if nbytes is not None:
        out["bytes"] = nbytes
        out["gb_per_s"] = nbytes / sec / 1e9
        out["fraction_of_peak_bandwidth"] = out["gb_per_s"] / s.peak_gbps
    if flops is not None:
        out["flops"] = flops
        out["tflop_per_s"] = flops / sec / 1e12
        out["fraction_of_peak_tflops"] = out["tflop_per_s"] / s.peak_tflops
    return out


def attention_bytes(case: AttentionCase, itemsize: int) -> int:
    """The fewest bytes one launch must move: each request's cached K and V once,
    q read, out written, and the index tensors."""
    kv = sum(case.seq_lens) * case.num_kv_heads * case.head_dim * itemsize * 2
    t = sum(case.q_lens)
    qo = 2 * t * case.num_heads * case.head_dim * itemsize
    blocks_per_req = max(math.ceil(s / case.block_size) for s in case.seq_lens)
    index = 4 * (len(case.q_lens) * blocks_per_req + 2 * len(case.q_lens) + 1)
    return kv + qo + index


def attention_flops(case: AttentionCase) -> int:
    """QK^T and PV of a whole causal prefill: 2 * 2 * T * T / 2 * heads * head_dim
    per request (decode: 2 * 2 * s * heads * head_dim)."""
    total = 0
    for q_len, s in zip(case.q_lens, case.seq_lens):
        pairs = q_len * q_len // 2 if q_len == s else q_len * s
        total += 2 * 2 * pairs * case.num_heads * case.head_dim
    return total


def measure_attention(case: AttentionCase, s: Settings, ta: Any) -> dict[str, Any]:
    b = build_batch(case, s.dtype, s.device, SEED)
    scale = case.head_dim ** -0.5
    num_reqs = len(case.q_lens)

    def kiln() -> None:
        ta.paged_attention_triton(b.query, b.kv_cache, b.out, b.query_start_loc, b.seq_lens, b.block_table,
                                  num_reqs, scale, 0)

    kiln()
    if s.device.type == "cuda":
        torch.cuda.synchronize()
    ref = reference_attention(case, b, scale)
    check = check_close(b.out, ref)
    itemsize = torch.empty((), dtype=s.dtype).element_size()
    nbytes = attention_bytes(case, itemsize)
    flops = attention_flops(case)
    t_kiln = s.time(kiln)
    sdpa_runs = []
    for how, fn in sdpa_baselines(case, b, scale):
        o = fn()
        sdpa_check = check_close(o.squeeze(2) if case.kind == "decode" else _sdpa_to_tokens(o), ref)
        del o
        t = s.time(fn)
        sdpa_runs.append({"kernel": f"F.scaled_dot_product_attention, dense, {how}", **t,
                          **_rates(t, nbytes=nbytes, flops=flops, s=s), **sdpa_check})
    del ref
    best_sdpa = min(sdpa_runs, key=lambda r: r["median_ms"])
    result: dict[str, Any] = {
        "case": case.name,
        "kind": case.kind,
        "shape": case.shape,
        "config": asdict(case),
        "kiln_triton": {"kernel": "paged_attention_triton", "tile_sizes": list(
            ta.attention_tile_sizes(case.head_dim, case.num_heads // case.num_kv_heads)),
            **t_kiln, **_rates(t_kiln, nbytes=nbytes, flops=flops, s=s), **check},
        "torch_sdpa": best_sdpa,  # the faster variant
        "torch_sdpa_variants": sdpa_runs,
        "kiln_over_sdpa_time": t_kiln["median_ms"] / best_sdpa["median_ms"],
        "verified": check["within_tolerance"],
    }
    return result


def _sdpa_to_tokens(o: torch.Tensor) -> torch.Tensor:
    """[R, H, L, D] -> [R * L, H, D] (requests one after another, as kiln's rows)."""
    return o.transpose(1, 2).reshape(-1, o.shape[1], o.shape[3])


def measure_write(case: WriteCase, s: Settings, ta: Any) -> dict[str, Any]:
    gen = torch.Generator(device=s.device).manual_seed(SEED)
    cpu_gen = torch.Generator().manual_seed(SEED)
    kv, d, bs = case.num_kv_heads, case.head_dim, case.block_size
    total_slots = case.num_blocks * bs
    if case.num_tokens > total_slots:
        raise ValueError(f"{case.name}: {case.num_tokens} tokens do not fit {total_slots} slots")
    slots = torch.randperm(total_slots, generator=cpu_gen)[: case.num_tokens].to(s.device)
    key = torch.randn(case.num_tokens, kv, d, generator=gen, device=s.device).to(s.dtype)
    value = torch.randn(case.num_tokens, kv, d, generator=gen, device=s.device).to(s.dtype)
    cache = torch.full((2, case.num_blocks, bs, kv, d), float("nan"), dtype=s.dtype, device=s.device)

    def kiln() -> None:
        ta.write_kv_cache_triton(key, value, cache, slots)

    kiln()
    flat = cache.view(2, -1, kv, d)
    exact = bool(torch.equal(flat[0, slots], key)) and bool(torch.equal(flat[1, slots], value))
    written = int(torch.isfinite(cache).sum())  # randn never gives NaN: only written slots are finite
    only_slots = written == 2 * case.num_tokens * kv * d
    itemsize = torch.empty((), dtype=s.dtype).element_size()
    nbytes = 2 * 2 * case.num_tokens * kv * d * itemsize + 8 * case.num_tokens
    t = s.time(kiln)
    return {
        "case": case.name,
        "kind": "kv-write",
        "shape": case.shape,
        "config": asdict(case),
        "kiln_triton": {"kernel": "write_kv_cache_triton", **t, **_rates(t, nbytes=nbytes, s=s),
                        "exact": exact, "wrote_only_its_slots": only_slots},
        "verified": exact and only_slots,
    }


# ----------------------------------------------------------------------- reporting


def render(report: dict[str, Any]) -> str:
    st = report["settings"]
    head = (f"attention kernels: {report['machine'].get('gpu') or report['machine']['device']}, "
            f"{st['dtype']}, peaks {st['peak_gbps']:.0f} GB/s and {st['peak_tflops']:.0f} TFLOP/s "
            f"({st['peaks_note']}); {st['timing']}")
    rows = []
    for r in report["results"]:
        engines = [("kiln triton", r["kiln_triton"])]
        if "torch_sdpa" in r:
            engines.append(("torch sdpa (dense)" + (", " + r["torch_sdpa"]["kernel"].rsplit(", ", 1)[-1]
                                                    if len(r.get("torch_sdpa_variants", [])) > 1 else ""),
                            r["torch_sdpa"]))
        for label, e in engines:
            err = e.get("max_abs_error")
            ok = r["verified"] if label == "kiln triton" else e.get("within_tolerance")
            if err is None:  # the KV write: an exact copy, and nothing outside its slots
                err_text = ("exact" if e.get("exact") else "NOT exact") + (
                    "" if e.get("wrote_only_its_slots") else ", stray writes")
            else:
                err_text = f"{err:.2e}"
            rows.append([
                r["case"], label,
                fmt(e["median_ms"] * 1e3, 1),
                fmt(e.get("gb_per_s"), 0) if r["kind"] != "prefill" else "-",
                fmt(100 * e["fraction_of_peak_bandwidth"], 1) + "%" if r["kind"] != "prefill" else "-",
                fmt(e.get("tflop_per_s"), 1) if r["kind"] == "prefill" else "-",
                fmt(100 * e["fraction_of_peak_tflops"], 1) + "%" if r["kind"] == "prefill" else "-",
                err_text,
                ("ok" if ok else "FAIL") if label == "kiln triton" else "(info)",
            ])
    table = format_table(["case", "kernel", "median us", "GB/s", "of peak BW", "TFLOP/s", "of peak",
                          "max abs err", "check"], rows)
    ratios = [f"{r['case']}: kiln / sdpa time {r['kiln_over_sdpa_time']:.2f}x"
              for r in report["results"] if "kiln_over_sdpa_time" in r]
    shapes = [f"{r['case']}: {r['shape']}" for r in report["results"]]
    legend = ("GB/s: fewest bytes a launch must move (cached K/V once, q, out, indices; KV write: K/V read "
              "and written, slots) over the median time; sdpa rows count the same bytes and FLOPs "
              "(effective rates) on dense, unpaged tensors; max abs err against a dense fp32 reference, "
              f"tolerance atol {TOLERANCE['atol']} rtol {TOLERANCE['rtol']}")
    return "\n".join([head, "", table, "", *shapes, "", *ratios, "", legend])


def gpu_info(device: torch.device) -> dict[str, Any]:
    import triton

    info: dict[str, Any] = {"triton_version": triton.__version__}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update({
            "gpu": p.name,
            "compute_capability": f"{p.major}.{p.minor}",
            "multiprocessors": p.multi_processor_count,
            "gpu_memory_bytes": p.total_memory,
            "l2_cache_bytes": getattr(p, "L2_cache_size", None),
            "cuda_version": torch.version.cuda,
        })
    return info


# ---------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.attention_kernels",
                                description="kiln's Triton attention and KV-write kernels on a GPU.")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cuda (default); cpu only with --tiny, under Triton's interpreter (a smoke test)")
    p.add_argument("--tiny", action="store_true", help="small shapes (quick check; required on cpu)")
    p.add_argument("--warmup-ms", type=float, default=25.0, help="warm-up per timing (default 25 ms)")
    p.add_argument("--rep-ms", type=float, default=100.0, help="timed calls fill this long (default 100 ms)")
    p.add_argument("--peak-gbps", type=float, default=H200_COPY_GBPS,
                   help=f"memory bandwidth to compare against (default {H200_COPY_GBPS:.0f}, H200)")
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_TFLOPS,
                   help=f"bf16 matmul rate to compare against (default {H200_BF16_TFLOPS:.0f}, H200)")
    p.add_argument("--only", default=None,
                   help="comma-separated substrings: run the cases whose name contains one")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory (default bench/results)")
    p.add_argument("--no-json", action="store_true", help="print only")
    return p.parse_args(argv)


def _import_kernels(device: torch.device) -> Any:
    """``kiln.attention.triton_kernels``, compiled on CUDA or interpreted on CPU
    (the interpreter is chosen when the module is imported)."""
    loaded = "kiln.attention.triton_kernels" in sys.modules
    if device.type == "cpu" and not loaded:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        from kiln.attention import triton_kernels as ta
    except ImportError as e:
        raise SystemExit(f"error: Triton is not importable ({e}); kiln's Triton kernels need it") from None
    if device.type == "cpu" and not ta._INTERPRETING:
        raise SystemExit("error: the kernels were imported before TRITON_INTERPRET=1; run in a fresh process")
    if device.type == "cuda" and ta._INTERPRETING:
        raise SystemExit("error: TRITON_INTERPRET=1 is set: the kernels would be interpreted, not compiled; "
                         "unset it to benchmark on the GPU")
    return ta


def _usable_device(args: argparse.Namespace) -> str | None:
    """Why the requested device cannot run this benchmark, or None."""
    if args.device == "cuda" and not torch.cuda.is_available():
        return ("error: bench.attention_kernels measures GPU kernels and CUDA is not available here "
                f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}). "
                "For a smoke test of the script on CPU: --device cpu --tiny")
    if args.device == "cpu" and not args.tiny:
        return "error: on cpu the kernels run in Triton's interpreter: only --tiny is practical"
    return None


def _select_cases(args: argparse.Namespace) -> list[AttentionCase | WriteCase]:
    attn_cases, write_cases = tiny_cases() if args.tiny else full_cases()
    cases: list[AttentionCase | WriteCase] = [*attn_cases, *write_cases]
    if args.only:
        keys = [k for k in args.only.split(",") if k]
        cases = [c for c in cases if any(k in c.name for k in keys)]
    return cases


def run_case(case: AttentionCase | WriteCase, s: Settings, ta: Any) -> dict[str, Any]:
    """The case's result; one holding ``error`` (and not verified) if it raised,
    so that the other cases still run."""
    print(f"{case.name}: {case.shape} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        r = measure_attention(case, s, ta) if isinstance(case, AttentionCase) else measure_write(case, s, ta)
    except Exception as e:  # noqa: BLE001 - record it and go on with the other cases
        import traceback

        traceback.print_exc()
        r = {"case": case.name, "kind": getattr(case, "kind", "kv-write"), "shape": case.shape,
             "error": f"{type(e).__name__}: {e}", "verified": False}
    r["seconds"] = round(time.perf_counter() - t0, 2)
    if s.device.type == "cuda":
        torch.cuda.empty_cache()
    return r


def _settings_record(args: argparse.Namespace, interpreted: bool, gpu_name: str) -> dict[str, Any]:
    return {
        "device": args.device,
        "dtype": "bfloat16",
        "tiny": args.tiny,
        "interpreted": interpreted,
        "warmup_ms": args.warmup_ms,
        "rep_ms": args.rep_ms,
        "timing": ("median of CUDA-event-timed calls, 256 MiB L2 flush before each"
                   if args.device == "cuda" else "host wall clock under the interpreter: not a measurement"),
        "peak_gbps": args.peak_gbps,
        "peak_tflops": args.peak_tflops,
        "peaks_note": ("H200 figures measured on this workplace" if "H200" in gpu_name
                       else "H200 figures; this device is not an H200"),
        "tolerance": TOLERANCE,
        "seed": SEED,
        "notes": [
            "block tables are a random permutation of the cache's blocks; unused slots are NaN",
            "prefill FLOPs: 2*2*T*T/2*heads*head_dim per request (QK^T and PV, causal half)",
            "decode bytes: sum(seq_lens)*kv_heads*head_dim*2 (K,V)*itemsize + q + out + indices",
            "SDPA runs on dense, unpaged [R, H, L, D] tensors with torch's default backend choice",
        ],
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    problem = _usable_device(args)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    device = torch.device(args.device)
    try:
        ta = _import_kernels(device)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2

    record = RunRecord("attention-kernels", args.device)
    s = Settings(device, torch.bfloat16, args.warmup_ms, args.rep_ms, args.peak_gbps, args.peak_tflops)
    torch.manual_seed(SEED)
    results = [run_case(case, s, ta) for case in _select_cases(args)]
    head = record.head(**gpu_info(device))
    report = {
        **head,
        "settings": _settings_record(args, bool(ta._INTERPRETING), head["machine"].get("gpu") or ""),
        "results": results,
        "verified": all(r.get("verified") for r in results),
    }
    publish(report, "attention-kernels", render_safe(report), None if args.no_json else args.out)
    if not report["verified"]:
        failed = [r["case"] for r in results if not r.get("verified")]
        print(f"\nFAILED checks: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def render_safe(report: dict[str, Any]) -> str:
    """The table of the cases that ran, then one line per case that failed to run."""
    ok = {**report, "results": [r for r in report["results"] if "error" not in r]}
    text = render(ok) if ok["results"] else "no case ran"
    errors = [f"{r['case']}: ERROR {r['error']}" for r in report["results"] if "error" in r]
    return "\n".join([text, *([""] + errors if errors else [])])


if __name__ == "__main__":
    sys.exit(main())
