"""The one attention op every kiln model calls.

``torch.ops.kiln.attention(q, k, v, out, layer_idx, scale, sliding_window)``
writes this step's K/V into the paged cache and fills ``out`` with attention over
each request's cached context. Its per-step inputs (slot mapping, block table,
sequence lengths) and the backend that runs it come from the forward context, so
the op's signature, and with it the traced graph, does not change from step to
step or backend to backend. Dynamo keeps it as one opaque node, which is where
the compiler splits the graph.

This module imports only the forward context: models call it, and it sits below
them. The backends (``kiln.attention.backend``) sit above.
"""

from __future__ import annotations

import torch

from kiln.forward_context import get_forward_context

__all__ = ["EAGER_IMPLEMENTATIONS", "attend", "attention"]


def _attention_impl(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    layer_idx: int,
    scale: float,
    sliding_window: int,
) -> None:
    """Paged attention for layer ``layer_idx`` by the forward context's backend;
    ``sliding_window <= 0`` means none."""
    ctx = get_forward_context()
    if ctx.attn_metadata is None:  # a profiling or tracing run with no requests behind it
        out.zero_()
        return
    if ctx.attention_backend is None:
        raise RuntimeError("the forward context carries attention metadata but no attention backend")
    ctx.attention_backend.forward(
        query, key, value, out, ctx.kv_caches[layer_idx], ctx.attn_metadata, scale, sliding_window
    )


def _attention_fake(query, key, value, out, layer_idx, scale, sliding_window) -> None:  # noqa: ANN001
    return None


# Registered through torch.library.Library rather than @custom_op: the decorator's
# Python dispatch layers cost time on every layer of every eager step
# (bench/results/op-overhead-cpu-latest.json).
_LIB = torch.library.Library("kiln", "FRAGMENT")
_LIB.define(
    "attention(Tensor query, Tensor key, Tensor value, Tensor(a!) out, int layer_idx, "
    "float scale, int sliding_window) -> ()"
)
for _key in ("CPU", "CUDA"):
    _LIB.impl("attention", _attention_impl, _key)
torch.library.register_fake("kiln::attention", _attention_fake, lib=_LIB)

attention = torch.ops.kiln.attention
# op name -> the Python function behind it, for the compiler to call directly in
# the eager attention pieces, skipping the dispatcher's round trip
EAGER_IMPLEMENTATIONS = {"kiln::attention": _attention_impl}


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    layer_idx: int,
    scale: float,
    sliding_window: int,
) -> None:
    """What model code calls. Under tracing it records the ``kiln::attention`` op
    (the compiler's split point); run eagerly it calls the implementation
    directly, skipping the dispatcher's round trip through Python."""
    if torch.compiler.is_compiling():
        torch.ops.kiln.attention(query, key, value, out, layer_idx, scale, sliding_window)
    else:
        _attention_impl(query, key, value, out, layer_idx, scale, sliding_window)
