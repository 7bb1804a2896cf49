"""Weight-only quantized linear layers, kept packed in memory and run by
Inductor-fused code.

A batch-1 decode step reads every weight once, so on a CPU its speed is the
memory bandwidth divided by the weights' bytes. Stored as 8-bit integers with a
float scale per row or per 32 elements, a linear layer reads about a quarter of
its fp32 bytes; as 4-bit integers with a scale and an offset per 32 elements,
about a fifth.

Formats (``FORMATS``):

- ``int8``: symmetric int8 with one scale per output row, quantized by kiln from
  any checkpoint (``Runtime.load(..., quantization="int8")``);
- ``q8_0``: int8 with one scale per 32 elements (GGUF's Q8_0, kept as stored);
- ``q4``: 4-bit integers with a scale and an offset per 32 elements (GGUF's
  Q4_1, and Q4_0 with offset ``-8 * scale``).

The per-block scales and offsets of ``q8_0`` and ``q4`` are fp16, as in the
GGUF file, so nothing is rounded: kept as fp32 they made ``q8_0`` 1.125 bytes
a weight instead of 1.0625 and ``q4`` 0.75 instead of 0.625, bytes a
memory-bound decode step reads every step. ``int8``'s one scale per row stays
fp32 (kiln computes it; its bytes do not matter).

Packing: the integers go into 32-bit words, four bytes or eight nibbles each,
interleaved so that one word lane holds elements ``w, w + 8, w + 16, ...`` of an
8-word group. Unpacking byte (nibble) ``b`` of eight consecutive words then
gives eight *consecutive* elements, which multiply eight consecutive
activations: one vector load of weights, shifts, one int->float conversion and
a multiply-add per 8 weights, no gathers. The words are stored as float32 bit
patterns and bit-cast back to int32 inside the compiled code: Inductor's CPU
code loads integer vectors through a stack copy (ATen's ``Vectorized<int>::
loadu`` with a count), which made the int32 form barely faster than fp32,
while float vectors load directly (LM head of the 135M model at 1 token, 2
threads: fp32 9.1 ms, q8_0 words as int32 8.1 ms, as float32 bit patterns 3.8
ms; bench/results/quant-kernels-cpu-20261201-141255.json).

The modes ending in ``-a8`` (``"int8-a8"``, ``"gguf-a8"``) pack the same
weights and round each packed layer's activations to int8 per 32 elements
(``round_activations``), as llama.cpp's quantized products do: the C kernel
then multiplies bytes by bytes with AVX512-VNNI (``kiln/compiler/
cpu_linear.c``), and every other path (the eager op, the compiled reductions,
``dequantize`` + ``linear``) rounds the same way, so that they compute one
function and a request's tokens do not depend on which path ran. This is no
longer weight-only: greedy tokens agree less with the dense model (``python
-m bench.quantized``), which is why it is a mode of its own. Its formats are
the packed ones with ``-a8`` appended (``q4-a8``).

The layer is one ``kiln::quantized_linear`` op in the traced graph. The compiler
replaces it with plain torch code before Inductor sees it (``reduction`` for
the few-token CPU pieces, where the dequantization fuses into the dot products;
``dequantize`` + ``linear`` elsewhere); run eagerly (``-O0``) the op
dequantizes the whole weight on every call, which is correct but slow.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kiln.checkpoint import CheckpointError, QuantizedTensor

__all__ = [
    "ACTIVATION_BLOCK", "FORMATS", "QUANTIZATION_MODES", "QUANTIZATION_PLAN_VERSION", "ROUNDED_SUFFIX",
    "QuantFormat", "QuantizedLinear", "dequantize", "pack", "quantize_int8", "round_activations",
    "packed_layers", "packed_linear", "quantized_linear", "reduction",
]

# what Runtime.load(quantization=...) accepts besides None; "-a8": activations rounded to int8 too
QUANTIZATION_MODES = ("int8", "gguf", "int8-a8", "gguf-a8")
ROUNDED_SUFFIX = "-a8"
# Bumped when a mode's choice of packed layers or their layout changes: compiled
# entries record it (through the cache key), as their graphs depend on both.
QUANTIZATION_PLAN_VERSION = 2  # 2: q8_0's and q4's scales and offsets fp16
ACTIVATION_BLOCK = 32  # activations share one int8 scale per this many elements along K


@dataclass(frozen=True)
class QuantFormat:
    """How one packed layout stores a ``[N, K]`` weight."""

    name: str
    bits: int
    block: int | None  # elements per scale along K; None: one scale per row
    has_offsets: bool
    round_activations: bool = False  # the layer's input rounded to int8 per 32 (``round_activations``)

    @property
    def packing(self) -> str:
        """The name of the weights' layout, without the ``-a8`` suffix."""
        return self.name.removesuffix(ROUNDED_SUFFIX)

    def rounded(self) -> "QuantFormat":
        """The same packing with the activations rounded."""
        return FORMATS[self.packing + ROUNDED_SUFFIX]

    @property
    def group(self) -> int:
        """Elements per 8-word group (the K granularity of the packing)."""
        return 8 * 32 // self.bits

    def k_multiple(self) -> int:
        return max(self.group, self.block or 0)

    @property
    def scale_dtype(self) -> torch.dtype:
        """The scales' and offsets' dtype: fp16 per block (GGUF's own), fp32 per row."""
        return torch.float16 if self.block else torch.float32

    def nbytes(self, n: int, k: int) -> int:
        """Bytes of a packed ``[n, k]`` weight: words, scales, offsets."""
        scales = n * (k // self.block if self.block else 1)
        size = torch.empty((), dtype=self.scale_dtype).element_size()
        return n * k * self.bits // 8 + size * scales * (2 if self.has_offsets else 1)


_PACKINGS = [QuantFormat("int8", 8, None, False), QuantFormat("q8_0", 8, 32, False), QuantFormat("q4", 4, 32, True)]
FORMATS = {f.name: f for f in _PACKINGS} | {
    f.name + ROUNDED_SUFFIX: dataclasses.replace(f, name=f.name + ROUNDED_SUFFIX, round_activations=True)
    for f in _PACKINGS
}


def quantize_int8(weight: torch.Tensor) -> QuantizedTensor:
    """Symmetric per-row int8: ``scale = max|w| / 127``, values rounded."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    values = torch.round(w / scales).clamp_(-127, 127).to(torch.int8)
    return QuantizedTensor(values, scales, None, 8, "int8")


def format_for(q: QuantizedTensor) -> QuantFormat:
    """The packed format a checkpoint's quantized tensor goes into as it is."""
    if q.bits == 8 and q.offsets is None:
        return FORMATS["int8"] if q.scales.shape[1] == 1 else FORMATS["q8_0"]
    return FORMATS["q4"]


def pack(q: QuantizedTensor, fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(words [N, K / group, 8] float32 bit patterns, scales [N, S], offsets or
    None), the scales and offsets in ``fmt.scale_dtype``: GGUF's blocks hold
    fp16 already, and Q4_0's offsets ``-8 * scale`` are fp16 too unless they
    overflow it, which is refused."""
    n, k = q.values.shape
    if k % fmt.group:
        raise ValueError(f"row length {k} is not a multiple of {fmt.group} ({fmt.name} packing)")
    scales, offsets = (t.to(fmt.scale_dtype).contiguous() if t is not None else None for t in (q.scales, q.offsets))
    for name, t in (("scales", scales), ("offsets", offsets)):
        if t is not None and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{q.source} {name}: a value is not finite in {fmt.scale_dtype} ({fmt.name} packing)")
    per = 32 // fmt.bits  # integers per word
    v = q.values.to(torch.int32) & ((1 << fmt.bits) - 1)
    v = v.view(n, k // fmt.group, per, 8)
    words = torch.zeros(n, k // fmt.group, 8, dtype=torch.int32)
    for b in range(per):
        words |= v[:, :, b, :] << (fmt.bits * b)
    return words.view(torch.float32), scales, offsets


# The functions below are written with torch functions, operators and aten ops
# only, no tensor methods: the compiler records them into traced graphs through
# proxies (``kiln.compiler.gemv``), and AOTAutograd's cache accepts a method call
# only on a node that carries an example value, which recorded nodes lack.
def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.ops.prims.convert_element_type.default(x, dtype)


def _lanes(words: torch.Tensor, fmt: QuantFormat) -> list[torch.Tensor]:
    """The integers of ``words`` as float32, one ``[N, G, 8]`` tensor per byte or
    nibble position (elements ``8b .. 8b + 7`` of each group)."""
    p = torch.ops.aten.view.dtype(words, torch.int32)
    if fmt.bits == 8:  # sign-extend each byte: shift it to the top, then arithmetically back
        return [_cast((p << (24 - 8 * b)) >> 24, torch.float32) for b in range(4)]
    return [_cast((p >> (4 * b)) & 15, torch.float32) for b in range(8)]


def _total(terms: Iterable[torch.Tensor]) -> torch.Tensor:
    return functools.reduce(operator.add, terms)


def dequantize(words: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
               fmt: QuantFormat, shape: tuple[int, int] | None = None) -> torch.Tensor:
    """The ``[N, K]`` float32 weight the packed tensors hold. ``shape``: the
    words' ``(N, K / group)``, for callers tracing with proxies (default: read
    from ``words``)."""
    n, g = shape or tuple(words.shape[:2])
    lanes = torch.stack(_lanes(words, fmt), 2)  # [N, G, per, 8]
    if fmt.block is None:
        return torch.reshape(lanes, (n, -1)) * torch.reshape(scales, (n, 1))
    per_scale = fmt.block // 8  # lanes per scale
    w = torch.reshape(lanes, (n, g, -1, per_scale, 8)) * torch.reshape(scales, (n, g, -1, 1, 1))
    if offsets is not None:
        w = w + torch.reshape(offsets, (n, g, -1, 1, 1))
    return torch.reshape(w, (n, -1))


def round_activations(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x [..., k]`` as float32, rounded to int8 per ``ACTIVATION_BLOCK``
    elements: ``d = max|x| / 127`` and ``q = round(x * (1 / d))`` (half to
    even, in -127..127; 0 where the block is all zeros), giving ``q * d``.
    ``kiln_linear`` in ``cpu_linear.c`` rounds the same way, in the same fp32
    operations. ``k``: ``x``'s last size (a multiple of the block), passed in
    for callers tracing with proxies."""
    blocks = torch.unflatten(_cast(x, torch.float32), -1, (k // ACTIVATION_BLOCK, ACTIVATION_BLOCK))
    scale = torch.amax(torch.abs(blocks), -1, True) / 127.0
    inverse = torch.where(scale > 0, torch.reciprocal(scale), 0.0)
    q = torch.clamp(torch.round(blocks * inverse), -127.0, 127.0)
    return torch.flatten(q * scale, -2)


def reduction(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
              fmt: QuantFormat, shape: tuple[int, int] | None = None) -> torch.Tensor:
    """``x [S, K] @ weight.T`` in float32 as one reduction over K that unpacks
    as it goes (the form Inductor fuses into a single loop). ``shape`` as for
    ``dequantize``."""
    n, g = shape or tuple(words.shape[:2])
    lanes = _lanes(words, fmt)
    xv = torch.reshape(_cast(x, torch.float32), (-1, 1, g, len(lanes), 8))
    if fmt.block is None:
        acc = _total(xv[:, :, :, b, :] * lanes[b] for b in range(len(lanes)))
        return torch.sum(acc, (-1, -2)) * torch.reshape(scales, (n,))
    per_scale = fmt.block // 8
    d = torch.reshape(scales, (n, g, -1, 1))
    m = torch.reshape(offsets, (n, g, -1, 1)) if offsets is not None else None
    total = None
    for j in range(len(lanes) // per_scale):  # each 32-element block of the group
        part = range(j * per_scale, (j + 1) * per_scale)
        term = _total(xv[:, :, :, b, :] * lanes[b] for b in part) * d[:, :, j]
        if m is not None:
            term = term + _total(xv[:, :, :, b, :] for b in part) * m[:, :, j]
        total = term if total is None else total + term
    return torch.sum(total, (-1, -2))


def packed_linear(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                  bias: torch.Tensor | None, fmt: QuantFormat, *, as_reduction: bool,
                  shape: tuple[int, int] | None = None, dtype: torch.dtype | None = None,
                  linear: Callable[..., torch.Tensor] = F.linear) -> torch.Tensor:
    """The packed layer's output in ``dtype`` (default ``x``'s), its input
    first rounded where ``fmt`` says (``round_activations``): by the unpacking
    reduction, or by ``linear`` (``(x, weight, bias)``, ``F.linear``'s
    arguments) over the dequantized weight."""
    dtype = dtype or x.dtype
    if fmt.round_activations:
        _, g = shape or tuple(words.shape[:2])
        x = round_activations(x, g * fmt.group)
    if as_reduction:
        out = _cast(reduction(x, words, scales, offsets, fmt, shape), dtype)
        return out + bias if bias is not None else out
    if fmt.round_activations:
        x = _cast(x, dtype)
    return linear(x, _cast(dequantize(words, scales, offsets, fmt, shape), dtype), bias)


# ----------------------------------------------------------------------------- the op
def _linear_impl(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                 bias: torch.Tensor | None, fmt: str) -> torch.Tensor:
    return packed_linear(x, words, scales, offsets, bias, FORMATS[fmt], as_reduction=False)


def _linear_fake(x, words, scales, offsets, bias, fmt):  # noqa: ANN001, ANN202
    return x.new_empty(*x.shape[:-1], words.shape[0])


_LIB = torch.library.Library("kiln", "FRAGMENT")
_LIB.define("quantized_linear(Tensor x, Tensor words, Tensor scales, Tensor? offsets, Tensor? bias, str fmt) -> Tensor")
for _key in ("CPU", "CUDA"):
    _LIB.impl("quantized_linear", _linear_impl, _key)
torch.library.register_fake("kiln::quantized_linear", _linear_fake, lib=_LIB)
quantized_linear = torch.ops.kiln.quantized_linear


class QuantizedLinear(nn.Module):
    """A linear layer whose weight is packed (``FORMATS``), holding one or
    several checkpoint projections side by side like ``MergedLinear``. The
    packed tensors are buffers: they keep their dtype whatever the model's."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, fmt: QuantFormat) -> None:
        super().__init__()
        if in_features % fmt.k_multiple():
            raise ValueError(f"in_features {in_features} is not a multiple of {fmt.k_multiple()} ({fmt.name})")
        self.in_features, self.out_features = in_features, sum(output_sizes)
        self.output_sizes = list(output_sizes)
        self.fmt = fmt
        n, k = self.out_features, in_features
        self.register_buffer("words", torch.empty(n, k // fmt.group, 8))
        self.register_buffer("scales", torch.empty(n, k // fmt.block if fmt.block else 1, dtype=fmt.scale_dtype))
        self.register_buffer("offsets", torch.empty(n, k // fmt.block, dtype=fmt.scale_dtype) if fmt.has_offsets
                             else None)
        self.bias = nn.Parameter(torch.empty(n)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return quantized_linear(x, self.words, self.scales, self.offsets, self.bias, self.fmt.name)
        return _linear_impl(x, self.words, self.scales, self.offsets, self.bias, self.fmt.name)

    def packed(self) -> list[torch.Tensor]:
        """The tensors the compiled code reads: words, scales (and offsets)."""
        return [t for t in (self.words, self.scales, self.offsets) if t is not None]

    def shard(self, param: torch.Tensor, index: int) -> torch.Tensor:
        """The rows of ``param`` (the bias) that projection ``index`` fills."""
        start = sum(self.output_sizes[:index])
        return param.narrow(0, start, self.output_sizes[index])

    @torch.no_grad()
    def load(self, index: int | None, q: QuantizedTensor, source: str) -> None:
        """Pack ``q`` into the rows of projection ``index`` (None: all rows).
        ``source`` names the file and tensor in errors."""
        start = sum(self.output_sizes[:index]) if index is not None else 0
        rows = self.output_sizes[index] if index is not None else self.out_features
        if tuple(q.values.shape) != (rows, self.in_features):
            raise CheckpointError(f"{source} has shape {tuple(q.values.shape)}, "
                                  f"expected {(rows, self.in_features)} from the checkpoint's config")
        if format_for(q).packing != self.fmt.packing:
            raise CheckpointError(f"{source} is stored as {q.source}, which packs as {format_for(q).name}, "
                                  f"but its layer was planned as {self.fmt.packing}")
        try:
            words, scales, offsets = pack(q, self.fmt)
        except ValueError as e:
            raise CheckpointError(f"{source}: {e}") from e
        self.words[start:start + rows].copy_(words)
        self.scales[start:start + rows].copy_(scales)
        if self.offsets is not None and offsets is not None:
            self.offsets[start:start + rows].copy_(offsets)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt.name}"


def packed_layers(model: nn.Module) -> dict[str, int]:
    """How many packed layers ``model`` has, per format (for reports)."""
    counts = Counter(m.fmt.name for m in model.modules() if isinstance(m, QuantizedLinear))
    return dict(sorted(counts.items()))
