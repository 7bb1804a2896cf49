"""A C kernel for single-query (decode) attention on CPU, read straight from the
paged KV cache (``paged_decode.c``).

The torch backend's own decode path gathers every decode request's blocks
(``index_select`` of K and of V, a padded copy each layer) and runs SDPA over
the copy. The kernel reads keys and values where they lie, with an online
softmax, so nothing is copied. One layer of the 135M shape's heads (9 query, 3
KV, head dim 64; 2 threads), ``python -m bench.cpu_kernels --only
decode-attention``: on an AMD EPYC (AVX2) 64 requests of 192 tokens 2.5 ms
against 7.3 ms, of 512 tokens 7.6 against 17.1 ms, one request of 128 tokens
0.033 against 0.163 ms (bench/results/decode-attention-cpu-20261201-211354.json);
on an Intel Xeon (AVX-512), 8 layers' caches taken in turn so that each call
reads from DRAM as an engine's step does, 1.01 against 1.77 ms, 2.97 against
4.68 ms and 0.013 against 0.046 ms (decode-attention-cpu-20261202-154349.json). Whole decode steps of
kiln -O2, in one scratch A/B with the kernel's first version (3.5 ms at 64 x
192): about 480 against 350 ms at 64 requests, 44.6 against 39.1 ms at one.

It is a compiled artifact like Inductor's kernels (``kiln.native``): built
when a CPU entry is compiled, kept in the Inductor cache, loaded at a warm
start with ``ctypes``. fp32 and bf16 (widened to fp32 as they are loaded,
scores and sums in fp32): other dtypes, and shapes past the kernel's limits,
keep the torch path.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.native import KernelBuildError, NativeSource

__all__ = ["KernelBuildError", "PagedDecodeKernel", "build_paged_decode", "library_name"]

SOURCE = NativeSource(Path(__file__).with_name("paged_decode.c"), "paged-decode")
MAX_QUERY_HEADS_PER_ITEM = 32  # KILN_MAX_HEADS in paged_decode.c
MAX_HEAD_DIM = 256  # KILN_MAX_DIM
MAX_BLOCK_SIZE = 128  # KILN_MAX_BLOCK


def library_name() -> str:
    """The library's path relative to the Inductor cache (``NativeSource``)."""
    return SOURCE.library_name()


def build_paged_decode(inductor_dir: Path) -> str:
    """Build the kernel into ``inductor_dir`` unless it is there; returns its
    name relative to it."""
    return SOURCE.build(inductor_dir)


@dataclass(frozen=True)
class DecodeRows:
    """What the kernel needs of a step's single-query requests, built once per
    step on the host (every layer shares it)."""

    rows: torch.Tensor  # [B] int64: each request's query row
    block_table: torch.Tensor  # [B, stride] int32, rows contiguous
    seq_lens: torch.Tensor  # [B] int32


class PagedDecodeKernel:
    """The built library, loaded; call it with a step's ``DecodeRows``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        p, i = ctypes.c_void_p, ctypes.c_int64
        self._fns = {}
        for dtype, name in _DTYPES.items():
            fn = getattr(lib, f"kiln_paged_decode_{name}")
            fn.argtypes = [p, i, p, p, p, i, p, p, p, i, i, i, i, i, i, ctypes.c_float, i, i, i]
            fn.restype = ctypes.c_int
            self._fns[dtype] = fn
        write = lib.kiln_write_kv
        write.argtypes = [p, i, p, i, p, i, p, p, i, i, i]
        write.restype = ctypes.c_int
        self._write = write

    def supports(self, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor) -> bool:
        """Whether this call can run here: CPU tensors of one dtype the kernel
        has (fp32, bf16) within the limits, each row's heads side by side
        (rows may be strided). Asked on every layer, so written as plain
        comparisons (a generator over the tensors cost 20 us a call)."""
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads, block_size = kv_cache.shape[-2], kv_cache.shape[2]
        dtype = query.dtype
        return (dtype in _DTYPES and out.dtype == dtype and kv_cache.dtype == dtype and query.is_cpu and out.is_cpu
                and query.stride(2) == 1 and out.stride(2) == 1 and query.stride(1) == head_dim
                and out.stride(1) == head_dim and kv_cache.is_contiguous()
                and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_QUERY_HEADS_PER_ITEM
                and head_dim <= MAX_HEAD_DIM and block_size <= MAX_BLOCK_SIZE)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> bool:
        """Write ``key``/``value`` rows ([T, KV, D]) into ``kv_cache`` at
        ``slots`` ([T] int64, every one a real slot) when the tensors suit the
        kernel (one dtype of fp32 and bf16, CPU, heads side by side, the cache
        contiguous); False otherwise, for the caller's torch path."""
        kv, d = key.shape[1], key.shape[2]
        dtype = kv_cache.dtype
        if not (dtype in _DTYPES and key.dtype == dtype and value.dtype == dtype and key.is_cpu
                and key.stride(2) == 1 and value.stride(2) == 1 and key.stride(1) == d and value.stride(1) == d
                and kv_cache.is_contiguous() and slots.dtype == torch.int64 and slots.is_contiguous()):
            return False
        num_slots = kv_cache.shape[1] * kv_cache.shape[2]
        half = num_slots * kv * d * kv_cache.element_size()
        rc = self._write(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), slots.data_ptr(),
                         key.shape[0], kv_cache.data_ptr(), kv_cache.data_ptr() + half, kv * d, num_slots,
                         kv_cache.element_size())
        if rc != 0:
            raise IndexError(f"a KV-cache slot of {slots.tolist()} is outside the cache's {num_slots} slots")
        return True

    def __call__(self, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, batch: DecodeRows,
                 scale: float, sliding_window: int) -> None:
        """Attend each request's query row of ``query`` ([T, H, D]) to its
        context in ``kv_cache`` ([2, blocks, block_size, KV, D]), writing the
        same rows of ``out``. The caller has checked ``supports``; ``batch``
        holds int64 rows and int32 block ids and lengths."""
        num_b = batch.rows.shape[0]
        num_heads, head_dim = query.shape[1], query.shape[2]
        key, value = kv_cache[0], kv_cache[1]
        num_kv_heads, block_size = key.shape[2], key.shape[1]
        rc = self._fns[query.dtype](query.data_ptr(), query.stride(0), key.data_ptr(), value.data_ptr(),
                      batch.block_table.data_ptr(), batch.block_table.stride(0), batch.seq_lens.data_ptr(),
                      batch.rows.data_ptr(), out.data_ptr(), out.stride(0), num_b, num_heads, num_kv_heads,
                      head_dim, block_size, float(scale), int(sliding_window),
                      _heads_per_item(num_b, num_heads, num_kv_heads, torch.get_num_threads()),
                      torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"{self.path.name} refused heads={num_heads} kv_heads={num_kv_heads} "
                               f"head_dim={head_dim} block_size={block_size}")


_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}  # the kernel's entry points, by dtype


@functools.lru_cache(maxsize=256)
def _heads_per_item(num_requests: int, num_heads: int, num_kv_heads: int, threads: int) -> int:
    """KV heads one work item takes: all of them (one sweep over each key row)
    once the requests outnumber the threads twice over, else one (the heads
    then share the threads); never more query heads than the kernel holds."""
    group = num_heads // num_kv_heads
    if num_requests < 2 * threads:
        return 1
    best = 1
    for n in range(1, num_kv_heads + 1):
        if num_kv_heads % n == 0 and n * group <= MAX_QUERY_HEADS_PER_ITEM:
            best = n
    return best
