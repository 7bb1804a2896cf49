"""Tracing the model once with Dynamo.

The token dimension of ``input_ids`` and ``positions`` is marked unbacked: Dynamo
then makes no assumption about its size (no 0/1 specialisation, no guards), so the
one graph serves every token count, T=1 decode steps included. Parameters and
buffers stay graph inputs; ``GraphInput`` records which is which, so that the
compiled callable can be called directly afterwards, without Dynamo and its guards.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

import torch
from torch import fx, nn

from kiln.forward_context import ForwardContext, set_forward_context

__all__ = ["GraphInput", "CapturedGraph", "capture"]

_LOCK = threading.Lock()
# How many graphs Dynamo has handed to kiln in this process (tests read it).
TRACE_COUNT = 0


@dataclass(frozen=True)
class GraphInput:
    """What feeds one placeholder of the traced graph."""

    kind: Literal["param", "input_ids", "positions", "num_tokens"]
    name: str = ""  # the parameter or buffer name, for kind == "param"


@dataclass
class CapturedGraph:
    graph_module: fx.GraphModule
    inputs: list[GraphInput]


def capture(model: nn.Module, device: torch.device, example_tokens: int = 8) -> CapturedGraph:
    """Trace ``model.forward(input_ids[T], positions[T])`` into one FX graph."""
    by_id: dict[int, str] = {id(t): n for n, t in model.named_parameters()}
    by_id.update({id(t): n for n, t in model.named_buffers()})
    input_ids = torch.zeros(example_tokens, dtype=torch.long, device=device)
    positions = torch.arange(example_tokens, dtype=torch.long, device=device)
    torch._dynamo.decorators.mark_unbacked(input_ids, 0)
    torch._dynamo.decorators.mark_unbacked(positions, 0)

    result: list[CapturedGraph] = []

    def receive_graph(gm: fx.GraphModule, example_inputs: list[object]) -> object:
        global TRACE_COUNT
        TRACE_COUNT += 1
        kinds = []
        for i, value in enumerate(example_inputs):
            if value is input_ids:
                kinds.append(GraphInput("input_ids"))
            elif value is positions:
                kinds.append(GraphInput("positions"))
            elif isinstance(value, (torch.SymInt, int)):
                kinds.append(GraphInput("num_tokens"))
            elif isinstance(value, torch.Tensor) and id(value) in by_id:
                kinds.append(GraphInput("param", by_id[id(value)]))
            else:
                raise RuntimeError(f"graph input {i} ({type(value).__name__}) is neither a model input nor a parameter")
        result.append(CapturedGraph(gm, kinds))
        return gm.forward

    # Dynamo caches traced frames per code object; every DecoderModel shares one, so a
    # second model in this process would count as a recompile of the first. kiln calls
    # the traced graph directly afterwards and never needs Dynamo's cache.
    with _LOCK, torch.no_grad(), set_forward_context(ForwardContext(attn_metadata=None, kv_caches=[])):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=receive_graph, fullgraph=True, dynamic=False)
        compiled(input_ids, positions)
        torch._dynamo.reset()
    if len(result) != 1:
        raise RuntimeError(f"expected one Dynamo graph, got {len(result)}")
    return result[0]
