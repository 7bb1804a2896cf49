"""Small-batch linear layers as Inductor reductions (CPU).

At one to a few tokens a linear layer is a matrix-vector product bound by memory
bandwidth. The BLAS ``mm`` behind ``F.linear`` streams the weight at about half
of what the cores can, the reduction ``(x[:, None, :] * w).sum(-1)``, which
Inductor compiles to a vectorised loop split across threads, at close to all of
it (per weight shape of a 135M model, 2 threads:
bench/results/gemv-cpu-latest.json). So exact-size pieces at small token counts have their
``linear`` calls rewritten into that form before Inductor sees them.
The range runnable and larger sizes keep ``mm``, which wins once several rows
share each weight load. The LM head, the largest matrix of a small model, runs
outside the traced graph; ``logits_head_graph`` is its reduction form, compiled
per number of sampled rows.
"""

from __future__ import annotations

import copy

import torch
from torch import fx

__all__ = ["CPU_GEMV_MAX_TOKENS", "decompose_linears", "logits_head_graph"]

# Token counts up to which exact-size CPU pieces use the reduction form: at 1, 2
# and 4 tokens the reduction beat mm on the QKV, gate/up and LM-head weights of a
# 135M model and tied on the down projection (bench/results/gemv-cpu-latest.json).
CPU_GEMV_MAX_TOKENS = 4


def decompose_linears(gm: fx.GraphModule) -> tuple[fx.GraphModule, int]:
    """A copy of ``gm`` whose ``linear(x, w, b)`` calls are written as
    ``(x.unsqueeze(-2) * w).sum(-1) + b``, and how many were rewritten. ``gm``
    itself is left as it is. The rewrite uses plain torch calls, not a helper
    function, so that Inductor's caches can still serialise the piece."""
    graph = copy.deepcopy(gm.graph)  # node by node; metadata is shared, not copied
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (torch._C._nn.linear, torch.nn.functional.linear):
            continue
        args = list(node.args) + [None] * (3 - len(node.args))
        x, weight, bias = args[0], node.kwargs.get("weight", args[1]), node.kwargs.get("bias", args[2])
        with graph.inserting_before(node):
            rows = graph.call_function(torch.unsqueeze, (x, -2))
            product = graph.call_function(torch.mul, (rows, weight))
            result = graph.call_function(torch.sum, (product, -1))
            if bias is not None:
                result = graph.call_function(torch.add, (result, bias))
        # Same value as the linear's: later method calls on it stay cacheable.
        result.meta.update({k: v for k, v in node.meta.items() if k == "example_value"})
        node.replace_all_uses_with(result)
        graph.erase_node(node)
        rewritten += 1
    new = fx.GraphModule(gm, graph)
    new.recompile()
    return new, rewritten


# Unannotated on purpose: symbolic_trace copies annotations into the generated code,
# and Inductor's cache key cannot pickle the generic alias of the return type.
def _logits_head(hidden, weight):  # noqa: ANN001, ANN202
    return (torch.sum(torch.mul(torch.unsqueeze(hidden, -2), weight), -1),)


def logits_head_graph() -> fx.GraphModule:
    """``(hidden [S, H], weight [V, H]) -> (logits [S, V],)`` as a reduction,
    written with ``torch.*`` calls so that Inductor's caches can serialise it."""
    return fx.symbolic_trace(_logits_head)
