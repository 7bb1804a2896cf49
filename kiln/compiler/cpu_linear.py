"""Small-batch linear layers on CPU in C (``cpu_linear.c``), as the op
``kiln::cpu_linear`` inside compiled pieces and as the LM head.

At one to a few tokens a linear layer is bound by reading its weight. Inductor's
reduction form of the product (``kiln.compiler.gemv``) streams an fp32 weight
at close to the machine's bandwidth for one token (a step's weights at 25 GB/s
against the kernel's 29.8 on an Intel Xeon: ``LinearPolicy``), but runs the
rows of a 2- or 4-token piece one after another, converts bf16 weights at a
cost that hid their halved bytes, and unpacks quantized words through a stack
copy. The C kernel reads each weight vector once, converts it once and
multiplies it into every activation row, with the accumulators in registers.
The 135M shape's LM head (49152 x 576, 2 threads, weights larger than the
caches; ``python -m bench.cpu_kernels --only cpu-linear``):

- AVX2 (an AMD EPYC; bench/results/cpu-linear-cpu-20261202-064957.json): fp32
  at 1, 2 and 4 rows 6.9, 8.8 and 7.6 ms against Inductor's 7.6, 13.6 and 27.8
  ms; bf16 3.3, 4.2 and 4.4 ms against ``mm``'s 4.8, 8.3 and 15.8 ms;
- AVX-512 with AVX512-BF16 (an Intel Xeon; cpu-linear-cpu-20261202-144929.json):
  fp32 4.5, 4.6 and 5.6 ms against Inductor's 5.1, 9.3 and 16.9 ms; bf16 2.5,
  2.9 and 3.6 ms against ``mm``'s 4.0, 4.2 and 4.4 ms; at one row int8 1.3,
  q8_0 1.5 and q4 1.2 ms against Inductor's 10.7, 11.3 and 6.7 ms.

The packed formats ending in ``-a8`` round their activations to int8 per 32
elements (``kiln.models.quant.round_activations``, as every path of such a
layer does); with AVX512-VNNI (``CpuLinearKernel.vnni``) the kernel then
multiplies the bytes as integers, four products summed by one instruction,
which made a one-row q4 layer 1.15-2.0x as fast from cache and brought one
streamed from DRAM to 29 GB/s (``vnni_row`` in the C source has the
measurements).

Inside a compiled piece the op is an extern call that Inductor schedules
between its fused kernels; its fake implementation gives the output's shape.
Its CPU implementation calls the library this process loaded last (``load``):
libraries are named after their source, so any two a process loads hold the
same code.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.models.quant import QuantizedLinear
from kiln.native import KernelBuildError, NativeSource, import_extension, python_headers, register_c_function

__all__ = ["DENSE_KINDS", "FLOAT_DTYPES", "MAX_ROWS", "PACKED_KINDS", "CpuLinearKernel", "KernelBuildError",
           "LinearPolicy", "PanelsAhead", "SOURCE", "build", "cpu_linear", "dense_kind", "implementation", "load",
           "model_kinds"]

SOURCE = NativeSource(Path(__file__).with_name("cpu_linear.c"), "cpu-linear")
MAX_ROWS = 8  # KILN_MAX_ROWS: activation rows one call takes (fp32: CpuLinearKernel.max_rows)
MAX_K = 65536  # KILN_MAX_K
_ROUND_X = 16  # KILN_ROUND_X: or'ed into a packed kind whose activations are rounded (the "-a8" formats)
_KINDS = {"f32": 0, "bf16": 1, "int8": 2, "q8_0": 3, "q4": 4}  # enum in cpu_linear.c
_KINDS |= {f"{name}-a8": code | _ROUND_X for name, code in _KINDS.items() if code >= 2}
PACKED_KINDS = tuple(name for name, code in _KINDS.items() if code & ~_ROUND_X >= 2)  # int8, q8_0, q4 and -a8
DENSE_KINDS = {torch.float32: "f32", torch.bfloat16: "bf16"}


def dense_kind(x_dtype: torch.dtype, weight_dtype: torch.dtype) -> str | None:
    """The kernel's kind for a dense linear of these dtypes, or None (fp16, or
    activations and weight of different dtypes: the compiled reduction stays)."""
    return DENSE_KINDS.get(x_dtype) if x_dtype == weight_dtype else None


def model_kinds(model: nn.Module) -> set[str]:
    """The kinds ``model``'s linears and LM head can ask of the kernel: each
    dense layer's (``dense_kind``, activations in the weight's dtype) and each
    packed layer's format."""
    kinds = {m.fmt.name for m in model.modules() if isinstance(m, QuantizedLinear)}
    dense = [m.weight.dtype for m in model.modules() if isinstance(m, nn.Linear)]
    logits_inputs = getattr(model, "logits_inputs", None)
    if logits_inputs is not None:
        tensors, fmt = logits_inputs()
        if fmt is not None:
            kinds.add(fmt.name)
        else:
            dense.append(tensors[0].dtype)
    kinds.update(kind for kind in (dense_kind(d, d) for d in dense) if kind is not None)
    return kinds


def _mask(kinds: set[str] | frozenset[str]) -> int:
    """``KILN_KINDS`` for ``kinds``: one bit per kind's code, the ``-a8`` kinds
    sharing their packing's."""
    unknown = sorted(set(kinds) - set(_KINDS))
    if unknown:
        raise ValueError(f"unknown linear kernel kinds {unknown}; known: {sorted(_KINDS)}")
    return sum({1 << (_KINDS[k] & ~_ROUND_X) for k in kinds})


def build(inductor_dir: Path, kinds: set[str] | frozenset[str] | None = None) -> str:
    """Build the library for ``kinds`` (None: every kind) into ``inductor_dir``
    unless it is there; its name relative to it. A model's library holds only
    the kinds it uses (``model_kinds``): gcc -O3 took 7.3 s for all five
    kinds here and 2.2 s for fp32 alone, a cold compile's critical work on
    two cores."""
    flags = () if kinds is None else (f"-DKILN_KINDS={_mask(kinds):#x}",)
    headers = python_headers()
    if headers is None:  # called through ctypes alone
        return SOURCE.build(inductor_dir, flags)
    return SOURCE.build(inductor_dir, (*flags, "-DKILN_PYTHON"), include_dirs=(headers,))


@dataclass(frozen=True)
class PanelsAhead:
    """The fp32 panels (``CpuLinearKernel.f32_panels``) of the linear a step
    makes after another, whose first lines ``kiln_panels_linear`` asks for
    while it computes the other's last panel: a hint, which changes no result."""

    panels: torch.Tensor
    rows: int  # the weight's N
    depth: int  # its K


@dataclass(frozen=True)
class LinearPolicy:
    """Which linears of a few-token CPU piece call the kernel: bf16 and the
    packed kinds at any count up to ``MAX_ROWS``, fp32 up to ``f32_rows`` from
    two tokens on, or from one with ``f32_one_row``; bf16 none where the
    kernel has AMX tiles (``tiles``), which take them. Without
    ``f32_one_row`` an fp32 linear at one token stays Inductor's reduction,
    fused into the piece with the norms around it.

    The kernel takes fp32 at one token in an AVX-512 build (``CpuLinearKernel``
    sets ``f32_one_row``): there the piece's fused reduction loop read a
    step's weights at about 25 GB/s (80% of a batch-1 step's `perf` samples,
    16.9 of 21 ms for 425 MB), the kernel at 29.8, level with ``sum``'s 29.7
    (the 120 linears of the 135M shape alone, one row, scratch timing). Whole
    batch-1 steps of the real model in fp32 (300 new tokens, fresh processes,
    two rounds taking turns, 2026-12-07): a median step of 21.5 and 21.8 ms in
    Inductor against 15.7 and 14.9 ms with the kernel; ``bench.decode`` 51.9
    tok/s before (bench/results/decode-cpu-20261207-141935.json) against 73.6
    and 71.3 after (-141239, -142018), the greedy tokens still transformers'.
    An AVX2 build keeps the reduction at one token, from the runs below (none
    since on such a CPU).

    Whole decode steps of the 135M shape at one token, kiln -O2, fresh
    processes, the median step of 128 new tokens (scratch runs, 2026-12-04):

    - AVX2 (an AMD EPYC, Zen 3, `sum` about 16-21 GB/s): Q8_0 51-55 tok/s in
      Inductor against 96-104 with the kernel, Q4_1 43-44 against 87-91, int8
      60-63 against 99-111; fp32 30-34 in Inductor against 27-30 with the
      kernel. Until then the packed kinds stayed in Inductor at one token on
      AVX2, from runs that predated the kernel's prefetch, its
      extension-module call and the C replay of a step's calls.
    - AVX-512 with AVX512-BF16 (an Intel Xeon): fp32 36.6-40.9 in Inductor
      against 33.4-36.2 with the kernel (38.8-40.6 against 35.7-39.9 once the
      kernel prefetched its weights); int8 22.0-22.6 in Inductor against
      63.0-63.6 with the kernel (78.2-83.3 with the prefetch), whose 16-lane
      unpacking Inductor's loop does not match."""

    kinds: frozenset[str] = frozenset(_KINDS)  # the kinds the library was built with
    f32_rows: int = MAX_ROWS  # the most rows of an fp32 linear one call takes (CpuLinearKernel.max_rows)
    # bf16 linears on the AMX tiles (CpuLinearKernel.amx) at every row count, through
    # kiln::onednn_linear: a step's bf16 linears of the 135M shape took 7.4, 7.9 and
    # 7.6 ms there at 2, 4 and 8 rows against this kernel's 8.9, 9.4 and 16.5, and 7.1
    # both at one row (2 threads of an Intel Xeon, 2026-12-07; bench/results/
    # step-linears-cpu-*.json has 8 rows). One path for every count up to
    # onednn.AMX_MAX_ROWS also gives a row the same bits of its linears whatever its batch.
    tiles: bool = False
    f32_one_row: bool = False  # fp32 linears at one token call the kernel too (an AVX-512 build)

    def takes(self, kind: str, tokens: int) -> bool:
        """Whether a piece of ``tokens`` rows calls the kernel for a linear of ``kind``."""
        if kind not in self.kinds or tokens > self.most_rows(kind) or self.to_tiles(kind):
            return False
        return kind == "bf16" or kind in PACKED_KINDS or tokens >= (1 if self.f32_one_row else 2)

    def to_tiles(self, kind: str | None) -> bool:
        """Whether a dense linear of ``kind`` goes to the AMX tiles instead, at any row count."""
        return self.tiles and kind == "bf16"

    def most_rows(self, kind: str) -> int:
        """The most rows of a ``kind`` linear that one call of the kernel takes."""
        return self.f32_rows if kind == "f32" else MAX_ROWS


class CpuLinearKernel:
    """The built library, loaded."""

    def __init__(self, path: Path) -> None:
        self.path = path
        library = ctypes.CDLL(str(path))
        isa = library.kiln_linear_isa
        isa.restype = ctypes.c_char_p
        self.isa: str = isa().decode()  # "avx512-bf16", "avx512" or "avx2": the vectors it was built with
        try:
            mask = library.kiln_linear_kinds()
        except AttributeError:  # a library built before kinds were chosen holds every kind
            mask = _mask(frozenset(_KINDS))
        self.kinds = frozenset(k for k, code in _KINDS.items() if mask >> (code & ~_ROUND_X) & 1)
        max_rows = _declared(library, "kiln_linear_max_rows", [ctypes.c_int, ctypes.c_int])
        # the most rows one call takes, by kind (fp32 out): a library built before
        # fp32's blocked rows (rows_f32_block) takes MAX_ROWS of every kind
        self.max_rows: dict[str, int] = {k: max_rows(code, 0) if max_rows is not None else MAX_ROWS
                                         for k, code in _KINDS.items() if k in self.kinds}
        # the "-a8" kinds: products of the packed integers and the int8-rounded
        # activations summed as integers (AVX512-VNNI), else of the same values in fp32
        self.vnni: bool = bool(library.kiln_linear_vnni())
        # the compiler targeted AMX's tiles (bf16 and int8 products; and fp16 ones), whatever
        # the kinds: lets a cold compile skip Inductor's AMX probe (toolchain.trusted_prediction)
        target = library.kiln_linear_amx_target() if hasattr(library, "kiln_linear_amx_target") else 0
        self.amx_target: bool = bool(target & 1)
        self.amx_fp16_target: bool = bool(target & 2)
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._fn: Any = _declared(library, "kiln_linear",
                                  [i32, p, i32, i64, i64, p, p, p, i64, i64, p, p, i32, i64, i32])
        # Built with Python's headers, the library is also an extension module whose
        # functions take the tensors themselves (-DKILN_PYTHON in cpu_linear.c).
        module = import_extension(path, "kiln_linear") if hasattr(library, "PyInit_kiln_linear") else None
        self._linear: Any = getattr(module, "linear", None)
        self._argmax: Any = getattr(module, "argmax", None)
        self._silu_mul_ext: Any = getattr(module, "silu_mul", None)
        self._declare_layouts(library, module)
        # fp32 rows past the few-row loop's 8 go to the panels where there are any: at 9 to 16
        # rows a step's linears took 29.4-32.6 ms there against the loop's 34.8-36.9
        # (bench/results/step-linears-cpu-20261207-045821.json); 16 fp32 requests of 128
        # new tokens, two rounds taking turns: 58.5 and 52.4 -> 52.5 and 50.8 ms a step
        # (decode-throughput-cpu-20261207-051135, -051824 -> -051530, -052108)
        self.policy = LinearPolicy(self.kinds, MAX_ROWS if self.panels else self.max_rows.get("f32", MAX_ROWS),
                                   tiles=self.amx and "bf16" in self.kinds, f32_one_row=self.isa.startswith("avx512"))
        # kiln_silu_mul: the gated MLP's activation (kiln.compiler.activation)
        self._silu_mul: Any = _declared(library, "kiln_silu_mul", [p, i64, i64, i64, p, i64, i32, i32])
        for ext, c in ((self._linear, self._fn), (self._amx_linear_ext, self._amx_linear),
                       (self._panels_linear_ext, self._panels_linear), (self._silu_mul_ext, self._silu_mul)):
            if ext is not None and c is not None:  # the extension's function passes its arguments on in order
                register_c_function(ext, c)
        # kiln_replay: a CPU call graph's calls made from C (kiln.graphs.cpu)
        self.replay_loop: Any = _declared(library, "kiln_replay", [p, i64, ctypes.POINTER(i64)], i64)
        self.replay_args = library.kiln_replay_args() if self.replay_loop is not None else 0  # the most a call has

    def _declare_layouts(self, library: ctypes.CDLL, module: Any) -> None:
        """The kernels of weights the library lays out itself: bf16 on AMX
        tiles (``amx``), fp32 as panels (``panels``)."""
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        # kiln_amx_linear: bf16 linears of any number of rows on AMX tiles, where
        # the library was built for a CPU with them and Linux grants them to
        # this process (False in a library built before it was there); a library
        # of fp32 alone has them for its greedy screen (kiln.compiler.greedy_head)
        self.amx: bool = hasattr(library, "kiln_amx") and library.kiln_amx() == 1
        self._amx_linear_ext: Any = getattr(module, "amx_linear", None)
        self._amx_pack: Any = _declared(library, "kiln_amx_pack", [p, i64, i64, p, i32]) if self.amx else None
        self._amx_linear: Any = (_declared(library, "kiln_amx_linear", [p, i64, i64, i64, p, i64, p, p, i64, i32])
                                 if self.amx else None)
        # kiln_panels_linear: fp32 linears of many rows on weights laid out as panels,
        # where the library was built with AVX-512 (False in one built before it was there)
        self.panels: bool = hasattr(library, "kiln_panels") and library.kiln_panels() == 1
        self._panels_linear_ext: Any = getattr(module, "panels_linear", None)
        self._panels_size: Any = _declared(library, "kiln_panels_size", [i64, i64], i64) if self.panels else None
        self._panels_pack: Any = _declared(library, "kiln_panels_pack", [p, i64, i64, p, i32]) if self.panels else None
        self._panels_linear: Any = (_declared(library, "kiln_panels_linear",
                                              [p, i64, i64, i64, p, i64, p, p, i64, i32, p, i64, i64])
                                    if self.panels else None)
        # kiln_greedy_screen: an fp32 head's greedy tokens from its bf16 product (kiln.compiler.greedy_head)
        self._greedy_screen: Any = _declared(library, "kiln_greedy_screen",
                                             [p, i64, i64, i64, p, i64, p, i64, p, i32, p, i32])
        self.greedy_screens: bool = self.amx and self._greedy_screen is not None  # kiln.compiler.greedy_head

    def argmax_rows(self, t: torch.Tensor) -> list[int] | None:
        """Each row's index of its largest value, as ``t.max(dim=-1)`` picks it
        (the first of equal ones, the first NaN), for a CPU fp32 or bf16
        ``[rows, n]`` tensor with contiguous rows; None for anything else, or
        a library without the extension module."""
        if (self._argmax is None or t.dim() != 2 or t.dtype not in FLOAT_DTYPES or not t.is_cpu
                or t.stride(1) != 1):
            return None
        return self._argmax(t, t.dtype == torch.bfloat16, t.shape[0], t.shape[1], _row_stride(t),
                            torch.get_num_threads())

    def amx_tiles(self, weight: torch.Tensor) -> torch.Tensor | None:
        """``weight`` (``[N, K]`` bf16) laid out as the AMX kernel's tiles
        (``kiln_amx_pack``), for ``amx_linear``; None where the kernel does
        not take it: no AMX (``amx``), another dtype or device, or N not a
        multiple of 16 or K of 32 (every projection and vocabulary of the
        Llama, Mistral and Qwen families is)."""
        if not self.amx or weight.dim() != 2 or weight.dtype != torch.bfloat16 or not weight.is_cpu:
            return None
        n, k = weight.shape
        if n < 16 or n % 16 or k < 32 or k % 32:
            return None
        weight = weight.contiguous()
        tiles = torch.empty(n * k, dtype=torch.bfloat16)
        if self._amx_pack(weight.data_ptr(), n, k, tiles.data_ptr(), torch.get_num_threads()) != 0:
            return None
        return tiles

    def amx_linear(self, x: torch.Tensor, tiles: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [..., K] @ W.T + bias`` in bf16 on the AMX tiles, ``tiles``
        being W's (``amx_tiles``) and ``n`` its rows. Called once per linear
        of a many-row piece, so written, like ``__call__``, for few Python
        steps: the extension module's call takes the tensors as they are,
        and rows as the pieces hand them over (2-D, each contiguous) are
        neither reshaped nor viewed (2 us of a 7 us call, scratch timing)."""
        return self._laid_out_linear("an AMX", self._amx_linear_ext, self._amx_linear, x, tiles, n, bias,
                                     torch.bfloat16)

    def f32_panels(self, weight: torch.Tensor) -> torch.Tensor | None:
        """``weight`` (``[N, K]`` fp32) laid out as panels of 48 columns
        (``kiln_panels_pack``), for ``panels_linear``; None where the kernel
        does not take it: no panels (``panels``), another dtype or device.
        The layout pads N up to whole panels with zeros."""
        if not self.panels or weight.dim() != 2 or weight.dtype != torch.float32 or not weight.is_cpu:
            return None
        n, k = weight.shape
        if n < 1 or k < 1:
            return None
        weight = weight.contiguous()
        panels = torch.empty(self._panels_size(n, k), dtype=torch.float32)
        if self._panels_pack(weight.data_ptr(), n, k, panels.data_ptr(), torch.get_num_threads()) != 0:
            return None
        return panels

    def panels_linear(self, x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None,
                      ahead: PanelsAhead | None = None) -> torch.Tensor:
        """``x [..., K] @ W.T + bias`` in fp32 on W's panels (``f32_panels``;
        ``n``: W's rows), at any number of rows; called as ``amx_linear``.
        ``ahead``: the linear the caller makes next, whose first panels the
        kernel asks for during this one's last (a hint: the result is the same)."""
        more = (None, 0, 0) if ahead is None else (ahead.panels, ahead.rows, ahead.depth)
        return self._laid_out_linear("a panels", self._panels_linear_ext, self._panels_linear, x, panels, n, bias,
                                     torch.float32, more)

    def greedy_screen(self, x: torch.Tensor, weight: torch.Tensor, screen: torch.Tensor, norms: torch.Tensor,
                      panels: bool) -> list[int] | None:
        """Each row's argmax of ``x @ weight.T`` (fp32, ``[M, K]`` by ``[N, K]``)
        as the panels (``panels``) or the dense rows of one call of M rows
        sum it, bit for bit, computing only the columns that ``screen`` (the
        same product in bf16, ``[M, N]``) and ``norms`` (each weight row's
        length, rounded up) leave in doubt (``kiln_greedy_screen``); None
        where the library has no screen or refuses the sizes."""
        fn = self._greedy_screen
        if fn is None or x.dim() != 2 or x.stride(1) != 1 or screen.stride(1) != 1 or not weight.is_contiguous():
            return None
        m, k = x.shape
        out = torch.empty(m, dtype=torch.int64)
        rc = fn(x.data_ptr(), _row_stride(x), m, k, weight.data_ptr(), weight.shape[0], screen.data_ptr(),
                _row_stride(screen), norms.data_ptr(), int(panels), out.data_ptr(), torch.get_num_threads())
        return out.tolist() if rc == 0 else None

    def _laid_out_linear(self, what: str, ext: Any, fn: Any, x: torch.Tensor, layout: torch.Tensor, n: int,
                         bias: torch.Tensor | None, dtype: torch.dtype, more: tuple[Any, ...] = (),
                         ) -> torch.Tensor:
        """One call of a kernel on a weight it laid out (``ext``, else its
        ctypes twin ``fn``), the arguments as ``kiln_amx_linear`` takes them,
        then ``more`` (``kiln_panels_linear``'s next linear: its panels or
        None, its N and K)."""
        k = x.shape[-1]
        rows = x if x.dim() == 2 and x.stride(1) == 1 else _rows(x)
        m = rows.shape[0]
        out = _empty((m, n), (n, 1), dtype)
        if m == 0:
            return out.view(*x.shape[:-1], n)
        if bias is not None and (bias.dtype != dtype or bias.stride(-1) != 1):
            bias = bias.to(dtype).contiguous()
        threads, stride = torch.get_num_threads(), _row_stride(rows)
        if ext is not None:
            rc = ext(rows, stride, m, k, layout, n, bias, out, n, threads, *more)
        else:
            addresses = (_ptr(more[0]), *more[1:]) if more else ()
            rc = fn(rows.data_ptr(), stride, m, k, layout.data_ptr(), n, _ptr(bias), out.data_ptr(), n, threads,
                    *addresses)
        if rc != 0:
            raise RuntimeError(f"{self.path.name} refused {what} linear of {(m, k)} by [{n}, {k}] (rc {rc})")
        return out if rows is x else out.view(*x.shape[:-1], n)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` for ``x [..., 2 I]`` holding gate, then up, in
        its last dimension (a merged gate/up product), in ``x``'s dtype
        (``kiln_silu_mul``); None for a dtype other than fp32 and bf16, or a
        library built before the loop was there."""
        if self._silu_mul is None or x.dtype not in FLOAT_DTYPES or not x.is_cpu:
            return None
        width = x.shape[-1]
        if width % 2:
            raise ValueError(f"silu_mul takes gate and up halves of an even last dimension, got {tuple(x.shape)}")
        inter = width // 2
        rows = x if x.dim() == 2 and x.stride(1) == 1 else _rows(x)
        m = rows.shape[0]
        out = _empty((m, inter), (inter, 1), x.dtype)
        bf16, threads = x.dtype == torch.bfloat16, torch.get_num_threads()
        if m == 0 or inter == 0:
            return out.view(*x.shape[:-1], inter)
        stride = _row_stride(rows)
        if self._silu_mul_ext is not None:
            rc = self._silu_mul_ext(rows, stride, m, inter, out, inter, bf16, threads)
        else:
            rc = self._silu_mul(rows.data_ptr(), stride, m, inter, out.data_ptr(), inter, bf16, threads)
        if rc != 0:
            raise RuntimeError(f"{self.path.name} refused silu_mul of {tuple(rows.shape)} (rc {rc})")
        return out if rows is x else out.view(*x.shape[:-1], inter)

    def native_sites(self) -> list[tuple[object, str]]:
        """Where ``__call__``, ``amx_linear``, ``panels_linear`` and ``silu_mul`` find their
        native functions (``kiln.graphs.cpu``). A call made elsewhere would be
        left out of a replay without a word: these do no torch work a capture
        could refuse."""
        return [(self, "_linear"), (self, "_fn"), (self, "_amx_linear_ext"), (self, "_amx_linear"),
                (self, "_panels_linear_ext"), (self, "_panels_linear"), (self, "_silu_mul_ext"), (self, "_silu_mul")]

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None,
                 offsets: torch.Tensor | None, bias: torch.Tensor | None, kind: str) -> torch.Tensor:
        """``x [..., K] @ W.T + bias`` in ``x``'s dtype. ``weight``: ``[N, K]``
        (``f32``, ``bf16``) or packed words ``[N, K / G, 8]`` with their scales
        and offsets (``int8``, ``q8_0``, ``q4``: ``kiln.models.quant``).

        Written for its per-call cost, which a decode step pays 120 times: when
        ``x`` is up to ``max_rows[kind]`` contiguous rows (every call of a few-token
        piece), one allocation and one ctypes call, with no other tensor made
        (6.5 -> 5.6-6.0 us a call of a [1, 64] by [64, 64] bf16 linear, 1 thread,
        scratch timing: the ctypes call itself is 2.5 us, the allocation 1.4).
        With the extension module the call takes the tensors as they are
        (the call 1.1 us against ctypes' 2.9-4.0; the whole method 10.5 ->
        5.8-7.0 us, scratch timings on a busy machine), and the output comes
        from the allocator Inductor's own code calls (0.7-0.95 us against
        ``new_empty``'s 2.2-3.5)."""
        n = weight.shape[0]
        bf16 = x.dtype == torch.bfloat16
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        most = MAX_ROWS if bf16 else self.max_rows.get(kind, MAX_ROWS)  # a kind not built: refused below
        if x.dim() == 2 and x.stride(1) == 1 and 0 < x.shape[0] <= most:
            m, k = x.shape
            out = _empty((m, n), (n, 1), x.dtype)
            if self._linear is not None:
                rc = self._linear(_KINDS[kind], x, bf16, x.stride(0), m, weight, scales, offsets, n, k, bias, out,
                                  bf16, n, torch.get_num_threads())
            else:
                rc = self._fn(_KINDS[kind], x.data_ptr(), bf16, x.stride(0), m, weight.data_ptr(), _ptr(scales),
                              _ptr(offsets), n, k, _ptr(bias), out.data_ptr(), bf16, n, torch.get_num_threads())
            if rc != 0:
                raise RuntimeError(f"{self.path.name} refused a {kind} linear of {(m, k)} by [{n}, {k}] (rc {rc})")
            return out
        sp, op, bp = _ptr(scales), _ptr(offsets), _ptr(bias)
        k = x.shape[-1]
        rows = x.reshape(-1, k).contiguous()
        m = rows.shape[0]
        out = rows.new_empty((m, n))
        code, threads, w = _KINDS[kind], torch.get_num_threads(), weight.data_ptr()
        for start in range(0, m, most):
            part = rows[start:start + most]
            dst = out.data_ptr() + start * n * out.element_size()
            rc = self._fn(code, part.data_ptr(), bf16, part.stride(0), part.shape[0], w, sp, op, n, k, bp, dst, bf16,
                          n, threads)
            if rc != 0:
                raise RuntimeError(f"{self.path.name} refused a {kind} linear of {tuple(part.shape)} by "
                                   f"[{n}, {k}] (rc {rc})")
        return out.view(*x.shape[:-1], n)


FLOAT_DTYPES = frozenset({torch.float32, torch.bfloat16})  # what the argmax and SiLU loops take


def _declared(library: ctypes.CDLL, name: str, argtypes: list[Any], restype: Any = ctypes.c_int) -> Any:
    """``library``'s C function ``name`` with its types declared, or None in a
    library built before it was there."""
    fn = getattr(library, name, None)
    if fn is not None:
        fn.argtypes, fn.restype = argtypes, restype
    return fn


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x [..., K]`` as ``[rows, K]`` with each row contiguous (a view where it can be)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _row_stride(rows: torch.Tensor) -> int:
    """The distance between ``rows``' rows, in elements; a single row's is its
    width, whatever stride torch gave its dimension of size one."""
    return rows.stride(0) if rows.shape[0] > 1 else rows.shape[1]


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


_empty = torch._C._dynamo.guards._empty_strided_cpu  # (size, stride, dtype): what Inductor's CPU code allocates with


def allocation_site() -> tuple[dict[str, Any], str]:
    """Where the kernels' outputs are allocated from (``kiln.graphs.cpu``
    swaps it while it captures)."""
    return globals(), "_empty"
_LOADED: list[CpuLinearKernel] = []  # what the op calls: the library loaded last


def load(path: Path) -> CpuLinearKernel:
    """Load the library at ``path`` and make it the op's implementation."""
    kernel = CpuLinearKernel(path)
    _LOADED[:] = [kernel]
    return kernel


def current() -> CpuLinearKernel | None:
    """The library the op calls now (the one loaded last), or None."""
    return _LOADED[0] if _LOADED else None


def implementation(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None,
                   offsets: torch.Tensor | None, bias: torch.Tensor | None, kind: str) -> torch.Tensor:
    """The op's CPU implementation (exported code calls it directly,
    ``kiln.compiler.replay``)."""
    if not _LOADED:
        raise RuntimeError("kiln::cpu_linear was called before its library was loaded "
                           "(kiln.compiler.cpu_linear.load): the compiled pieces came without it")
    return _LOADED[0](x, weight, scales, offsets, bias, kind)


def _fake(x, weight, scales, offsets, bias, kind):  # noqa: ANN001, ANN202
    return x.new_empty(*x.shape[:-1], weight.shape[0])


# A torch.library op, not @custom_op: a call through the dispatcher costs about
# 4 us against 32 us (bench/results/op-overhead-cpu-latest.json), and a decode
# step of the 135M shape makes 120 of them.
_LIB = torch.library.Library("kiln", "FRAGMENT")
_LIB.define("cpu_linear(Tensor x, Tensor weight, Tensor? scales, Tensor? offsets, Tensor? bias, str kind) -> Tensor")
_LIB.impl("cpu_linear", implementation, "CPU")
torch.library.register_fake("kiln::cpu_linear", _fake, lib=_LIB)
cpu_linear: Any = torch.ops.kiln.cpu_linear.default
