"""Trace once and split at attention (``trace_model``), compile every unique
compute piece per bucket (``compile_traced``), and stitch the result into a
callable the runner uses in place of ``model.forward``."""

from __future__ import annotations

import functools
import logging
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from kiln.attention.cpu_attention import CpuAttentionKernel
from kiln.compiler import cpu_linear, onednn
from kiln.compiler.activation import rewrite_silu_mul
from kiln.compiler.capture import CapturedGraph, GraphInput, capture
from kiln.compiler.cpu_linear import DENSE_KINDS, CpuLinearKernel, LinearPolicy, dense_kind
from kiln.compiler.greedy_head import GreedyHead
from kiln.compiler.gemv import (
    CPU_GEMV_MAX_TOKENS, decompose_linears, kernel_takes_all, logits_head_graph, lower_quantized, packed_head_graph,
)
from kiln.compiler.parallel import CompileJob, compile_workers, run_jobs
from kiln.compiler.pieces import BucketedPiece, inductor_compile, token_arg
from kiln.compiler.replay import ReplayedArtifact
from kiln.compiler.split import Piece, SplitGraph, bind_eager_implementations, pickle_for_entry, split_graph
from kiln.config import CompilationConfig
from kiln.forward_context import ForwardContext, set_forward_context
from kiln.models.quant import QuantFormat
from kiln.progress import Progress

__all__ = ["ArgumentBinder", "CompileStats", "CompiledModel", "TracedModel", "compile_traced", "trace_model"]

logger = logging.getLogger(__name__)

# The most rows of a dense LM head whose dtype oneDNN widens (``onednn.WIDENED``)
# that the C kernel computes, 8 rows a call. The 49152 x 576 bf16 head on 2
# cores of a Zen 3 EPYC: 9 rows 8.0 ms by the kernel against 91 widened and 33
# by torch's bf16 linear; 64 rows 54 against 103 and 217 (scratch timings).
WIDENED_HEAD_MAX_ROWS = 64


@dataclass
class CompileStats:
    dynamo_traces: int = 0
    inductor_compiles: int = 0
    pieces: int = 0
    unique_pieces: int = 0
    phases: dict[str, float] = field(default_factory=dict)
    # "piece <n> [<bucket>]" -> seconds, one entry per Inductor compilation
    compile_seconds: dict[str, float] = field(default_factory=dict)
    compile_workers: int = 0  # processes that compiled side by side
    artifacts_loaded: int = 0
    # how they were loaded: "replay" (their exported code, kiln.compiler.replay: no
    # Inductor imported; also what a CPU process that compiled them runs after
    # saving the entry) or "inductor"; "" when this process compiled them and runs
    # Inductor's fresh artifacts (GPU, or an entry that does not replay)
    artifact_loader: str = ""
    # kernel libraries the shared Inductor cache had lost, rebuilt at load
    kernels_rebuilt: int = 0
    cache: str = "off"  # off | miss | hit | repaired | bundle | rebuilt


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
    parameters in the order the trace recorded them. ``pieces`` maps a piece
    signature to its compiled runnables; ``piece_signatures`` maps each
    submodule of the split graph to its signature (identical layers share one).
    ``attention_kernel``: the CPU attention kernels built with the entry
    (``kiln.attention.cpu_attention``), for the runner's attention backend;
    ``linear_kernel``: the small-batch linear kernel its few-token pieces call
    (``kiln.compiler.cpu_linear``), which also serves the LM head."""

    def __init__(self, module: fx.GraphModule, inputs: list[GraphInput], model: nn.Module,
                 pieces: dict[str, BucketedPiece], piece_signatures: dict[str, str],
                 logits_heads: dict[int, Callable[..., Any]] | None = None,
                 attention_kernel: CpuAttentionKernel | None = None,
                 linear_kernel: CpuLinearKernel | None = None) -> None:
        self.module = module
        self.model = model
        self.attention_kernel = attention_kernel
        self.linear_kernel = linear_kernel
        # compiled LM heads by number of rows (CPU, small counts); others run eagerly
        self.logits_heads = dict(logits_heads or {})
        self.inputs = inputs
        self.pieces = pieces
        self.piece_signatures = piece_signatures
        for name, sig in piece_signatures.items():
            module.__dict__[name] = pieces[sig]
        # The attention pieces' generated forward, called without nn.Module's
        # call machinery (hooks, tracing state, GraphModule's wrapper): about 10
        # us a call, 30 calls a step of the 135M shape.
        for name, sub in module.named_children():
            if name not in piece_signatures and isinstance(sub, fx.GraphModule):
                module.__dict__[name] = sub.forward
        self.arguments = ArgumentBinder(inputs, model)
        self.reordering: threading.Thread | None = None  # reorder_weights' thread
        self.greedy_head: GreedyHead | None = None  # the fp32 head's greedy screen (reorder_weights)

    def wrap_pieces(self, wrap: Callable[[str, Callable[..., Any]], Callable[..., Any]]) -> None:
        """Replace each compute piece's runnable by ``wrap(name, runnable)``: one
        wrapper per piece, since identical pieces share compiled code but not
        their inputs (a CUDA graph per layer)."""
        for name in self.piece_signatures:
            self.module.__dict__[name] = wrap(name, self.module.__dict__[name])

    def call_graph_refusal(self) -> str | None:
        """Why a CPU call graph (``kiln.graphs.cpu``) could not record this
        model's steps, or None: every runnable must be exported code, whose
        kernels ``native_sites`` can list (an artifact fresh from Inductor, or
        loaded through it, calls kernels that cannot be listed)."""
        for sig, piece in self.pieces.items():
            for fn in piece.runnables():
                if not isinstance(fn, ReplayedArtifact):
                    return f"piece {sig[:16]} runs {type(fn).__name__}, not exported code"
        return None

    def native_sites(self) -> list[tuple[Any, str]]:
        """Every place a forward finds a native function, as ``kiln.graphs.cpu``
        records a step's calls through them: the kernels of each piece's
        exported code, and the C linear kernel (the one kiln's op calls now)
        and decode-attention kernel."""
        sites = [site for piece in self.pieces.values() for fn in piece.runnables()
                 if isinstance(fn, ReplayedArtifact) for site in fn.native_sites()]
        kernels = {id(k): k for k in (self.linear_kernel, cpu_linear.current(), self.attention_kernel) if k is not None}
        for kernel in kernels.values():
            sites += kernel.native_sites()
        return sites

    def allocation_sites(self) -> list[tuple[Any, str]]:
        """Where a forward finds the allocator that bypasses torch's dispatcher
        (Inductor's ``empty_strided_cpu``, which the C linear kernel's op
        calls too), as ``kiln.graphs.cpu`` points a capture's allocations at
        the memory every graph shares."""
        sites: list[tuple[Any, str]] = [(fn.namespace, ReplayedArtifact.ALLOCATOR) for piece in self.pieces.values()
                                        for fn in piece.runnables()
                                        if isinstance(fn, ReplayedArtifact) and ReplayedArtifact.ALLOCATOR in fn.namespace]
        return sites + [cpu_linear.allocation_site()]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.module(*self.arguments(input_ids, positions))
        return out[0] if isinstance(out, (tuple, list)) else out

    def reorder_weights(self, max_rows: int) -> int:
        """Lay out for the C kernel (its AMX tiles and fp32 panels, before
        this returns) and start reordering for oneDNN, in a thread
        (``self.reordering``), the weights its many-row pieces hand to
        ``kiln::onednn_linear`` (``kiln.compiler.onednn``):
        every dense linear's of ``onednn.REWRITE_DTYPES`` (fp32, bf16), and
        the LM head's when a step can sample more rows (``max_rows``) than
        the C kernel or the compiled heads take; and an fp32 head's bf16 tiles
        for its greedy screen (``greedy_tokens``). Returns the bytes the copies
        take (0 off CPU, or for dtypes it does not take)."""
        device = next(self.model.parameters()).device
        if not onednn.available(device):
            return 0
        weights = [m.weight for m in self.model.modules()
                   if isinstance(m, nn.Linear) and m.weight.dtype in onednn.REWRITE_DTYPES]
        tensors, fmt = self.model.logits_inputs()
        kernel = self.linear_kernel
        kind = dense_kind(tensors[0].dtype, tensors[0].dtype)
        # the head's rows that never reach oneDNN's copy (_native_head)
        if kernel is None or kind not in kernel.kinds:
            few = CPU_GEMV_MAX_TOKENS
        elif kernel.policy.to_tiles(kind):
            few = 0  # a bf16 head on the AMX tiles, which need its copy
        else:
            few = kernel.policy.most_rows(kind)
        if fmt is None and max_rows > few:
            weights.append(tensors[0])
        nbytes, self.reordering = onednn.prepack(weights, background=True, kernel=kernel)
        self.greedy_head = GreedyHead.build(kernel, tensors[0]) if fmt is None and kind == "f32" else None
        return nbytes + (self.greedy_head.tiles.nbytes if self.greedy_head is not None else 0)

    def greedy_tokens(self, hidden: torch.Tensor) -> list[int] | None:
        """``argmax_rows(self.compute_logits(hidden))``, the same tokens, by
        the fp32 head's greedy screen (``kiln.compiler.greedy_head``) where
        the head's rows go to the C kernel: its dense rows up to the policy's
        fp32 rows (``_native_head``), its panels beyond; None elsewhere."""
        head, kernel = self.greedy_head, self.linear_kernel
        if head is None or kernel is None or hidden.dtype != torch.float32 or not hidden.is_cpu:
            return None
        if hidden.shape[0] <= kernel.policy.most_rows("f32"):
            return head(hidden, panels=False)
        if onednn.takes(hidden, head.weight) and onednn.on_panels(head.weight, kernel):
            return head(hidden, panels=True)
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        tensors, fmt = self.model.logits_inputs()
        native = self._native_head(hidden, tensors, fmt)
        if native is not None:
            return native
        if (fmt is None and hidden.shape[0] > CPU_GEMV_MAX_TOKENS and onednn.available(hidden.device)
                and onednn.takes(hidden, tensors[0])):
            return onednn.implementation(hidden, tensors[0], None)
        head = self.logits_heads.get(hidden.shape[0])
        if head is not None:
            return head(hidden, *tensors)[0]
        if fmt is None or not self.logits_heads:
            return self.model.compute_logits(hidden)
        # A packed head run eagerly dequantizes its whole matrix on every call: 16
        # rows of the demo model took 2.6x dense time that way. Chunks of the largest
        # compiled size (the last one padded) read the packed words instead.
        size = max(self.logits_heads)
        out = []
        for start in range(0, hidden.shape[0], size):
            rows = hidden[start:start + size]
            padded = F.pad(rows, (0, 0, 0, size - rows.shape[0]))
            out.append(self.logits_heads[size](padded, *tensors)[0][: rows.shape[0]])
        return torch.cat(out)

    def _native_head(self, hidden: torch.Tensor, tensors: list[torch.Tensor], fmt: QuantFormat | None,
                     ) -> torch.Tensor | None:
        """The logits by the C kernel, for up to ``kernel.max_rows`` rows
        (a dense head: one call; at 5-8 rows 6-11% faster than oneDNN on the
        reordered 49152 x 576 head, scratch timing), up to
        ``WIDENED_HEAD_MAX_ROWS`` of a dtype oneDNN would widen, or any number
        of them (a packed head, which ``linear`` would dequantize whole); a
        bf16 head on its AMX tiles where the kernel sends bf16 there
        (``LinearPolicy.to_tiles``); None where none applies."""
        kernel = self.linear_kernel
        if kernel is None or hidden.device.type != "cpu":
            return None
        if fmt is not None:
            words, scales, *offsets = tensors
            if hidden.dtype in DENSE_KINDS and fmt.name in kernel.kinds:
                return kernel(hidden, words, scales, offsets[0] if offsets else None, None, fmt.name)
            return None
        kind = dense_kind(hidden.dtype, tensors[0].dtype)
        if kind not in kernel.kinds:
            return None
        if kernel.policy.to_tiles(kind) and onednn.takes(hidden, tensors[0]):
            return onednn.implementation(hidden, tensors[0], None)
        most = WIDENED_HEAD_MAX_ROWS if hidden.dtype in onednn.WIDENED else kernel.policy.most_rows(kind)
        if hidden.shape[0] > most:
            return None
        return kernel(hidden, tensors[0], None, None, None, kind)


def _record_piece_inputs(split: SplitGraph, args: list[Any], wanted: set[str]) -> dict[str, list[Any]]:
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


def _unique_pieces(split: SplitGraph, max_num_tokens: int) -> dict[str, tuple[Piece, BucketedPiece]]:
    """signature -> (a representative piece, its empty runnables)."""
    unique: dict[str, tuple[Piece, BucketedPiece]] = {}
    for piece in split.compute_pieces:
        if piece.signature not in unique:
            out_node = next(n for n in piece.graph_module.graph.nodes if n.op == "output")
            unique[piece.signature] = (piece, BucketedPiece(
                piece.signature, token_arg(piece.graph_module), max_num_tokens,
                returns_tuple=isinstance(out_node.args[0], (tuple, list)),
            ))
    return unique


Install = Callable[[Any], None]  # puts a job's compiled artifact where the model calls it


def _piece_jobs(
    split: SplitGraph, unique: dict[str, tuple[Piece, BucketedPiece]], example_args: Callable[[int], list[Any]],
    sizes: list[int], max_num_tokens: int, device: torch.device, policy: LinearPolicy | None,
) -> list[tuple[CompileJob, Install]]:
    """Each unique piece for the range, then for the few-row span (below), then
    for each other exact size (with example inputs recorded from an eager run
    of that size); ``policy``: the C linear kernel's, whose few-token CPU
    pieces call it where it says.

    Where the kernel takes every linear of every piece from 2 to
    ``cpu_linear.MAX_ROWS`` rows (16 where they are all fp32; one call each),
    the exact sizes in that span are compiled once, for the whole span: one
    dynamic compilation per piece instead of one per size, and the counts
    between them (3, 5-8 or 5-16) call the kernel too instead of oneDNN.
    For the 135M shape a piece's dynamic compile took 1.2x one exact size's (scratch timing: 2.7, 4.3, 1.4 s against 2.2,
    3.6, 1.2 s), so -O2's sizes 2 and 4 cost 0.6x what they did."""
    index_of = {sig: i for i, sig in enumerate(unique)}
    jobs: list[tuple[CompileJob, Install]] = []
    for sig, (piece, runnables) in unique.items():
        label = f"piece {index_of[sig]} [range 1-{max_num_tokens}]"
        gm = _activations(_many_rows(lower_quantized(piece.graph_module, device), device), policy)
        jobs.append((CompileJob(label, gm, _traced_inputs(piece.graph_module), dynamic=True),
                     functools.partial(setattr, runnables, "range")))
    span = _few_rows(unique, sizes, device, policy)
    if span is not None:
        sizes = [n for n in sizes if not span[0] <= n <= span[1]]
        for sig, (piece, runnables) in unique.items():
            gm = _activations(decompose_linears(piece.graph_module, span[0], policy)[0], policy)
            jobs.append((CompileJob(f"piece {index_of[sig]} [{span[0]}-{span[1]}]", gm,
                                    _traced_inputs(piece.graph_module), dynamic=True),
                         functools.partial(_install_few, runnables, span)))
    for n in sizes:
        recorded = _record_piece_inputs(split, example_args(n), {p.name for p, _ in unique.values()})
        for sig, (piece, runnables) in unique.items():
            gm = piece.graph_module
            if device.type == "cpu" and n <= CPU_GEMV_MAX_TOKENS:
                gm, _ = decompose_linears(gm, n, policy)
            else:
                gm = _many_rows(lower_quantized(gm, device), device)
            gm = _activations(gm, policy)
            jobs.append((CompileJob(f"piece {index_of[sig]} [{n}]", gm, recorded[piece.name], dynamic=False),
                         functools.partial(runnables.exact.__setitem__, n)))
    return jobs


def _traced_inputs(gm: fx.GraphModule) -> list[Any]:
    """The piece's inputs as the trace recorded them (symbolic token count)."""
    return [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]


def _few_rows(unique: dict[str, tuple[Piece, BucketedPiece]], sizes: list[int], device: torch.device,
              policy: LinearPolicy | None) -> tuple[int, int] | None:
    """The span of token counts one dynamic compilation serves (``_piece_jobs``):
    ``(2, high)`` when an exact size falls in it and the C kernel (or the AMX
    tiles it sends bf16 to) takes every linear at both ends, else None.
    ``high``: the fp32 kernel's rows (``LinearPolicy.f32_rows``) where that
    holds at them, else ``cpu_linear.MAX_ROWS``."""
    if device.type != "cpu" or policy is None:
        return None
    low = 2
    graphs = [piece.graph_module for piece, _ in unique.values()]
    for high in sorted({policy.f32_rows, cpu_linear.MAX_ROWS}, reverse=True):
        if (any(low <= n <= high for n in sizes)
                and all(kernel_takes_all(gm, n, policy) for gm in graphs for n in (low, high))):
            return low, high
    return None


def _install_few(runnables: BucketedPiece, span: tuple[int, int], artifact: Any) -> None:
    runnables.few, runnables.few_rows = artifact, span


def _many_rows(gm: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """``gm`` for a piece that runs more than a few tokens: its fp32 linears
    through oneDNN on CPU (``kiln.compiler.onednn``)."""
    return onednn.rewrite_linears(gm)[0] if onednn.available(device) else gm


def _activations(gm: fx.GraphModule, policy: LinearPolicy | None) -> fx.GraphModule:
    """``gm`` with the gated MLP's activation after an extern linear as
    ``kiln::silu_mul`` (``kiln.compiler.activation``), where the C linear
    kernel, which runs it, is there (``policy``)."""
    return rewrite_silu_mul(gm)[0] if policy is not None else gm


def _head_jobs(model: nn.Module, sizes: list[int], device: torch.device,
               heads: dict[int, Callable[..., Any]]) -> list[tuple[CompileJob, Install]]:
    tensors, fmt = model.logits_inputs()
    dtype = tensors[0].dtype if fmt is None else next(model.parameters()).dtype  # packed: the hidden states'

    graph = logits_head_graph() if fmt is None else packed_head_graph(fmt, tuple(tensors[0].shape[:2]), dtype)
    jobs = []
    for n in sizes:
        hidden = torch.zeros(n, model.config.hidden_size, dtype=dtype, device=device)
        jobs.append((CompileJob(f"logits head [{n}]", graph, [hidden, *tensors], dynamic=False),
                     functools.partial(heads.__setitem__, n)))
    return jobs


def _run_jobs(jobs: list[tuple[CompileJob, Install]], config: CompilationConfig, device: torch.device,
              stats: CompileStats, progress: bool | None) -> None:
    """Compile every job (in parallel workers on CPU, ``kiln.compiler.parallel``;
    on a GPU, Inductor's own workers compile each graph's kernels) and install
    the results, counting and timing each compilation."""
    options = dict(config.inductor_options or {})
    workers = compile_workers(len(jobs)) if device.type == "cpu" else 1
    with Progress(len(jobs), f"compiling ({workers} workers)", enabled=progress) as bar:
        def done(job: CompileJob, seconds: float) -> None:
            stats.compile_seconds[job.label] = round(seconds, 4)
            stats.inductor_compiles += 1
            bar.update(job.label)

        with tempfile.TemporaryDirectory(prefix="kiln-compile-jobs-") as scratch:
            artifacts = run_jobs([job for job, _ in jobs],
                                 lambda job: inductor_compile(job.graph, job.inputs, dynamic=job.dynamic,
                                                              options=options),
                                 workers, Path(scratch), done)
    for (_, install), artifact in zip(jobs, artifacts):
        install(artifact)
    stats.compile_workers = workers


@dataclass(frozen=True)
class TracedModel:
    """The model traced once and split at attention, ready to compile."""

    captured: CapturedGraph
    split: SplitGraph
    pristine: bytes  # the pickled split graph for the cache, compute pieces as slots (pickle_for_entry)
    phases: dict[str, float]


def trace_model(model: nn.Module, config: CompilationConfig, device: torch.device) -> TracedModel:
    """One Dynamo trace of ``model``, split at the splitting ops."""
    t0 = time.perf_counter()
    captured: CapturedGraph = capture(model, device)
    t1 = time.perf_counter()
    split = split_graph(captured.graph_module, list(config.splitting_ops or []))
    pristine = pickle_for_entry(split)
    return TracedModel(captured, split, pristine,
                       {"trace": round(t1 - t0, 4), "split": round(time.perf_counter() - t1, 4)})


def compile_traced(
    traced: TracedModel,
    model: nn.Module,
    config: CompilationConfig,
    *,
    max_num_tokens: int,
    device: torch.device,
    progress: bool | None = None,
    eager_impls: dict[str, Any] | None = None,
    attention_kernel: CpuAttentionKernel | None = None,
    linear_kernel: CpuLinearKernel | None = None,
) -> tuple[CompiledModel, CompileStats]:
    """Compile every unique compute piece of ``traced`` for token counts
    ``[1, max_num_tokens]``, with exact runnables for ``config.compile_sizes``
    (``config`` must be resolved), and the CPU LM heads.

    ``eager_impls`` ("ns::op" -> Python function) are called directly in the
    attention pieces; ``attention_kernel`` goes with the callable;
    ``linear_kernel``: the few-token pieces call it, and no LM head is
    compiled (the kernel is the head). Returns the callable and its
    statistics."""
    stats = CompileStats(dynamo_traces=1, phases=dict(traced.phases))
    t0 = time.perf_counter()
    split, captured = traced.split, traced.captured
    unique = _unique_pieces(split, max_num_tokens)
    stats.pieces, stats.unique_pieces = len(split.compute_pieces), len(unique)
    sizes = list(config.compile_sizes or [])
    cpu_heads = device.type == "cpu" and linear_kernel is None
    head_sizes = [n for n in sizes if n <= CPU_GEMV_MAX_TOKENS] if cpu_heads else []
    bind = ArgumentBinder(captured.inputs, model)

    def example_args(n: int) -> list[Any]:
        return bind(torch.zeros(n, dtype=torch.long, device=device), torch.arange(n, dtype=torch.long, device=device))

    logits_heads: dict[int, Callable[..., Any]] = {}
    jobs = _piece_jobs(split, unique, example_args, sizes, max_num_tokens, device,
                       linear_kernel.policy if linear_kernel is not None else None)
    _run_jobs(jobs + _head_jobs(model, head_sizes, device, logits_heads), config, device, stats, progress)
    stats.phases["compile"] = round(time.perf_counter() - t0, 4)
    logger.info(
        "compiled %d pieces (%d unique) x %d buckets: %d Inductor compilations in %.1fs (%d workers)",
        stats.pieces, stats.unique_pieces, 1 + len(sizes), stats.inductor_compiles, stats.phases["compile"],
        stats.compile_workers,
    )
    if eager_impls:
        bind_eager_implementations(split.module, eager_impls)
    pieces = {sig: runnables for sig, (_, runnables) in unique.items()}
    signatures = {p.name: p.signature for p in split.compute_pieces}
    compiled = CompiledModel(split.module, captured.inputs, model, pieces, signatures, logits_heads,
                             attention_kernel, linear_kernel)
    return compiled, stats

