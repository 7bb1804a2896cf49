"""Many-row linears through oneDNN, or on kiln's C kernel: bf16 on AMX tiles, fp32 as panels (CPU).

Above a few tokens a linear layer is a matrix product with enough rows to be
bound by arithmetic, not by reading the weight. ``F.linear`` (and the ``mm``
and ``addmm`` Inductor emits for it) runs MKL's sgemm; oneDNN's matrix product
(``torch.ops.mkldnn._linear_pointwise``) ran 0.9-1.5x as fast on the 135M
shape's layer weights at 16, 64 and 512 rows, and 1.6-2.0x on its 49152-row
LM head, with the weight passed as it is, which oneDNN then reorders into its
blocked layout on every call; with the weight reordered once, 1.1-1.6x on the
layers and 1.7-2.9x on the head (2 threads of an AMD EPYC, ``python -m
bench.cpu_kernels --only many-rows``,
bench/results/many-rows-cpu-20261203-150825.json). Whole decode steps of 64
requests took 130-143 ms with reordered weights against 197-211 ms without,
and 54-58 against 75-80 ms at 16 requests (one scratch run, each figure a
mean of 8 steps). In bf16 ``F.linear`` already runs oneDNN, on the weight
as it is; reordered once it ran 1.3-1.9x as fast at 16 rows, 1.2-1.35x at
64 and level at 512 (one scratch run of the same cases), with the same bits.

So on CPU, where torch has oneDNN, the fp32 and bf16 linears of the pieces
that run more than a few tokens (the range piece and exact sizes above
``CPU_GEMV_MAX_TOKENS``) become calls of ``kiln::onednn_linear``, so do
their packed (quantized) linears, on the dequantized weight as it is
(``kiln.compiler.gemv.lower_quantized``), and so does
a dense fp32 or bf16 LM head of more rows than the C linear kernel takes
(``CpuLinearKernel.max_rows``; more than ``CPU_GEMV_MAX_TOKENS`` without it).
Left to Inductor, a bf16 linear is an ``mm`` on the weight as it is, which
oneDNN repacks for AMX on every call: the 135M shape's 30 layers of linears
at 64 rows took 38-40 ms that way against 25 ms on reordered weights, and
routed to the op, a 64-request bf16 decode step went from 63-66 to 59-60 ms
and a 512-token bf16 prefill from 2575-2595 to 2745-2784 tok/s (2 cores of
an Intel Xeon with AMX, scratch A/B runs taking turns, 2026-12-05;
bench/results/step-linears-cpu-*.json for the reordered figures). An
earlier version left bf16 to Inductor because the bf16 test model's
compiled pieces then left the eager model's greedy tokens at the second
token of a 5-token prompt: there eager's two best log-probabilities are
equal (-2.6717 both), and the test now accepts either token at such a tie
(tests/test_models.py::test_bf16_compiled_pieces_give_the_eager_tokens).

Where the CPU has AMX tiles and kiln's C kernel is built with them
(``CpuLinearKernel.amx``), the op hands its bf16 linears of up to
``AMX_MAX_ROWS`` rows to that kernel instead (``kiln_amx_linear`` in
kiln/compiler/cpu_linear.c), on the weights laid out as its tiles by
``prepack``: oneDNN's fixed cost per call is larger than the arithmetic of a
small model's layer. The linears of a decode step of the 135M shape, weights
read from memory, took 15.2-16.1 ms against oneDNN's 22.9-23.3 at 16 rows
and 22.4-23.9 against 29.9-30.9 at 64 (2 threads of an Intel Xeon, scratch
runs, 2026-12-05). 64 requests of ``python -m bench.decode --throughput 64
--dtype bfloat16``, one run after the other: a decode step 62.2 -> 47.8 ms,
633.6 -> 824.8 output tok/s, 3.01x -> 3.88x transformers
(bench/results/decode-throughput-cpu-20261205-091908.json and the run after
it). The tiles give a row the same bits whatever it is batched with.

Where kiln's C kernel is built with AVX-512 (``CpuLinearKernel.panels``), the
op hands its fp32 linears, at any number of rows, to that kernel's panels
(``kiln_panels_linear``), on the weights laid out once by ``prepack``: outer
products of 8 rows by 48 columns in registers, each thread asking for its
next panel's weights while it computes the current one, where oneDNN read
its reordered weights and computed in turn. The linears of a decode step of
the 135M shape, weights read from memory, took 22.6-23.0 ms against oneDNN's
31.5-31.9 at 16 rows, 48.7-50.0 against 67.9-71.4 at 64, and 347 against
352-367 at 512 (2 threads of an Intel Xeon, scratch runs, 2026-12-07). With
the LM head, in ``python -m bench.cpu_kernels --only step-linears``
(bench/results/step-linears-cpu-20261207-045821.json, a slower hour): 32.6,
36.3, 47.3 and 63.2 ms at 16, 32, 48 and 64 rows against oneDNN's 39.1,
59.7, 76.9 and 79.5. Its calls are native ones a CPU call graph records, so
fp32 decode steps of more than 16 requests are captured too
(``kiln.config``). 64 requests of ``python -m bench.decode --throughput 64
--dtype float32``, two rounds taking turns with the commit before: 352.6 ->
404.9 and 360.7 -> 437.7 output tok/s, 2.60x -> 3.07x and 2.74x -> 3.32x
transformers (bench/results/decode-throughput-cpu-20261207-045000.json,
-044632, -050205, -050531). ``prepack`` also tells each panels layout the
next one's in module order (``KernelWeight.ahead``), so that a call's last
panel asks for the next call's first: with the asks spread evenly over a
panel's steps, a decode step of 64 fp32 requests took 57.4-58.9 ms against
63.2-66.1 (16 requests: 22.1-24.2 against 24.2-26.1; scratch runs taking
turns, 2026-12-07).

Where oneDNN has no bf16 kernels for the CPU (AVX2 without AVX-512), torch's
bf16 linear runs an emulation: on 2 cores of a Zen 3 EPYC, 512 rows of the
135M shape's 576 -> 1536 layer took 52 ms, its fp32 product 5.8, and the fp32
product of the operands widened to fp32 on the call 6.4 (the same bits up to
the order of the sums); 8.1x at 512 rows, 4.9x at 64, 3.4x at 16 (scratch
timings, 2026-12-04). There the bf16 linears of the many-row pieces take
this op too (``WIDENED``): their input, weight and bias are widened to fp32
for the product, which is rounded to bf16 once, as the few-token pieces' C
kernel does. The widened weights are not kept: a copy per call costs a
pass over the weight, against holding every weight three times.

The fp32 and natively computed bf16 weights that no kernel of kiln's lays
out are reordered when the compiled pieces are loaded, in a thread of their
own (``prepack``), and each copy kept while its weight lives: the linear
weights are then held twice, as they are for the few-token pieces
(``kiln.compiler.cpu_linear``, faster there) and reordered or laid out
(``reordered_weight_bytes`` in the startup report). The reordered weight
gives the same result, bit for bit, so the op takes a weight as it is until
its copy is there; a kernel's layout does not, so it is made before the
pieces run (``prepack``).

Inductor lowers ``mkldnn._linear_pointwise`` only for weights frozen into the
graph as constants; kiln's weights are graph inputs (a compiled entry holds no
weights), so the call is wrapped in an op of kiln's own, which Inductor keeps
as an opaque extern call and exported code calls directly
(``kiln.compiler.replay``). The residual add that ``addmm`` used to absorb is
fused by Inductor into the following normalisation instead.
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from kiln.compiler.cpu_linear import CpuLinearKernel, PanelsAhead
from kiln.models.memory import lowest_priority

__all__ = ["AMX_MAX_ROWS", "DTYPES", "KernelWeight", "REWRITE_DTYPES", "WIDENED", "available", "implementation",
           "kernel_weight", "on_panels", "onednn_linear", "packed", "packed_bytes", "prepack", "qualifies",
           "rewrite_linears", "takes"]


def available(device: torch.device) -> bool:
    """Whether linears on ``device`` go through oneDNN: a CPU, and a torch
    built with it."""
    return device.type == "cpu" and torch.backends.mkldnn.is_available()


def _dtypes() -> frozenset[torch.dtype]:
    # bf16 where oneDNN has bf16 kernels for this CPU (AVX-512 BW/VL/DQ and up),
    # not an emulation of them
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return frozenset({torch.float32, torch.bfloat16})
    return frozenset({torch.float32})


DTYPES = _dtypes()
# dtypes the op computes in fp32, its operands widened on each call, where
# oneDNN has no kernels for them (see above)
WIDENED = frozenset({torch.bfloat16}) - DTYPES
# what ``rewrite_linears`` routes to the op inside compiled pieces
REWRITE_DTYPES = DTYPES | WIDENED


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the op computes ``linear(x, weight)``: both on CPU, of one of
    ``DTYPES`` or ``WIDENED``."""
    return (x.dtype == weight.dtype and (x.dtype in DTYPES or x.dtype in WIDENED)
            and x.device.type == "cpu" and weight.device.type == "cpu")


def _reorderable(weight: torch.Tensor) -> bool:
    """Whether ``prepack`` keeps a reordered copy of ``weight``: a 2-D CPU
    weight of a dtype oneDNN computes as it is (not a widened one)."""
    return weight.dim() == 2 and weight.dtype in DTYPES and weight.device.type == "cpu"


# The rows oneDNN is told to expect when it picks a weight's blocked layout;
# the layout it picked for 1, 16, 64, 256 and 1024 gave the same bits at any
# number of rows.
PACK_ROWS = 64

# (data pointer, shape, strides) of a weight -> its reordered copy. An entry
# leaves when the weight's storage is freed (a finalizer on the storage,
# whose Python object torch keeps while the storage lives), so a new tensor
# at the same address never finds a stale copy. Weights are read-only once
# served: a copy is not refreshed if one is written in place.
_PACKED: dict[tuple[int, tuple[int, ...], tuple[int, ...]], torch.Tensor | AmxWeight] = {}


# The most rows a bf16 linear runs on the AMX tiles of kiln's C kernel; oneDNN
# takes more. Each layer weight of the 135M shape, 6 of them in turn, 2 threads
# of an Intel Xeon, us a call (tiles against oneDNN on reordered weights):
# 64 rows 77-119 against 180-528, 512 rows 406-1285 against 427-1253, 2048 rows
# 1422-5159 against 1466-3905 (scratch timings, 2026-12-05): from there the
# product is bound by arithmetic, which oneDNN's blocking does better.
AMX_MAX_ROWS = 512


@dataclass(frozen=True)
class KernelWeight:
    """A weight laid out for one of kiln's C kernels, which then computes the
    op in its place: a bf16 weight as AMX tiles (``CpuLinearKernel.amx_tiles``)
    up to ``AMX_MAX_ROWS`` rows, an fp32 one as panels
    (``CpuLinearKernel.f32_panels``) at any number of rows."""

    linear: Callable[..., torch.Tensor]  # the kernel's call: (x, layout, rows, bias[, ahead])
    layout: torch.Tensor
    rows: int  # the weight's N
    max_rows: int | None  # the most activation rows the kernel takes (None: any); oneDNN takes more
    ahead: PanelsAhead | None = None  # panels: the next linear's, asked for during this one's last (prepack)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether the kernel computes ``x``'s product (its rows within ``max_rows``)."""
        return self.max_rows is None or x.numel() <= self.max_rows * x.shape[-1]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.ahead is None:
            return self.linear(x, self.layout, self.rows, bias)
        return self.linear(x, self.layout, self.rows, bias, self.ahead)


def kernel_weight(weight: torch.Tensor, kernel: CpuLinearKernel | None) -> KernelWeight | None:
    """``weight`` laid out for ``kernel``: its AMX tiles (bf16, where it has
    them and was built for bf16 linears), else its fp32 panels (where it has them); None where it takes
    neither."""
    if kernel is None:
        return None
    tiles = kernel.amx_tiles(weight) if "bf16" in kernel.kinds else None
    if tiles is not None:
        return KernelWeight(kernel.amx_linear, tiles, weight.shape[0], AMX_MAX_ROWS)
    panels = kernel.f32_panels(weight)
    if panels is not None:
        return KernelWeight(kernel.panels_linear, panels, weight.shape[0], None)
    return None


def packed(weight: torch.Tensor, kernel: CpuLinearKernel | None = None) -> torch.Tensor | KernelWeight:
    """``weight``'s copy for the op, made on the first call and kept while the
    weight's storage lives: laid out for ``kernel`` where it takes the
    weight (``kernel_weight``), else reordered into oneDNN's blocked layout."""
    copy_ = _PACKED.get(_key(weight))
    if copy_ is None:
        copy_ = kernel_weight(weight, kernel)
        if copy_ is None:
            copy_ = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS)
        _keep(weight, copy_)
    return copy_


def on_panels(weight: torch.Tensor, kernel: CpuLinearKernel) -> bool:
    """Whether ``implementation`` computes ``weight``'s products on ``kernel``'s fp32 panels."""
    copy_ = _PACKED.get(_key(weight))
    return isinstance(copy_, KernelWeight) and copy_.linear == kernel.panels_linear


def _keep(weight: torch.Tensor, copy_: torch.Tensor | KernelWeight) -> None:
    """Hold ``copy_`` for ``weight`` until the weight's storage is freed."""
    key = _key(weight)
    _PACKED[key] = copy_
    weakref.finalize(weight.untyped_storage(), _PACKED.pop, key, None)


def _key(weight: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    return weight.data_ptr(), tuple(weight.shape), tuple(weight.stride())


def prepack(weights: Iterable[torch.Tensor], *, background: bool = False, kernel: CpuLinearKernel | None = None,
            ) -> tuple[int, threading.Thread | None]:
    """Make the copies of those of ``weights`` the op takes as they are
    (``_reorderable``); returns the bytes the copies take (a weight listed
    twice, as a tied LM head is, counted once) and, with ``background``, the
    thread making oneDNN's, at the lowest CPU priority: the op uses each
    weight as it is until its copy is there, with the same result, so a start
    need not wait the 0.3 s the 135M shape's fp32 weights take. The layouts
    of ``kernel`` (``kernel_weight``: bf16 weights as AMX tiles, fp32 ones as
    panels) are made before this returns: the kernel's sums and oneDNN's
    round some outputs differently, and a request's tokens should not depend
    on when a thread got to its weights. They are a reordering at about the
    speed of memory (the 135M shape's 269 MB of bf16 tiles: about 0.05 s
    here; its 538 MB of fp32 panels, the tied head's included: 0.09-0.10 s
    with 2 threads, on memory already touched)."""
    unique = {_key(w): w for w in weights if _reorderable(w)}
    todo = list(unique.values())
    nbytes = sum(w.numel() * w.element_size() for w in todo)
    laid: list[tuple[torch.Tensor, KernelWeight]] = []
    for w in todo:  # the kernel's layouts now; oneDNN's copies of the rest below
        laid_out = kernel_weight(w, kernel) if _key(w) not in _PACKED else None
        if laid_out is not None:
            laid.append((w, laid_out))
    for w, laid_out in _chained(laid, kernel):
        _keep(w, laid_out)
    todo = [w for w in todo if _key(w) not in _PACKED]

    def run() -> None:
        if background:
            lowest_priority()
        for w in todo:
            packed(w, kernel)

    if not background:
        run()
        return nbytes, None
    # not a daemon: an interpreter shutting down must not stop it inside a torch op
    thread = threading.Thread(target=run, name="kiln-reorder-weights")
    thread.start()
    return nbytes, thread


def _chained(laid: list[tuple[torch.Tensor, KernelWeight]], kernel: CpuLinearKernel | None,
             ) -> list[tuple[torch.Tensor, KernelWeight]]:
    """``laid`` with each fp32 panels layout told the next one's (``ahead``):
    weights come in the model's module order, which is the order a step of
    the families kiln builds calls them (a layer's attention projections,
    then its MLP's, then the next layer's), so each call can ask for the
    next one's first panels; an order that differs costs only those reads."""
    panels = [(w, kw) for w, kw in laid if kernel is not None and kw.linear == kernel.panels_linear]
    following = {id(kw): PanelsAhead(nkw.layout, nw.shape[0], nw.shape[1])
                 for (_, kw), (nw, nkw) in zip(panels, panels[1:])}
    return [(w, replace(kw, ahead=following[id(kw)]) if id(kw) in following else kw) for w, kw in laid]


def packed_bytes() -> int:
    """Bytes held by the copies (reordered, or laid out for a kernel) of the weights alive in this process."""
    copies = [c.layout if isinstance(c, KernelWeight) else c for c in _PACKED.values()]
    return sum(c.numel() * c.element_size() for c in copies)


def implementation(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by oneDNN, on ``weight``'s reordered copy
    where ``prepack`` made one, else on ``weight`` as it is; a ``WIDENED``
    dtype's operands widened to fp32 and the product rounded back once
    (exported code calls it directly, ``kiln.compiler.replay``)."""
    if x.dtype in WIDENED:
        wide = torch.ops.mkldnn._linear_pointwise(x.float().contiguous(), weight.float(),
                                                  None if bias is None else bias.float(), "none", [], "")
        return wide.to(x.dtype)
    copy_ = _PACKED.get(_key(weight))
    if isinstance(copy_, KernelWeight):
        if copy_.takes(x):
            return copy_(x, bias)
        copy_ = None  # oneDNN, on the weight as it is
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight if copy_ is None else copy_, bias, "none", [],
                                              "")


def _fake(x, weight, bias):  # noqa: ANN001, ANN202
    return x.new_empty(*x.shape[:-1], weight.shape[0])


# A torch.library op, not @custom_op: the dispatcher's trip costs about 4 us a
# call against 32 (bench/results/op-overhead-cpu-latest.json).
_LIB = torch.library.Library("kiln", "FRAGMENT")
_LIB.define("onednn_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIB.impl("onednn_linear", implementation, "CPU")
torch.library.register_fake("kiln::onednn_linear", _fake, lib=_LIB)
onednn_linear: Any = torch.ops.kiln.onednn_linear.default


def _is_dense_linear(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (torch._C._nn.linear, F.linear)


def _example(node: Any) -> torch.Tensor | None:
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def qualifies(node: fx.Node, dtypes: frozenset[torch.dtype] = REWRITE_DTYPES) -> bool:
    """Whether ``rewrite_linears`` makes ``node`` a call of the op: a dense
    linear of a parameter whose recorded input is of ``dtypes`` (within
    ``REWRITE_DTYPES``), which the op takes."""
    if not _is_dense_linear(node):
        return False
    x, weight = node.args[:2]
    if not isinstance(weight, fx.Node) or weight.op != "placeholder":  # a parameter, kept reordered
        return False
    x, weight = _example(x), _example(weight)
    return (x is not None and weight is not None and takes(x, weight) and x.dtype in REWRITE_DTYPES
            and x.dtype in dtypes)


def rewrite_linears(gm: fx.GraphModule, dtypes: frozenset[torch.dtype] = REWRITE_DTYPES,
                    ) -> tuple[fx.GraphModule, int]:
    """A copy of ``gm`` whose fp32 (and ``WIDENED``) CPU linears call
    ``kiln::onednn_linear``, and how many were rewritten (``gm`` itself when
    none is). A linear qualifies (``qualifies``) when its weight is an input
    of the graph (a parameter, which lives as long as the model) and the
    trace recorded its input and weight as tensors of ``REWRITE_DTYPES`` (of
    those, ``dtypes``) the op takes (``takes``); packed linears lowered to
    ``dequantize`` + ``linear`` keep ``linear``."""
    if not any(qualifies(node, dtypes) for node in gm.graph.nodes):
        return gm, 0
    graph = copy.deepcopy(gm.graph)  # node by node; metadata is shared, not copied
    rewritten = 0
    for node in list(graph.nodes):
        if not qualifies(node, dtypes):
            continue
        x, weight = node.args[:2]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        with graph.inserting_before(node):
            call = graph.call_function(onednn_linear, (x, weight, bias))
        call.meta = node.meta
        node.replace_all_uses_with(call)
        graph.erase_node(node)
        rewritten += 1
    new = fx.GraphModule(gm, graph)
    new.recompile()
    return new, rewritten
