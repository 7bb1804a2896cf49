"""Cutting the traced graph at attention.

Every attention call becomes a piece of its own, run eagerly; the code between
two attention calls becomes a compute piece, compiled. A decoder's middle pieces
(o_proj, MLP, the next layer's norm, QKV and RoPE) are the same graph for every
layer, which ``piece_signature`` recognises so they are compiled once.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

__all__ = [
    "CompiledPieceSlot", "Piece", "SplitGraph", "bind_eager_implementations", "is_splitting_node", "piece_signature",
    "pickle_for_entry", "split_graph",
]


@dataclass
class Piece:
    name: str  # attribute of the split graph module (submod_N)
    graph_module: fx.GraphModule
    is_splitting: bool  # an attention piece, run eagerly
    signature: str = ""  # structural hash; equal signatures compile to the same code


@dataclass
class SplitGraph:
    module: fx.GraphModule
    pieces: list[Piece]

    @property
    def compute_pieces(self) -> list[Piece]:
        return [p for p in self.pieces if not p.is_splitting]


class CompiledPieceSlot(torch.nn.Module):
    """What a compute piece is in the split graph a cache entry stores: the
    entry's compiled runnables are installed over it at load, so its FX graph
    is not kept. Unpickling a graph module retraces it, and the compute pieces'
    graphs were most of a warm start's ``load_artifacts`` (0.56 of 0.81 s for
    the 135M shape, with the 31 attention pieces and the top-level graph)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.piece_name = name

    def forward(self, *args: Any) -> Any:
        raise RuntimeError(f"compute piece {self.piece_name} of a loaded split graph has no compiled runnable "
                           "installed")


def pickle_for_entry(split: SplitGraph) -> bytes:
    """The split graph pickled with a ``CompiledPieceSlot`` for each compute piece."""
    module = split.module
    saved = {p.name: module._modules[p.name] for p in split.compute_pieces}
    try:
        for name in saved:
            module._modules[name] = CompiledPieceSlot(name)
        return pickle.dumps(module)
    finally:
        module._modules.update(saved)


def _op_name(target: object) -> str | None:
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    if isinstance(target, torch._ops.OpOverload):
        return target.name()
    return None


def is_splitting_node(node: fx.Node, splitting_ops: list[str]) -> bool:
    """True for a call of one of ``splitting_ops`` ("ns::op"), matched both as the
    op packet (what Dynamo records) and as any of its overloads."""
    if node.op != "call_function":
        return False
    name = _op_name(node.target)
    if name is None:
        return False
    base = name.split(".")[0]
    return base in splitting_ops or name in splitting_ops


def split_graph(gm: fx.GraphModule, splitting_ops: list[str]) -> SplitGraph:
    partition: dict[fx.Node, int] = {}
    current = 0
    found = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_splitting_node(node, splitting_ops):
            found += 1
            current += 1
            partition[node] = current
            current += 1
        else:
            partition[node] = current
    if not found:
        raise RuntimeError(
            f"the traced graph has no call of {splitting_ops}: nothing to split at "
            "(does the model call torch.ops.kiln.attention?)"
        )
    split = split_module(gm, None, lambda n: partition[n], keep_original_order=True)
    pieces = []
    for name, sub in split.named_children():
        splitting = any(is_splitting_node(n, splitting_ops) for n in sub.graph.nodes)
        piece = Piece(name, sub, splitting)
        if not splitting:
            piece.signature = piece_signature(sub)
        pieces.append(piece)
    return SplitGraph(split, pieces)


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"T{tuple(str(s) for s in value.shape)}{tuple(str(s) for s in value.stride())}{value.dtype}"
    if isinstance(value, torch.SymInt):
        return "SymInt"
    return type(value).__name__


def piece_signature(gm: fx.GraphModule) -> str:
    """A hash of a piece's structure and input metadata, blind to node names."""
    index: dict[fx.Node, int] = {}
    parts = []
    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: f"%{index[n]}")
        target = "" if node.op == "placeholder" else str(node.target)
        meta = _describe(node.meta.get("example_value")) if node.op == "placeholder" else ""
        parts.append(f"{node.op}|{target}|{args!r}|{meta}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def bind_eager_implementations(module: fx.GraphModule, implementations: dict[str, Callable[..., Any]]) -> int:
    """In the (eagerly run) splitting pieces of ``module``, call the Python function
    behind each op of ``implementations`` ("ns::op" -> function) directly rather
    than through the dispatcher. Returns the number of calls rebound."""
    bound = 0
    for sub in module.children():
        if not isinstance(sub, fx.GraphModule):
            continue
        changed = False
        for node in sub.graph.nodes:
            name = _op_name(node.target) if node.op == "call_function" else None
            fn = implementations.get(name.split(".")[0]) if name else None
            if fn is not None:
                node.target = fn
                changed = True
                bound += 1
        if changed:
            sub.recompile()
    return bound
