"""``compile_model``: trace once, split at attention, compile every unique compute
piece per bucket, and stitch the result into a callable the runner uses in place
of ``model.forward``."""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from kiln.compiler.capture import CapturedGraph, GraphInput, capture
from kiln.compiler.gemv import CPU_GEMV_MAX_TOKENS, decompose_linears, logits_head_graph
from kiln.compiler.piecewise import PiecewiseBackend, inductor_compile, token_arg
from kiln.compiler.split import SplitGraph, bind_eager_implementations, split_graph
from kiln.config import CompilationConfig
from kiln.forward_context import ForwardContext, set_forward_context
from kiln.progress import Progress

__all__ = ["CompileStats", "CompiledModel", "compile_model"]

logger = logging.getLogger(__name__)


@dataclass
class CompileStats:
    dynamo_traces: int = 0
    inductor_compiles: int = 0
    pieces: int = 0
    unique_pieces: int = 0
    phases: dict[str, float] = field(default_factory=dict)
    # "piece <n> [<bucket>]" -> seconds, one entry per Inductor compilation
    compile_seconds: dict[str, float] = field(default_factory=dict)
    artifacts_loaded: int = 0
    cache: str = "off"  # off | miss | hit | bundle | rebuilt


class ArgumentBinder:
    """The traced graph's arguments for one step: the model's parameters and
    buffers in placeholder order, with the step's token ids, positions and token
    count in their slots."""

    def __init__(self, inputs: list[GraphInput], model: nn.Module) -> None:
        tensors: dict[str, torch.Tensor] = dict(model.named_parameters())
        tensors.update(model.named_buffers())
        self._args: list[Any] = [tensors[g.name] if g.kind == "param" else None for g in inputs]
        self._dynamic = [(i, g.kind) for i, g in enumerate(inputs) if g.kind != "param"]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> list[Any]:
        args = list(self._args)
        n = input_ids.shape[0]
        for i, kind in self._dynamic:
            args[i] = input_ids if kind == "input_ids" else positions if kind == "positions" else n
        return args


class CompiledModel:
    """Calls the split graph directly (no Dynamo, no guards) with the model's
    parameters in the order the trace recorded them."""

    def __init__(self, module: fx.GraphModule, inputs: list[GraphInput], model: nn.Module,
                 backends: dict[str, PiecewiseBackend], piece_signatures: dict[str, str],
                 logits_heads: dict[int, Callable[..., Any]] | None = None) -> None:
        self.module = module
        self.model = model
        # compiled LM heads by number of rows (CPU, small counts); others run eagerly
        self.logits_heads = dict(logits_heads or {})
        self.inputs = inputs
        self.backends = backends
        self.piece_signatures = piece_signatures  # submodule name -> backend signature
        for name, sig in piece_signatures.items():
            module.__dict__[name] = backends[sig]
        self.arguments = ArgumentBinder(inputs, model)

    def wrap_pieces(self, wrap: Callable[[str, Callable[..., Any]], Callable[..., Any]]) -> None:
        """Replace each compute piece's runnable by ``wrap(name, runnable)``: one
        wrapper per piece, since identical pieces share compiled code but not
        their inputs (a CUDA graph per layer)."""
        for name in self.piece_signatures:
            self.module.__dict__[name] = wrap(name, self.module.__dict__[name])

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.module(*self.arguments(input_ids, positions))
        return out[0] if isinstance(out, (tuple, list)) else out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.logits_heads.get(hidden.shape[0])
        if head is None:
            return self.model.compute_logits(hidden)
        return head(hidden, self.model.logits_weight())[0]


def _record_piece_inputs(
    split: SplitGraph, args: list[Any], wanted: set[str]
) -> dict[str, list[Any]]:
    """Run the split graph eagerly and keep the inputs each wanted piece received."""
    seen: dict[str, list[Any]] = {}
    module = split.module
    for piece in split.compute_pieces:
        if piece.name in wanted:
            def recorder(*a: Any, _name: str = piece.name, _gm: fx.GraphModule = piece.graph_module) -> Any:
                seen[_name] = list(a)
                return _gm(*a)
            module.__dict__[piece.name] = recorder
    try:
        with torch.no_grad(), set_forward_context(ForwardContext(attn_metadata=None, kv_caches=[])):
            module(*args)
    finally:
        for name in wanted:
            module.__dict__.pop(name, None)
    return seen


def compile_model(
    model: nn.Module,
    config: CompilationConfig,
    *,
    max_num_tokens: int,
    device: torch.device,
    progress: bool | None = None,
    eager_impls: dict[str, Any] | None = None,
) -> tuple[CompiledModel, CompileStats, bytes]:
    """Piecewise-compile ``model`` for token counts ``[1, max_num_tokens]`` with
    exact runnables for ``config.compile_sizes``. ``config`` must be resolved.

    ``eager_impls`` ("ns::op" -> Python function) are called directly in the
    attention pieces. Returns the callable, its statistics, and the pickled split
    graph (before compiled pieces and direct calls were installed) for
    ``save_compiled``."""
    stats = CompileStats()
    t0 = time.perf_counter()
    captured: CapturedGraph = capture(model, device)
    stats.dynamo_traces += 1
    t1 = time.perf_counter()
    split = split_graph(captured.graph_module, list(config.splitting_ops or []))
    # the split graph as it is before compiled pieces are installed, for the cache
    pristine = pickle.dumps(split.module)
    t2 = time.perf_counter()
    stats.phases["trace"] = round(t1 - t0, 4)
    stats.phases["split"] = round(t2 - t1, 4)

    compute = split.compute_pieces
    representatives: dict[str, Any] = {}
    for piece in compute:
        representatives.setdefault(piece.signature, piece)
    stats.pieces = len(compute)
    stats.unique_pieces = len(representatives)
    sizes = list(config.compile_sizes or [])
    options = dict(config.inductor_options or {})

    backends: dict[str, PiecewiseBackend] = {}
    for sig, piece in representatives.items():
        out_node = next(n for n in piece.graph_module.graph.nodes if n.op == "output")
        backends[sig] = PiecewiseBackend(
            sig, token_arg(piece.graph_module), max_num_tokens,
            returns_tuple=isinstance(out_node.args[0], (tuple, list)),
        )
    index_of = {sig: i for i, sig in enumerate(representatives)}
    bind = ArgumentBinder(captured.inputs, model)

    def example_args(n: int) -> list[Any]:
        return bind(torch.zeros(n, dtype=torch.long, device=device), torch.arange(n, dtype=torch.long, device=device))

    head_sizes = [n for n in sizes if n <= CPU_GEMV_MAX_TOKENS] if device.type == "cpu" else []
    weight = model.logits_weight()
    logits_heads: dict[int, Any] = {}
    total = len(representatives) * (1 + len(sizes)) + len(head_sizes)
    with Progress(total, "compiling", enabled=progress) as bar:
        for sig, piece in representatives.items():
            fakes = [n.meta["example_value"] for n in piece.graph_module.graph.nodes if n.op == "placeholder"]
            ts = time.perf_counter()
            backends[sig].range = inductor_compile(piece.graph_module, fakes, dynamic=True, options=options)
            label = f"piece {index_of[sig]} [range 1-{max_num_tokens}]"
            stats.compile_seconds[label] = round(time.perf_counter() - ts, 4)
            stats.inductor_compiles += 1
            bar.update(label)
        for n in sizes:
            recorded = _record_piece_inputs(split, example_args(n), {p.name for p in representatives.values()})
            for sig, piece in representatives.items():
                ts = time.perf_counter()
                gm = piece.graph_module
                if device.type == "cpu" and n <= CPU_GEMV_MAX_TOKENS:
                    gm, _ = decompose_linears(gm)
                backends[sig].exact[n] = inductor_compile(gm, recorded[piece.name], dynamic=False, options=options)
                label = f"piece {index_of[sig]} [{n}]"
                stats.compile_seconds[label] = round(time.perf_counter() - ts, 4)
                stats.inductor_compiles += 1
                bar.update(label)
        for n in head_sizes:
            ts = time.perf_counter()
            hidden = torch.zeros(n, weight.shape[1], dtype=weight.dtype, device=device)
            logits_heads[n] = inductor_compile(logits_head_graph(), [hidden, weight], dynamic=False, options=options)
            label = f"logits head [{n}]"
            stats.compile_seconds[label] = round(time.perf_counter() - ts, 4)
            stats.inductor_compiles += 1
            bar.update(label)
    stats.phases["compile"] = round(time.perf_counter() - t2, 4)
    logger.info(
        "compiled %d pieces (%d unique) x %d buckets: %d Inductor compilations in %.1fs",
        stats.pieces, stats.unique_pieces, 1 + len(sizes), stats.inductor_compiles, stats.phases["compile"],
    )
    if eager_impls:
        bind_eager_implementations(split.module, eager_impls)
    signatures = {p.name: p.signature for p in compute}
    return CompiledModel(split.module, captured.inputs, model, backends, signatures, logits_heads), stats, pristine
