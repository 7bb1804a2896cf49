"""The gated MLP's activation on CPU as one C loop: ``kiln::silu_mul``.

Llama, Mistral and Qwen compute ``down(silu(gate) * up)``, with gate and up
one merged product whose halves ``chunk`` splits (kiln.models.decoder). Where
that product is an extern call (kiln's C linear or oneDNN), Inductor has no
loop to fuse the activation into and emits a kernel of its own for it, which
runs Sleef's exponential and a true division: about 52 us a layer of 64 rows
of the 135M shape in bf16 (perf, 2 threads of an Intel Xeon, 2026-12-06).
``kiln_silu_mul`` (kiln/compiler/cpu_linear.c) computes the same with a
polynomial exponential and a refined reciprocal. ``python -m bench.cpu_kernels
--only silu-mul`` on [rows, 2 x 1536], 2 threads of that Xeon, the kernel's
method against Inductor's compiled function, each with its Python call
(bench/results/silu-mul-cpu-20261206-043253.json): bf16 at 64 rows 27.3 us
against 55.6, at 512 rows 180 against 292; fp32 22.4 against 43.1 and 201
against 268. In an engine (64 requests of 96 prompt tokens, bf16, taking
turns with the commit before, scratch runs) a decode step took 39.2-41.0 ms
against 40.2-41.9 and the prefill of the 64 prompts 618-725 ms against
653-766; ``perf`` then put 2.6% of a step's samples in the loop.

So on CPU, where an entry has the C linear kernel (the compiler rewrites only
then: ``kiln.compiler.pipeline._activations``), ``mul(silu(chunk(t)[0]),
chunk(t)[1])`` with ``t`` made by one of kiln's linear ops becomes
``kiln::silu_mul(t)``; exported code calls the op's
implementation directly (``kiln.compiler.replay``) and a CPU call graph
records the kernel's call (``CpuLinearKernel.native_sites``). Its fp32 results
are within 2.4e-7 of the exact activation, relative, where Inductor's are
within 1.8e-7 (the same benchmark); bf16 is rounded once, as Inductor does.
"""

from __future__ import annotations

import copy
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from kiln.compiler import cpu_linear, onednn

__all__ = ["implementation", "rewrite_silu_mul", "silu_mul"]


def implementation(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x [..., 2 I]`` holding gate, then up: the
    loaded C kernel's loop (``CpuLinearKernel.silu_mul``), else torch's
    (exported code calls it directly, ``kiln.compiler.replay``)."""
    kernel = cpu_linear.current()
    out = kernel.silu_mul(x) if kernel is not None else None
    if out is not None:
        return out
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _fake(x):  # noqa: ANN001, ANN202
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


# A torch.library op, not @custom_op, for the dispatcher's cost (kiln.compiler.onednn)
_LIB = torch.library.Library("kiln", "FRAGMENT")
_LIB.define("silu_mul(Tensor x) -> Tensor")
_LIB.impl("silu_mul", implementation, "CPU")
torch.library.register_fake("kiln::silu_mul", _fake, lib=_LIB)
silu_mul: Any = torch.ops.kiln.silu_mul.default

# the ops whose output Inductor cannot fuse an activation into
_EXTERN_LINEARS = (cpu_linear.cpu_linear, onednn.onednn_linear)


def _example(node: Any) -> torch.Tensor | None:
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _is_chunk_half(node: Any, index: int) -> fx.Node | None:
    """The ``chunk(t, 2, dim=-1)`` node whose ``index``-th half ``node`` is, or None."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem
            and node.args[1] == index):
        return None
    chunk = node.args[0]
    if not isinstance(chunk, fx.Node):
        return None
    if not ((chunk.op == "call_method" and chunk.target == "chunk")
            or (chunk.op == "call_function" and chunk.target is torch.chunk)):
        return None
    args = list(chunk.args[1:]) + [chunk.kwargs[k] for k in ("chunks", "dim") if k in chunk.kwargs]
    t = _example(chunk.args[0])
    if len(args) != 2 or args[0] != 2 or t is None or args[1] not in (-1, t.dim() - 1):
        return None
    return chunk


def _match(node: fx.Node) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """For ``mul(silu(gate), up)`` (either order) with gate and up the halves
    of one ``chunk`` of an extern linear's output (``_EXTERN_LINEARS``) of a
    dtype the C loop takes (``cpu_linear.FLOAT_DTYPES``) on CPU, whose silu
    and halves serve nothing else: (the linear's output, the chunk, the nodes
    the op replaces besides ``node``)."""
    if not (node.op == "call_function" and node.target in (operator.mul, torch.mul) and len(node.args) == 2
            and not node.kwargs):
        return None
    for act, up in (node.args, node.args[::-1]):
        if not (isinstance(act, fx.Node) and act.op == "call_function" and act.target is F.silu
                and len(act.args) == 1 and not act.kwargs.get("inplace", False)):
            continue
        chunk = _is_chunk_half(act.args[0], 0)
        if chunk is None or _is_chunk_half(up, 1) is not chunk:
            continue
        gate = act.args[0]
        t = chunk.args[0]
        value = _example(t)
        if not (isinstance(t, fx.Node) and t.op == "call_function" and t.target in _EXTERN_LINEARS
                and value is not None and value.dtype in cpu_linear.FLOAT_DTYPES and value.device.type == "cpu"):
            continue
        if len(act.users) != 1 or len(gate.users) != 1 or len(up.users) != 1 or len(chunk.users) != 2:
            continue
        return t, chunk, [act, gate, up]
    return None


def rewrite_silu_mul(gm: fx.GraphModule) -> tuple[fx.GraphModule, int]:
    """A copy of ``gm`` whose SiLU-times-up activations (``_match``) call
    ``kiln::silu_mul``, and how many were rewritten (``gm`` itself when none
    is). Only for pieces whose C kernel is loaded when they run: without it
    the op falls back to torch's two kernels."""
    if not any(_match(node) for node in gm.graph.nodes):
        return gm, 0
    graph = copy.deepcopy(gm.graph)  # node by node; metadata is shared, not copied
    rewritten = 0
    for node in list(graph.nodes):
        found = _match(node)
        if found is None:
            continue
        t, chunk, replaced = found
        with graph.inserting_before(node):
            call = graph.call_function(silu_mul, (t,))
        call.meta = node.meta
        node.replace_all_uses_with(call)
        graph.erase_node(node)
        for dead in (*replaced, chunk):
            if not dead.users:
                graph.erase_node(dead)
        rewritten += 1
    new = fx.GraphModule(gm, graph)
    new.recompile()
    return new, rewritten
