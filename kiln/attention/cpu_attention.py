"""C kernels for attention on CPU (``cpu_attention.c``): single-query (decode)
attention read straight from the paged KV cache, and the causal attention of
prefill chunks over the same cache.

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

A layer is one call (``CpuAttentionKernel.layer``): the step's new keys and
values are written into the cache and its query rows attended to, with what
every layer shares (rows, block tables, lengths, slots) handed over once a
step in a ``DecodeStep``. A row is a single-query request's token, or one
token of a short prefill chunk, whose context then ends at that token: the
kernel knows no requests, only rows and the contexts they see. Two calls a
layer before, each with its checks, and four views of the cache made in
Python: the backend's forward at one request of 100 tokens took 23-44 us a
layer, now 12-17 us (2 threads, scratch timing), about 0.5 ms of a 30-layer
decode step.

A prefill step's chunks are one call a layer (``CpuAttentionKernel.prefill``)
where the backend made an SDPA call a chunk, each with its slicing and copy
in Python (and a gather of its blocks where it had a cached prefix). One
layer through the backend, ``python -m bench.cpu_kernels --only
prefill-attention`` (2 threads of an Intel Xeon,
bench/results/prefill-attention-cpu-20261207-160843.json): the first prefill
step of ``bench.decode --throughput 64`` (30 prompts of 16-128 tokens) 3.22
against 1.82 ms in fp32 and 2.23 against 1.48 in bf16; 8 prompts of 512
tokens 19.4 against 12.0 ms in fp32, but 7.8 against 11.8 in bf16, where
SDPA multiplies bf16 tiles (the backend's ``native_prefill_bf16_pairs``).

It is a compiled artifact like Inductor's kernels (``kiln.native``): built
when a CPU entry is compiled, kept in the Inductor cache, loaded at a warm
start with ``ctypes``. fp32 and bf16 (widened to fp32 as they are loaded,
scores and sums in fp32): other dtypes, and shapes past the kernel's limits,
keep the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import struct
from pathlib import Path
from typing import Any

import torch

from kiln.native import KernelBuildError, NativeSource

__all__ = ["CpuAttentionKernel", "DecodeStep", "KernelBuildError", "StepArgs", "build_cpu_attention", "library_name"]

SOURCE = NativeSource(Path(__file__).with_name("cpu_attention.c"), "cpu-attention")


def library_name() -> str:
    """The library's path relative to the Inductor cache (``NativeSource``)."""
    return SOURCE.library_name()


def build_cpu_attention(inductor_dir: Path) -> str:
    """Build the kernel into ``inductor_dir`` unless it is there; returns its
    name relative to it."""
    return SOURCE.build(inductor_dir)


class StepArgs(ctypes.Structure):
    """``kiln_step`` in cpu_attention.c: what every layer of a step shares,
    read by the kernel on each call."""

    _fields_ = [("rows", ctypes.c_void_p), ("block_table", ctypes.c_void_p), ("bt_stride", ctypes.c_int64),
                ("seq_lens", ctypes.c_void_p), ("B", ctypes.c_int64), ("slots", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("threads", ctypes.c_int64)]


class DecodeStep:
    """What every layer of a step hands the kernel, built once per step on the
    host: the query rows it attends (``rows`` [B] int64), each one's block
    table (``block_table`` [B, stride] int32, rows contiguous) and context
    length (``seq_lens`` [B] int32, the row's own token the last of it), and
    the cache slots of the step's ``n`` new tokens (``slots``, int64, every one
    a real slot). The tensors are kept here as long as the kernel may read
    them.

    ``args``: the structure to write them into, in place of a new one. An
    attention backend hands the same one to every step, so that its address
    is fixed and a CPU call graph (``kiln.graphs.cpu``), which replays the
    kernel's calls with their captured arguments, reads each step's values."""

    def __init__(self, rows: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor,
                 n: int, args: StepArgs | None = None) -> None:
        if not (rows.dtype == torch.int64 and block_table.dtype == seq_lens.dtype == torch.int32
                and slots.dtype == torch.int64 and block_table.stride(-1) == 1 and rows.is_contiguous()
                and seq_lens.is_contiguous() and slots.is_contiguous() and slots.shape[0] >= n):
            raise ValueError("DecodeStep takes int64 rows and slots, int32 block tables and lengths, contiguous")
        self.rows, self.block_table, self.seq_lens, self.slots = rows, block_table, seq_lens, slots
        self.num_rows, self.num_tokens = rows.shape[0], n
        fields = (rows.data_ptr(), block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr(), rows.shape[0],
                  slots.data_ptr(), n, torch.get_num_threads())
        if args is None:
            args = StepArgs(*fields)
        else:
            (args.rows, args.block_table, args.bt_stride, args.seq_lens, args.B, args.slots, args.n,
             args.threads) = fields
        self.structure = args
        self.args = ctypes.addressof(args)  # an integer, as a call graph's replay from C passes it


class CpuAttentionKernel:
    """The built library, loaded; ``layer`` runs one layer of a decode step,
    ``prefill`` the attention of a step's prefill chunks."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        p, i = ctypes.c_void_p, ctypes.c_int64
        fn = lib.kiln_decode_layer
        # every argument an integer (the scale as its float's bits), so that a CPU
        # call graph can make the call from C (kiln.graphs.cpu)
        fn.argtypes = [p, p, i, p, i, p, i, p, i, p, i, i, i, i, i, ctypes.c_int32, i, i]
        fn.restype = ctypes.c_int
        self._layer = fn
        #: whether ``prefill`` can run here (an AVX-512 build of a library that has
        #: it: one an older kiln built has not); without it prefill chunks stay on
        #: the backend's other paths
        self.prefills = hasattr(lib, "kiln_prefill_layer")
        self._prefill: Any = None
        if self.prefills:
            fn = lib.kiln_prefill_layer
            fn.argtypes = [p, i, p, i, p, i, i, p, i, p, i, i, i, i, i, i, ctypes.c_int32, i, i]
            fn.restype = ctypes.c_int
            self._prefill = fn
            lib.kiln_prefill_available.restype = ctypes.c_int
            self.prefills = bool(lib.kiln_prefill_available())

    def native_sites(self) -> list[tuple[object, str]]:
        """Where ``layer`` finds its native function (``kiln.graphs.cpu``)."""
        return [(self, "_layer")]

    def layer(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
              kv_cache: torch.Tensor, step: DecodeStep, scale: float, sliding_window: int) -> bool:
        """Write the step's new ``key``/``value`` rows ([T, KV, D]) into
        ``kv_cache`` ([2, blocks, block_size, KV, D]) at the step's slots, then
        attend each of the step's rows of ``query`` ([T, H, D]) to its
        context, writing the same rows of ``out``. False, with nothing written,
        where the kernel does not take these tensors (a dtype other than fp32
        and bf16, heads not side by side in a row, more than 32 query heads to a
        KV head, head dims over 256, blocks over 128 tokens: cpu_attention.c's
        limits): the caller's torch path then takes the layer.

        Written for its per-call cost, which a decode step pays on every layer:
        the checks are plain comparisons (a generator over the tensors cost 20 us
        a call) and the layer is one ctypes call."""
        dtype = kv_cache.dtype
        bf16 = _DTYPES.get(dtype)
        if bf16 is None or not kv_cache.is_cpu or not kv_cache.is_contiguous():
            return False
        _, blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        qs, ks, vs, os = query.stride(), key.stride(), value.stride(), out.stride()
        if not (query.dtype == key.dtype == value.dtype == out.dtype == dtype and query.is_cpu and out.is_cpu
                and query.shape[2] == head_dim and key.shape[1] == num_kv_heads and key.shape[2] == head_dim
                and qs[2] == ks[2] == vs[2] == os[2] == 1 and qs[1] == ks[1] == vs[1] == os[1] == head_dim):
            return False
        num_slots = blocks * block_size
        rc = self._layer(step.args, query.data_ptr(), qs[0], key.data_ptr(), ks[0], value.data_ptr(), vs[0],
                         kv_cache.data_ptr(), num_slots, out.data_ptr(), os[0], query.shape[1], num_kv_heads,
                         head_dim, block_size, _float_bits(scale), sliding_window, bf16)
        if rc == -1:
            raise IndexError(f"a KV-cache slot of {step.slots[:step.num_tokens].tolist()} is outside the "
                             f"cache's {num_slots} slots")
        return rc == 0


    def prefill(self, query: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                chunks: torch.Tensor, scale: float) -> bool:
        """Causal attention of prefill chunks over ``kv_cache`` ([2, blocks,
        block_size, KV, D], the step's keys and values already in it), each a
        row of ``chunks`` ([n, 4] int64: its first row of ``query``, its rows,
        its context length counting them, its row of ``block_table``); the
        chunk's rows of ``query`` ([T, H, D]) are the last positions of its
        context, and its rows of ``out`` are written. False, with nothing
        written, where the kernel does not take these tensors (a dtype other
        than fp32 and bf16, heads not side by side in a row, head dims that
        are not a multiple of 16 or over 256, more than 48 query heads to a KV
        head, a CPU without AVX-512): the caller's SDPA path then runs."""
        dtype = kv_cache.dtype
        bf16 = _DTYPES.get(dtype)
        if bf16 is None or not self.prefills or not kv_cache.is_cpu or not kv_cache.is_contiguous():
            return False
        _, blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        qs, os = query.stride(), out.stride()
        if not (query.dtype == out.dtype == dtype and query.is_cpu and out.is_cpu and out.shape == query.shape
                and query.shape[2] == head_dim and qs[2] == os[2] == 1 and qs[1] == os[1] == head_dim
                and block_table.dtype == torch.int32 and block_table.dim() == 2 and block_table.stride(1) == 1):
            return False
        if not (chunks.dtype == torch.int64 and chunks.dim() == 2 and chunks.shape[1] == 4 and chunks.is_contiguous()
                and chunks.shape[0] > 0):
            raise ValueError(f"prefill chunks must be a contiguous [n, 4] int64 tensor, n > 0; got {chunks.dtype} "
                             f"{tuple(chunks.shape)}")
        rc = self._prefill(query.data_ptr(), qs[0], kv_cache.data_ptr(), blocks * block_size, block_table.data_ptr(),
                           block_table.stride(0), block_table.shape[0], chunks.data_ptr(), chunks.shape[0],
                           out.data_ptr(), os[0], query.shape[0], query.shape[1], num_kv_heads, head_dim, block_size,
                           _float_bits(scale), bf16, torch.get_num_threads())
        if rc == -1:
            raise IndexError(f"prefill chunks {chunks.tolist()} (first row, rows, context, table row) include an "
                             f"empty one or one outside the {query.shape[0]} query rows, the block table's "
                             f"{tuple(block_table.shape)} or the cache's {blocks} blocks")
        return rc == 0  # -3: no memory for the kernel's list of work, left to SDPA


_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the kernel's dtypes, as its bf16 flag


@functools.lru_cache(maxsize=64)
def _float_bits(value: float) -> int:
    """The bits of ``value`` as an fp32, as a signed 32-bit integer."""
    return struct.unpack("<i", struct.pack("<f", value))[0]
