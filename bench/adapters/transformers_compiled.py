"""transformers ``generate`` with a static KV cache under ``torch.compile``:
transformers' own recipe for fast decoding, as a measured system.

On CPU the forward is wrapped in ``torch.compile(fullgraph=True)``; on CUDA
``generate`` compiles the decode step itself (see :func:`setup_static_compile`).
Compilation happens during the warm-up, which is reported as
``compile_seconds`` with Dynamo's counters (graphs, graph breaks, CUDA graph
skips), so that a baseline silently running eagerly shows up in the JSON.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from bench.adapters.transformers_eager import TransformersEngine, TransformersThroughputEngine
from bench.common.harness import BenchSettings


def setup_static_compile(model: Any, device: str) -> str:
    """Give ``model`` transformers' fast-decoding recipe, a static KV cache and
    ``torch.compile``; return what was compiled, for the label and the JSON.

    On CPU the forward is wrapped in ``torch.compile(fullgraph=True)`` (default
    Inductor mode). On CUDA ``generate`` compiles the decode step by itself when
    the cache is static (its auto-compile, ``CompileConfig`` defaults: mode
    ``reduce-overhead``, i.e. CUDA graphs, static shapes; the prefill runs
    eagerly): wrapping the forward as well would compile twice, nested."""
    model.generation_config.cache_implementation = "static"
    if device.startswith("cuda"):
        return "generate's auto-compile of the decode step (CompileConfig defaults: reduce-overhead)"
    model.forward = torch.compile(model.forward, fullgraph=True)
    return "torch.compile(model.forward, fullgraph=True), default mode"


def dynamo_counters() -> dict[str, dict[str, int]]:
    """A copy of torch._dynamo's global counters."""
    from torch._dynamo.utils import counters

    return {group: dict(values) for group, values in counters.items()}


def compile_counters(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, Any]:
    """What torch.compile did between two :func:`dynamo_counters` snapshots: graphs
    compiled, graph breaks (and the first few reasons), CUDA graph skips."""

    def delta(group: str) -> dict[str, int]:
        old = before.get(group, {})
        return {k: v - old.get(k, 0) for k, v in after.get(group, {}).items() if v - old.get(k, 0)}

    breaks = delta("graph_break")
    inductor = delta("inductor")
    return {
        "unique_graphs": delta("stats").get("unique_graphs", 0),
        "graph_breaks": sum(breaks.values()),
        "graph_break_reasons": [str(reason)[:200] for reason in list(breaks)[:3]],
        "cudagraph_skips": sum(v for k, v in inductor.items() if "cudagraph_skip" in k),
    }


def auto_compiled(model: Any) -> bool | None:
    """Whether ``generate`` compiled the decode step (CUDA), None where it is not
    expected to (the forward was wrapped instead)."""
    if hasattr(model.forward, "_torchdynamo_orig_callable"):
        return None
    return getattr(model, "_compiled_call", None) is not None


class _StaticCompileMixin:
    """Turns a transformers adapter into its compiled variant: the static cache
    and ``torch.compile`` set up after the load, compilation counted during the
    warm-up, and the compile figures added to the summary."""

    engine = "transformers-compiled"
    model: Any
    device: str
    description: str
    attn_implementation: str
    warmup_seconds: float | None

    def __init__(self, model_path: Path, prompts: Any, settings: BenchSettings) -> None:
        # prompts: one prompt (batch 1) or a list of them (throughput), as the adapter takes
        super().__init__(model_path, prompts, settings)  # type: ignore[call-arg]
        self.compiled = setup_static_compile(self.model, settings.device)
        cuda = settings.device.startswith("cuda")
        how = "auto-compile (reduce-overhead)" if cuda else "torch.compile"
        self.label = f"{self.description}, static cache, {how}, {self.attn_implementation}"
        if cuda:
            # generate itself runs under no_grad: its compiled (CUDA graph) decode path is
            # used as transformers uses it, not under inference mode
            self.grad_mode = torch.no_grad
        self.compile_counters: dict[str, Any] = {}

    def warmup(self) -> None:
        before = dynamo_counters()
        super().warmup()  # type: ignore[misc]
        self.compile_counters = compile_counters(before, dynamo_counters())

    def summary(self, runs: list[dict[str, Any]]) -> dict[str, Any]:
        result = super().summary(runs)  # type: ignore[misc]
        result["torch_compile"] = True
        result["compile_seconds"] = self.warmup_seconds
        result["compile_counters"] = self.compile_counters
        if self.device.startswith("cuda"):
            result["compiled"] = self.compiled
            result["decode_step_compiled"] = auto_compiled(self.model)
        return result


class TransformersCompiledEngine(_StaticCompileMixin, TransformersEngine):
    """Batch 1, as :class:`TransformersEngine`, compiled."""


class TransformersCompiledThroughputEngine(_StaticCompileMixin, TransformersThroughputEngine):
    """One batched generate, as :class:`TransformersThroughputEngine`, compiled."""
