"""Small-batch linear layers as Inductor reductions (CPU).

At one to a few tokens a linear layer is a matrix-vector product bound by memory
bandwidth. The BLAS ``mm`` behind ``F.linear`` streams the weight at about half
of what the cores can, the reduction ``(x[:, None, :] * w).sum(-1)``, which
Inductor compiles to a vectorised loop split across threads, at close to all of
it (per weight shape of a 135M model, 2 threads:
bench/results/gemv-cpu-latest.json). So exact-size pieces at small token counts have their
``linear`` calls rewritten into that form before Inductor sees them.
The range runnable and larger sizes keep ``mm``, which wins once several rows
share each weight load. Where kiln's C linear kernel is built
(``kiln.compiler.cpu_linear``: AVX2 and FMA), the few-token pieces call it for
the linears it does better (``LinearPolicy``: bf16 and the packed formats at
any count, fp32 from two tokens on, since Inductor's reduction runs the rows
of a 2- or 4-token piece one after another, and from one token on in an
AVX-512 build, where the kernel also streams a single row's weights faster),
and it is the LM head, the largest matrix of a small model, which runs outside
the traced graph. Without the kernel, ``logits_head_graph`` is the head's
reduction form, compiled per number of sampled rows.

Packed (quantized) linears reach the compiler as ``kiln::quantized_linear`` ops
(``kiln.models.quant``). ``lower_quantized`` writes each as plain torch code
before Inductor sees it: the unpacking reduction in the few-token CPU pieces,
where Inductor fuses it into one loop over the packed words, and elsewhere the
dequantized weight (one fused kernel) feeding ``linear``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.proxy import GraphAppendingTracer

from kiln.compiler import onednn
from kiln.compiler.cpu_linear import LinearPolicy, cpu_linear, dense_kind
from kiln.models.quant import FORMATS, QuantFormat, packed_linear, quantized_linear

__all__ = ["CPU_GEMV_MAX_TOKENS", "decompose_linears", "kernel_takes_all", "logits_head_graph", "lower_quantized",
           "packed_head_graph"]

# Token counts up to which exact-size CPU pieces use the reduction form: at 1, 2
# and 4 tokens the reduction beat mm on the QKV, gate/up and LM-head weights of a
# 135M model and tied on the down projection (bench/results/gemv-cpu-latest.json).
CPU_GEMV_MAX_TOKENS = 4
_TILED_DTYPES = frozenset({torch.bfloat16})  # the dense linears a policy with AMX tiles sends to them


def decompose_linears(gm: fx.GraphModule, tokens: int, policy: LinearPolicy | None = None,
                      ) -> tuple[fx.GraphModule, int]:
    """A copy of ``gm`` (a piece of ``tokens`` rows) whose linears are written
    for few-token CPU pieces, and how many were rewritten. ``policy``: the C
    kernel's, when it is there: linears become its calls
    (``kiln::cpu_linear``) where it takes their kind at that count
    (``LinearPolicy.takes``), bf16 ones calls of ``kiln::onednn_linear``
    where it sends them to the AMX tiles (``LinearPolicy.to_tiles``), the rest
    as below;
    otherwise ``linear(x, w, b)`` as ``(x.unsqueeze(-2) * w).sum(-1) + b`` and
    packed linears as their unpacking reduction. ``gm`` itself is left as it
    is. The rewrite uses plain torch calls and ops, not a helper function, so
    that Inductor's caches can still serialise the piece."""
    tiled = 0
    if policy is not None and policy.to_tiles("bf16"):
        gm, tiled = onednn.rewrite_linears(gm, _TILED_DTYPES)
    graph = copy.deepcopy(gm.graph)  # node by node; metadata is shared, not copied
    rewritten = tiled + (_native_linears(graph, tokens, policy) if policy is not None else 0)
    rewritten += _lower_quantized_nodes(graph, as_reduction=True)
    for node in list(graph.nodes):
        if not _is_dense_linear(node):
            continue
        x, weight, bias = _linear_args(node)
        with graph.inserting_before(node):
            rows = graph.call_function(torch.unsqueeze, (x, -2))
            product = graph.call_function(torch.mul, (rows, weight))
            result = graph.call_function(torch.sum, (product, -1))
            if bias is not None:
                result = graph.call_function(torch.add, (result, bias))
        _replace(graph, node, result)
        rewritten += 1
    new = fx.GraphModule(gm, graph)
    new.recompile()
    return new, rewritten


def kernel_takes_all(gm: fx.GraphModule, tokens: int, policy: LinearPolicy) -> bool:
    """Whether ``decompose_linears(gm, tokens, policy)`` makes every linear of
    ``gm`` (dense or packed) a call of the C kernel or of the AMX tiles,
    leaving no reduction form, whose loops are written for one exact size."""
    linears = [n for n in gm.graph.nodes if _is_dense_linear(n) or _is_packed_linear(n)]
    tiled = policy.to_tiles("bf16")
    return all(_native_args(n, tokens, policy) is not None
               or (tiled and onednn.qualifies(n, _TILED_DTYPES)) for n in linears)


def _is_dense_linear(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (torch._C._nn.linear, torch.nn.functional.linear)


def _linear_args(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None]:
    args = list(node.args) + [None] * (3 - len(node.args))
    return args[0], node.kwargs.get("weight", args[1]), node.kwargs.get("bias", args[2])


def _replace(graph: fx.Graph, node: fx.Node, result: fx.Node) -> None:
    # Same value as the old node's: later method calls on it stay cacheable.
    result.meta.update({k: v for k, v in node.meta.items() if k == "example_value"})
    node.replace_all_uses_with(result)
    graph.erase_node(node)


def _dtype(node: object) -> torch.dtype | None:
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return value.dtype if isinstance(value, torch.Tensor) else None


def _native_linears(graph: fx.Graph, tokens: int, policy: LinearPolicy) -> int:
    """Replace the dense and packed linears the C kernel takes at ``tokens``
    rows by ``kiln::cpu_linear`` calls; returns how many."""
    count = 0
    for node in list(graph.nodes):
        args = _native_args(node, tokens, policy)
        if args is None:
            continue
        with graph.inserting_before(node):
            result = graph.call_function(cpu_linear, args)
        _replace(graph, node, result)
        count += 1
    return count


def _native_args(node: fx.Node, tokens: int, policy: LinearPolicy) -> tuple[object, ...] | None:
    """The op's arguments ``(x, weight, scales, offsets, bias, kind)`` for a
    linear node the kernel takes, else None."""
    if _is_dense_linear(node):
        x, weight, bias = _linear_args(node)
        kind = dense_kind(_dtype(x), _dtype(weight)) if _dtype(x) else None
        args: tuple[object, ...] = (x, weight, None, None, bias, kind)
    elif _is_packed_linear(node):
        x, words, scales, offsets, bias, kind = node.args
        if _dtype(x) not in (torch.float32, torch.bfloat16):
            return None
        args = (x, words, scales, offsets, bias, kind)
    else:
        return None
    if kind is None or not policy.takes(kind, tokens) or (bias is not None and _dtype(bias) != _dtype(x)):
        return None
    return args


def lower_quantized(gm: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """A copy of ``gm`` whose packed linears dequantize their weight for a
    dense product (``gm`` itself when it has none): on a CPU with oneDNN, an
    fp32 or bf16 one is ``kiln::onednn_linear``, whose weight is then the
    dequantized buffer as it is. MKL's sgemm behind ``linear`` took 8.9 ms for 512 rows
    by the 135M shape's gate/up weight, oneDNN 3.5 ms (2 threads of an AMD
    EPYC with AVX-512, scratch timing), and the demo model's 512-token
    prefill in Q8_0 went from 680-740 to 1260-1290 tok/s (llama.cpp's: 953,
    bench/results/llama-cpp-cpu-20261204-123235.json)."""
    if not any(_is_packed_linear(n) for n in gm.graph.nodes):
        return gm
    graph = copy.deepcopy(gm.graph)
    dense = onednn.onednn_linear if onednn.available(device) else None
    _lower_quantized_nodes(graph, as_reduction=False, dense=dense)
    new = fx.GraphModule(gm, graph)
    new.recompile()
    return new


def _is_packed_linear(node: fx.Node) -> bool:
    # Dynamo records the op packet; graphs built by hand may hold its overload
    return node.op == "call_function" and node.target in (quantized_linear, quantized_linear.default)


def _lower_quantized_nodes(graph: fx.Graph, as_reduction: bool, dense: Any = None) -> int:
    """Replace each ``kiln::quantized_linear`` node of ``graph`` by its torch
    form, recorded in place through proxies; returns how many. ``dense``: the
    product of a layer's dequantized weight in ``onednn.REWRITE_DTYPES``,
    in place of ``linear``."""
    tracer = GraphAppendingTracer(graph)
    lowered = 0
    for node in list(graph.nodes):
        if not _is_packed_linear(node):
            continue
        x, words, scales, offsets, bias, fmt_name = node.args
        fmt, dtype = FORMATS[fmt_name], node.meta["example_value"].dtype
        shape = tuple(words.meta["example_value"].shape[:2])
        proxy = [fx.Proxy(n, tracer) if isinstance(n, fx.Node) else None for n in (x, words, scales, offsets, bias)]
        linear = dense if dense is not None and dtype in onednn.REWRITE_DTYPES else F.linear
        with graph.inserting_before(node):
            _replace(graph, node, packed_linear(*proxy, fmt, as_reduction=as_reduction, shape=shape, dtype=dtype,
                                                linear=linear).node)
        lowered += 1
    return lowered


def packed_head_graph(fmt: QuantFormat, shape: tuple[int, int], dtype: torch.dtype) -> fx.GraphModule:
    """``(hidden [S, H], *packed) -> (logits [S, V],)`` for a packed LM head,
    as the unpacking reduction."""
    graph = fx.Graph()
    tracer = GraphAppendingTracer(graph)
    names = ["hidden", "words", "scales"] + (["offsets"] if fmt.has_offsets else [])
    proxy = {n: fx.Proxy(graph.placeholder(n), tracer) for n in names}
    out = packed_linear(proxy["hidden"], proxy["words"], proxy["scales"], proxy.get("offsets"), None, fmt,
                        as_reduction=True, shape=shape, dtype=dtype)
    graph.output((out.node,))
    return fx.GraphModule(torch.nn.Module(), graph)


# Unannotated on purpose: symbolic_trace copies annotations into the generated code,
# and Inductor's cache key cannot pickle the generic alias of the return type.
def _logits_head(hidden, weight):  # noqa: ANN001, ANN202
    return (torch.sum(torch.mul(torch.unsqueeze(hidden, -2), weight), -1),)


def logits_head_graph() -> fx.GraphModule:
    """``(hidden [S, H], weight [V, H]) -> (logits [S, V],)`` as a reduction,
    written with ``torch.*`` calls so that Inductor's caches can serialise it."""
    return fx.symbolic_trace(_logits_head)
