"""CPU micro-benchmarks behind kiln's design choices, and one machine limit.

Run from the repository root::

    python -m bench.cpu_kernels                    # all, 2 threads
    python -m bench.cpu_kernels --only gemv
    python -m bench.cpu_kernels --only quant-kernels
    python -m bench.cpu_kernels --only decode-attention
    python -m bench.cpu_kernels --only prefill-attention
    python -m bench.cpu_kernels --only cpu-linear
    python -m bench.cpu_kernels --only many-rows
    python -m bench.cpu_kernels --only step-linears
    python -m bench.cpu_kernels --only silu-mul
    python -m bench.cpu_kernels --smoke            # a check of this script: few calls, one small case

* ``op-overhead``: the cost per call of reaching kiln's attention op through the
  torch dispatcher (``torch.ops.kiln.attention``) against calling its Python
  implementation directly (``EAGER_IMPLEMENTATIONS["kiln::attention"]``, what
  compiled attention pieces call) and through ``attend`` (what eager model code
  calls); and of the same implementation registered with
  ``@torch.library.custom_op``, to show why kiln registers its op with
  ``torch.library.Library``. The calls run in a forward context without
  attention metadata, where the implementation only zeroes ``out`` (decode
  shapes of SmolLM2-135M), so what is timed is the calling overhead. Every
  layer of every eager step pays it once.
* ``gemv``: a linear layer at 1, 2 and 4 tokens on the fp32 weights of
  SmolLM2-135M (LM head [49152, 576], gate/up [3072, 576], down [576, 1536]):
  ``F.linear`` (BLAS ``mm``) against the reduction ``(x[:, None, :] * W).sum(-1)``
  compiled by Inductor, which is how kiln's exact-size CPU pieces run small
  token counts (``kiln.compiler.gemv``). Reported in ms and GB/s (weight bytes
  over time: at these sizes the weight is the traffic). Each case cycles through
  copies of its weight filling 256 MiB, more than the last-level cache, as a
  decode step touches each layer's weights once: a weight served from cache
  would flatter both.
* ``quant-kernels``: the same small-batch linear layers, at 1 and 4 tokens, on
  SmolLM2-135M's weight shapes (those of ``gemv`` and the attention input
  projection qkv [960, 576]) held in kiln's packed quantized formats
  (``kiln.models.quant.FORMATS``: per-row int8, q8_0 with a scale per 32, q4
  with a scale and an offset per 32), each run as
  ``kiln.models.quant.reduction`` compiled by Inductor, against the fp32
  reduction above. Reported in ms, GB/s (packed bytes over time), speedup over
  fp32 and the largest error against ``x @ dequantize(...).T``. One more row
  passes the q8_0 words as int32 instead of float32 bit patterns: Inductor's
  CPU code loads integer vectors through a stack copy, which is why kiln
  stores the words float-typed. Weight copies are cycled as in ``gemv``.
* ``cpu-linear``: the same weight shapes at 1, 2 and 4 tokens, in fp32, bf16
  and each packed format: what few-token pieces ran before kiln's C linear
  kernel (Inductor's reduction; ``mm`` too for fp32 and bf16) against the
  kernel (``kiln.compiler.cpu_linear``), which each is checked against
  (``F.linear``, on the dequantized weight for the packed formats). Weight
  copies are cycled as in ``gemv``.
* ``many-rows``: fp32 linear layers at 16, 64 and 512 rows (a decode step of
  many requests, a prefill chunk) on the weight shapes of ``quant-kernels``
  plus the attention output projection: ``F.linear`` (MKL's sgemm, what
  Inductor's ``mm`` and ``addmm`` call) against oneDNN's matrix product with
  the weight as it is (which oneDNN reorders into its blocked layout on
  every call) and with the weight reordered once (``kiln::onednn_linear``,
  what kiln's many-row pieces call: ``kiln.compiler.onednn``). Reported in ms and GFLOP/s
  (2 x rows x out x in over time). Weight copies are cycled as in ``gemv``.
* ``step-linears``: every linear layer of a 135M-shape step (30 layers' q/k/v,
  o, gate/up and down weights, each its own tensor as in a model, so that a
  step streams 425 MB of fp32 layer weights, and the 49152-row LM head), by
  ``kiln::onednn_linear`` on reordered weights, as kiln's many-row pieces run
  them, at 16, 32, 48 and 64 rows (the decode steps of ``bench.decode
  --throughput 64``'s mixed lengths) and 512 (a prefill chunk); in fp32 and, where
  oneDNN has bf16 kernels, bf16. From them, the shortest time in which those
  64 requests could run if a step did nothing but its linears (prompt tokens
  at the 512-row rate, the LM head once per request for its prompt and once
  per decode row), and so the most output tokens/s any engine using these
  products could reach on this machine: what bounds that benchmark's ratio
  to transformers, whose time it does not bound.
* ``silu-mul``: the gated MLP's activation ``silu(gate) * up`` on the 135M
  shape's merged gate/up output ([rows, 2 x 1536]) at 1, 8, 64 and 512 rows,
  fp32 and bf16: Inductor's compiled function (its kernel and its Python
  wrapper, which exported code does without: compare the larger row counts)
  against kiln's C loop (``CpuLinearKernel.silu_mul``, what ``kiln::silu_mul``
  calls: ``kiln.compiler.activation``), each checked against the exact
  activation (max relative error in the JSON).
* ``huge-pages``: the parameters of SmolLM2-135M (fp32, 540 MB) placed by
  ``kiln.models.memory.materialize`` in 4 KiB pages and in transparent huge
  pages, each in a fresh process: seconds to place and fill them (one copy, as
  loading does), and the read bandwidth of summing every parameter, a decode
  step's memory traffic.

* ``decode-attention``: single-query attention over the paged KV cache at
  SmolLM2-135M's heads (9 query, 3 KV, head dim 64; block size 16; block tables
  a random permutation of a 4096-block cache), for 1 to 64 requests and 128 to
  512 tokens of context, one layer at a time, 8 layers' caches (800 MB) taken
  in turn so that each call reads from DRAM as in an engine's step: the
  torch backend's path (``index_select`` of each request's blocks, then one
  SDPA call over the padded copy) against the C kernel of
  ``kiln.attention.cpu_attention`` reading the cache in place. Each output is
  checked against the other first (max abs difference in the JSON). GB/s
  counts the context's K and V read once.

* ``prefill-attention``: one layer's attention of a prefill step at the same
  heads, fp32 and bf16, through the torch backend with and without the C
  kernel: its SDPA call a chunk (with its slicing and copy in Python, and the
  gather of a cached prefix's blocks) against the kernel's one call
  (``CpuAttentionKernel.prefill``; in bf16 here for every chunk, whatever
  ``native_prefill_bf16_pairs`` says). The prompts of the first prefill step
  of ``bench.decode --throughput 64`` (30 of 16-128 tokens), 8 of 512, one of
  2048, and 8 chunks of 256 tokens after 768 cached. The KV write is in both.
  Each output is checked against the other first.

Timings are medians over batches of back-to-back calls on the host clock
(``bench.common.harness.time_per_call``). Each benchmark writes its JSON to
``bench/results/<name>-cpu-<stamp>.json`` and ``<name>-cpu-latest.json``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.common.harness import time_per_call
from bench.common.models import SMOLLM2_135M_SHAPE
from bench.common.report import RESULTS_DIR, RunRecord, fmt, format_table, publish

BENCHMARKS = ("op-overhead", "gemv", "quant-kernels", "cpu-linear", "many-rows", "step-linears", "silu-mul",
              "huge-pages", "decode-attention", "prefill-attention")
SMOLLM2 = SMOLLM2_135M_SHAPE  # the decode shapes measured are this model's
HEAD_DIM = SMOLLM2["hidden_size"] // SMOLLM2["num_attention_heads"]
# name -> [out_features, in_features] of SmolLM2-135M's linear layers
GEMV_WEIGHTS: dict[str, tuple[int, int]] = {
    "lm_head": (SMOLLM2["vocab_size"], SMOLLM2["hidden_size"]),
    "gate_up": (2 * SMOLLM2["intermediate_size"], SMOLLM2["hidden_size"]),
    "down": (SMOLLM2["hidden_size"], SMOLLM2["intermediate_size"]),
}
GEMV_TOKENS = (1, 2, 4)
# the attention input projection too (q, k and v side by side) for the quantized forms
QUANT_WEIGHTS: dict[str, tuple[int, int]] = {
    **GEMV_WEIGHTS,
    "qkv": (SMOLLM2["hidden_size"] + 2 * SMOLLM2["num_key_value_heads"] * HEAD_DIM, SMOLLM2["hidden_size"]),
}
QUANT_TOKENS = (1, 4)
MANY_ROWS_WEIGHTS: dict[str, tuple[int, int]] = {
    **QUANT_WEIGHTS, "o_proj": (SMOLLM2["hidden_size"], SMOLLM2["hidden_size"])}
MANY_ROWS_TOKENS = (16, 64, 512)
ROTATION_BYTES = 256 * 2**20  # weight copies cycled through per case: more than the last-level cache


# -------------------------------------------------------------------- op overhead


@functools.cache
def custom_op_attention() -> Callable[..., None]:
    """kiln's attention implementation registered the other way, with
    ``@torch.library.custom_op`` (as ``kiln_bench::attention``)."""
    from kiln.attention.op import EAGER_IMPLEMENTATIONS

    impl = EAGER_IMPLEMENTATIONS["kiln::attention"]

    @torch.library.custom_op("kiln_bench::attention", mutates_args=("out",))
    def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
                  layer_idx: int, scale: float, sliding_window: int) -> None:
        impl(query, key, value, out, layer_idx, scale, sliding_window)

    return torch.ops.kiln_bench.attention


def _op_calls() -> dict[str, tuple[str, Callable[..., None]]]:
    """name -> (what is called, the callable), all with kiln's op signature."""
    from kiln.attention.op import EAGER_IMPLEMENTATIONS, attend

    return {
        "direct": ('EAGER_IMPLEMENTATIONS["kiln::attention"](...)', EAGER_IMPLEMENTATIONS["kiln::attention"]),
        "attend": ("kiln.attention.op.attend(...) (eager model code)", attend),
        "dispatcher": ("torch.ops.kiln.attention(...) (torch.library.Library)", torch.ops.kiln.attention),
        "custom_op": ("torch.ops.kiln_bench.attention(...) (@torch.library.custom_op)", custom_op_attention()),
    }


def measure_op_overhead(repeats: int, batch_seconds: float) -> list[dict[str, Any]]:
    """Microseconds per call of each way of calling the attention op, in a forward
    context without metadata (the implementation only zeroes ``out``)."""
    from kiln.forward_context import ForwardContext, set_forward_context

    q = torch.randn(1, SMOLLM2["num_attention_heads"], HEAD_DIM)
    k = torch.randn(1, SMOLLM2["num_key_value_heads"], HEAD_DIM)
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    scale = HEAD_DIM**-0.5
    rows = []
    with set_forward_context(ForwardContext(attn_metadata=None, kv_caches=[])), torch.inference_mode():
        for name, (call, fn) in _op_calls().items():
            t = time_per_call(lambda fn=fn: fn(q, k, v, out, 0, scale, 0), repeats=repeats,
                              min_batch_seconds=batch_seconds)
            rows.append({"name": name, "call": call, **_in_us(t)})
    direct = rows[0]["median_us"]
    for r in rows:
        r["over_direct_us"] = r["median_us"] - direct
        r["over_direct_per_step_us"] = r["over_direct_us"] * SMOLLM2["num_hidden_layers"]
    return rows


def _in_us(timing: dict[str, Any]) -> dict[str, Any]:
    """A :func:`time_per_call` result with its times (``*_ms``) in microseconds (``*_us``)."""
    out: dict[str, Any] = {}
    for key, value in timing.items():
        if key.endswith("_ms"):
            out[key.removesuffix("_ms") + "_us"] = value * 1e3
        else:
            out[key] = value
    return out


def op_overhead_report(args: argparse.Namespace) -> dict[str, Any]:
    record = RunRecord("op-overhead", "cpu")
    rows = measure_op_overhead(args.repeats, 0.01 if args.smoke else 0.2)
    return {
        **record.head(),
        "settings": {
            "smoke": args.smoke,
            "shapes": {"query": [1, SMOLLM2["num_attention_heads"], HEAD_DIM],
                       "key_value": [1, SMOLLM2["num_key_value_heads"], HEAD_DIM], "dtype": "float32"},
            "forward_context": "attn_metadata None: the implementation zeroes out and returns",
            "grad_mode": "torch.inference_mode, as kiln's runner",
            "layers_per_step": SMOLLM2["num_hidden_layers"],
            "statistic": "median over batches of the per-call time; over_direct: minus the direct call's median",
        },
        "results": rows,
        "dispatcher_over_direct_us": next(r["over_direct_us"] for r in rows if r["name"] == "dispatcher"),
        "custom_op_over_direct_us": next(r["over_direct_us"] for r in rows if r["name"] == "custom_op"),
    }


def render_op_overhead(report: dict[str, Any]) -> str:
    layers = report["settings"]["layers_per_step"]
    rows = [[r["name"], r["call"], fmt(r["median_us"]), fmt(r["p20_us"]), fmt(r["p80_us"]),
             fmt(r["over_direct_us"]), fmt(r["over_direct_per_step_us"], 1)] for r in report["results"]]
    return "\n".join([
        f"attention op call overhead (CPU, decode shapes of SmolLM2-135M, {report['machine']['torch_threads']} "
        "threads); the op only zeroes out",
        "",
        format_table(["way", "call", "median us", "p20 us", "p80 us", "over direct us",
                      f"x {layers} layers us"], rows),
    ])


# --------------------------------------------------------------------------- gemv


def gemv_reduction(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` as a broadcast multiply and a sum over the inner
    dimension: the form Inductor turns into a vectorised, thread-split loop."""
    return (x[:, None, :] * weight).sum(-1)


def _rotating(weights: list[torch.Tensor]) -> Callable[[], torch.Tensor]:
    """A function returning the next weight copy each call."""
    cycle = itertools.cycle(weights)
    return lambda: next(cycle)


def measure_gemv_case(name: str, shape: tuple[int, int], tokens: int, repeats: int,
                      batch_seconds: float) -> dict[str, Any]:
    """``F.linear`` against the compiled reduction on one weight shape and token
    count; both cycle through the same weight copies."""
    weight_bytes = math.prod(shape) * 4
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=gen) * 0.02
               for _ in range(max(1, math.ceil(ROTATION_BYTES / weight_bytes)))]
    x = torch.randn(tokens, shape[1], generator=gen)
    torch.compiler.reset()  # a fresh compile per case: no recompile limit, no dynamic shapes
    compiled = torch.compile(gemv_reduction, dynamic=False, fullgraph=True)
    with torch.inference_mode():
        t0 = time.perf_counter()
        got = compiled(x, weights[0])
        compile_seconds = time.perf_counter() - t0
        error = float((got - F.linear(x, weights[0])).abs().max())
        nxt = _rotating(weights)
        mm = time_per_call(lambda: F.linear(x, nxt()), repeats=repeats, min_batch_seconds=batch_seconds)
        red = time_per_call(lambda: compiled(x, nxt()), repeats=repeats, min_batch_seconds=batch_seconds)
    for t in (mm, red):
        t["gb_per_s"] = weight_bytes / (t["median_ms"] / 1e3) / 1e9
    return {"weight": name, "shape": list(shape), "tokens": tokens, "weight_bytes": weight_bytes,
            "weight_copies": len(weights), "mm": {"call": "F.linear(x, W)", **mm},
            "reduction": {"call": "torch.compile((x[:, None, :] * W).sum(-1))", **red,
                          "compile_seconds": compile_seconds, "max_abs_error_vs_mm": error},
            "mm_over_reduction_time": mm["median_ms"] / red["median_ms"]}


def _linear_cases(args: argparse.Namespace, label: str, weights: dict[str, tuple[int, int]],
                  tokens: Sequence[int], measure: Callable[..., dict[str, Any]]) -> list[dict[str, Any]]:
    """``measure(name, shape, tokens, repeats, batch_seconds)`` for every weight
    and token count (``--smoke``: the down projection at the first count)."""
    if args.smoke:
        weights, tokens = {"down": weights["down"]}, tokens[:1]
    results = []
    for (name, shape), n in itertools.product(weights.items(), tokens):
        print(f"{label} {name} {list(shape)} x {n} tokens ...", file=sys.stderr, flush=True)
        results.append(measure(name, shape, n, args.repeats, 0.02 if args.smoke else 0.1))
    return results


def gemv_report(args: argparse.Namespace) -> dict[str, Any]:
    record = RunRecord("gemv", "cpu")
    results = _linear_cases(args, "gemv", GEMV_WEIGHTS, GEMV_TOKENS, measure_gemv_case)
    return {
        **record.head(),
        "settings": {
            "smoke": args.smoke,
            "dtype": "float32",
            "threads": torch.get_num_threads(),
            "rotation_bytes": ROTATION_BYTES,
            "statistic": "median over batches of the per-call time; GB/s = weight bytes / median time",
            "compile": "torch.compile(dynamic=False, fullgraph=True), default Inductor mode, one per case; "
                       "compile_seconds is its first call, which Inductor's on-disk cache may serve",
            "grad_mode": "torch.inference_mode, as kiln's runner",
        },
        "results": results,
    }


def render_gemv(report: dict[str, Any]) -> str:
    rows = [[r["weight"], "x".join(map(str, r["shape"])), str(r["tokens"]),
             fmt(r["mm"]["median_ms"], 3), fmt(r["mm"]["gb_per_s"], 1),
             fmt(r["reduction"]["median_ms"], 3), fmt(r["reduction"]["gb_per_s"], 1),
             fmt(r["mm_over_reduction_time"], 2, "x"), f"{r['reduction']['max_abs_error_vs_mm']:.1e}"]
            for r in report["results"]]
    return "\n".join([
        f"small-batch linear, fp32, CPU, {report['settings']['threads']} threads; weights cycled through "
        f"{report['settings']['rotation_bytes'] // 2**20} MiB of copies",
        "",
        format_table(["weight", "shape", "tokens", "mm ms", "mm GB/s", "reduction ms", "reduction GB/s",
                      "mm / reduction", "max abs err"], rows),
    ])


# -------------------------------------------------------------------- quant kernels


def packings() -> dict[str, Any]:
    """kiln's packed layouts (``kiln.models.quant.FORMATS`` without the
    ``-a8`` modes, which store the same words and round the activations):
    the weights measured here take fp32 activations."""
    from kiln.models.quant import FORMATS

    return {name: f for name, f in FORMATS.items() if not f.round_activations}


def quant_forms() -> dict[str, tuple[str, str]]:
    """name -> (kiln.models.quant format, what its words are passed as): the
    packed forms measured against the fp32 reduction."""
    return {**{name: (name, "float32") for name in packings()}, "q8_0 int32 words": ("q8_0", "int32")}


def quantized_weight(fmt_name: str, weight: torch.Tensor, gen: torch.Generator) -> Any:
    """A ``kiln.checkpoint.QuantizedTensor`` of ``weight``'s shape in format
    ``fmt_name``: ``weight`` quantized for int8; random integers and scales
    (weights of about ``weight``'s magnitude) for the GGUF formats."""
    from kiln.checkpoint import QuantizedTensor
    from kiln.models.quant import quantize_int8

    n, k = weight.shape
    if fmt_name == "int8":
        return quantize_int8(weight)
    if fmt_name == "q8_0":
        values = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        return QuantizedTensor(values, torch.rand(n, k // 32, generator=gen) * 4e-4, None, 8, "Q8_0")
    values = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    return QuantizedTensor(values, torch.rand(n, k // 32, generator=gen) * 4e-3,
                           torch.randn(n, k // 32, generator=gen) * 0.02, 4, "Q4_1")


def _copies(tensors: Sequence[torch.Tensor | None], nbytes: int) -> list[tuple[torch.Tensor | None, ...]]:
    """``tensors`` and clones of them (None stays None), filling ``ROTATION_BYTES``."""
    clones = [tuple(None if t is None else t.clone() for t in tensors)
              for _ in range(max(1, math.ceil(ROTATION_BYTES / nbytes)) - 1)]
    return [tuple(tensors), *clones]


def measure_quant_form(fn: Callable[..., torch.Tensor], x: torch.Tensor, copies: list[tuple[Any, ...]],
                       reference: torch.Tensor, nbytes: int, repeats: int, batch_seconds: float) -> dict[str, Any]:
    """``fn(x, *copy)`` compiled afresh, timed cycling through ``copies``, and
    its largest error against ``reference`` (the result for ``copies[0]``)."""
    torch.compiler.reset()  # a fresh compile per form: no recompile limit, no dynamic shapes
    compiled = torch.compile(fn, dynamic=False, fullgraph=True)
    t0 = time.perf_counter()
    got = compiled(x, *copies[0])
    compile_seconds = time.perf_counter() - t0
    nxt = itertools.cycle(copies)
    t = time_per_call(lambda: compiled(x, *next(nxt)), repeats=repeats, min_batch_seconds=batch_seconds)
    return {**t, "bytes": nbytes, "copies": len(copies), "gb_per_s": nbytes / (t["median_ms"] / 1e3) / 1e9,
            "compile_seconds": compile_seconds, "max_abs_error": float((got - reference).abs().max())}


def measure_quant_case(name: str, shape: tuple[int, int], tokens: int, repeats: int,
                       batch_seconds: float) -> dict[str, Any]:
    """The fp32 reduction and each packed form on one weight shape and token count."""
    from kiln.models.quant import FORMATS, dequantize, pack, reduction

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=gen) * 0.02
    x = torch.randn(tokens, shape[1], generator=gen)
    forms = []
    with torch.inference_mode():
        fp32_bytes = math.prod(shape) * 4
        base = measure_quant_form(gemv_reduction, x, _copies([weight], fp32_bytes), F.linear(x, weight),
                                  fp32_bytes, repeats, batch_seconds)
        forms.append({"form": "fp32", "call": "torch.compile((x[:, None, :] * W).sum(-1))",
                      "error_vs": "x @ W.T", **base})
        packed = {f: pack(quantized_weight(f, weight, gen), fmt_) for f, fmt_ in packings().items()}
        for form, (f, words_as) in quant_forms().items():
            fmt_ = FORMATS[f]
            words, scales, offsets = packed[f]
            reference = x @ dequantize(words, scales, offsets, fmt_).T
            if words_as == "int32":
                words = words.view(torch.int32)
            nbytes = fmt_.nbytes(*shape)
            t = measure_quant_form(lambda x, w, s, o, fmt_=fmt_: reduction(x, w, s, o, fmt_), x,
                                   _copies([words, scales, offsets], nbytes), reference, nbytes,
                                   repeats, batch_seconds)
            forms.append({"form": form, "format": f, "words_dtype": words_as,
                          "call": f"torch.compile(kiln.models.quant.reduction(x, words, scales, offsets, '{f}'))",
                          "error_vs": "x @ dequantize(words, scales, offsets, fmt).T", **t})
    for r in forms:
        r["speedup_vs_fp32"] = base["median_ms"] / r["median_ms"]
    return {"weight": name, "shape": list(shape), "tokens": tokens, "forms": forms}


def quant_kernels_report(args: argparse.Namespace) -> dict[str, Any]:
    record = RunRecord("quant-kernels", "cpu")
    results = _linear_cases(args, "quant-kernels", QUANT_WEIGHTS, QUANT_TOKENS, measure_quant_case)
    return {
        **record.head(),
        "settings": {
            "smoke": args.smoke,
            "activations": "float32",
            "threads": torch.get_num_threads(),
            "rotation_bytes": ROTATION_BYTES,
            "weights": "fp32 randn * 0.02; int8 is quantize_int8 of it; q8_0 and q4 random integers, "
                       "scales and offsets of about that magnitude, packed by kiln.models.quant.pack",
            "statistic": "median over batches of the per-call time; GB/s = bytes read (packed: "
                         "QuantFormat.nbytes) / median time; speedup = fp32 median / median",
            "compile": "torch.compile(dynamic=False, fullgraph=True), default Inductor mode, one per form and "
                       "case; compile_seconds is its first call, which Inductor's on-disk cache may serve",
            "grad_mode": "torch.inference_mode, as kiln's runner",
        },
        "results": results,
    }


def render_quant_kernels(report: dict[str, Any]) -> str:
    rows = [[r["weight"], "x".join(map(str, r["shape"])), str(r["tokens"]), f["form"], fmt(f["bytes"] / 1e6, 2),
             fmt(f["median_ms"], 3), fmt(f["gb_per_s"], 1), fmt(f["speedup_vs_fp32"], 2, "x"),
             f"{f['max_abs_error']:.1e}"]
            for r in report["results"] for f in r["forms"]]
    return "\n".join([
        f"small-batch linear on packed quantized weights, CPU, {report['settings']['threads']} threads; "
        f"weights cycled through {report['settings']['rotation_bytes'] // 2**20} MiB of copies",
        "",
        format_table(["weight", "shape", "tokens", "form", "MB", "ms", "GB/s", "speedup vs fp32",
                      "max abs err"], rows),
    ])


# ---------------------------------------------------------------------------- huge pages
HUGE_PAGES_CHILD = r"""
import json, sys, time, torch
import kiln.models.memory as memory
from kiln.models import config_from_dict
from kiln.models.registry import ARCHITECTURES
torch.set_num_threads(int(sys.argv[2]))
shape = json.loads(sys.argv[3])
config = config_from_dict({**shape, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
with torch.device("meta"):
    model = ARCHITECTURES[config.architecture].model_class(config, 64)
t0 = time.perf_counter()
model = memory.materialize(model, torch.device("cpu"), torch.float32)
params = list(model.parameters())
for p in params:
    p.fill_(0.5)
fill = time.perf_counter() - t0
collapse = 0.0
if sys.argv[1] == "huge":  # what a load starts in the background (kiln.models.memory)
    t0 = time.perf_counter()
    memory.collapse_to_huge_pages(model).join()
    collapse = time.perf_counter() - t0
nbytes = sum(p.numel() * 4 for p in params)
passes = []
for _ in range(int(sys.argv[4])):
    t0 = time.perf_counter()
    for p in params:
        p.sum()
    passes.append(time.perf_counter() - t0)
print(json.dumps({"place_and_fill_seconds": fill, "collapse_seconds": collapse, "bytes": nbytes,
                  "read_seconds": sorted(passes)[len(passes) // 2]}))
"""


def huge_pages_report(args: argparse.Namespace) -> dict[str, Any]:
    import json
    import subprocess

    record = RunRecord("huge-pages", "cpu")
    passes = 5 if args.smoke else 21
    runs: dict[str, list[dict[str, Any]]] = {"4k": [], "huge": []}
    for _ in range(1 if args.smoke else 3):
        for mode in runs:  # turns, each a fresh process (fresh memory is what a load gets)
            out = subprocess.run([sys.executable, "-c", HUGE_PAGES_CHILD, mode, str(args.threads),
                                  json.dumps(SMOLLM2), str(passes)], capture_output=True, text=True, check=True)
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    result = {}
    for mode, rs in runs.items():
        read = sorted(r["read_seconds"] for r in rs)[len(rs) // 2]
        result[mode] = {"place_and_fill_seconds": round(sorted(r["place_and_fill_seconds"] for r in rs)[len(rs) // 2], 4),
                        "collapse_seconds": round(sorted(r["collapse_seconds"] for r in rs)[len(rs) // 2], 4),
                        "read_gb_per_s": round(rs[0]["bytes"] / read / 1e9, 2), "bytes": rs[0]["bytes"],
                        "runs": rs}
    return {**record.head(torch_threads=args.threads), "results": result}


def render_huge_pages(report: dict[str, Any]) -> str:
    rows = [[mode, fmt(r["place_and_fill_seconds"], 3), fmt(r["read_gb_per_s"], 1)]
            for mode, r in report["results"].items()]
    return "SmolLM2-135M parameters (fp32) in 4 KiB and huge pages\n\n" + format_table(
        ["pages", "place + fill, s", "read GB/s"], rows)


# --------------------------------------------------------------- decode attention

# (requests, mean context tokens, step): with a step, the requests' lengths fall
# by it from the first to the last, as a server's batch holds its oldest requests
# first (64 at 355: 670, 660, ..., 40)
DECODE_CASES = ((1, 128, 0), (1, 512, 0), (16, 256, 0), (64, 192, 0), (64, 512, 0), (64, 355, 10))
DECODE_BLOCK_SIZE, DECODE_CACHE_BLOCKS = 16, 4096
# Layers' caches the timed calls take in turn (100 MB each in fp32): an engine's
# step reads each layer's keys and values once, from DRAM, not one layer's
# over and over from the CPU's caches.
DECODE_LAYERS = 8


def _decode_lengths(requests: int, context: int, step: int) -> list[int]:
    """Each request's context: ``context`` each, or falling by ``step`` around it."""
    return [context + round(step * ((requests - 1) / 2 - i)) for i in range(requests)]


def _decode_case(lengths: list[int], gen: torch.Generator, layers: int = 1) -> dict[str, Any]:
    """One step's decode requests of these context lengths and ``layers``
    caches (``kv_cache``: the first) holding their keys and values at the same
    blocks."""
    from kiln.attention.cpu_attention import DecodeStep

    heads, kv_heads = SMOLLM2["num_attention_heads"], SMOLLM2["num_key_value_heads"]
    requests, blocks = len(lengths), -(-max(lengths) // DECODE_BLOCK_SIZE)
    caches = [torch.randn(2, DECODE_CACHE_BLOCKS, DECODE_BLOCK_SIZE, kv_heads, HEAD_DIM, generator=gen)
              for _ in range(layers)]
    table = torch.randperm(DECODE_CACHE_BLOCKS, generator=gen)[: requests * blocks].view(requests, blocks)
    lens = torch.tensor(lengths, dtype=torch.int32)
    # the attention alone: no new tokens to write
    step = DecodeStep(torch.arange(requests), table.to(torch.int32).contiguous(), lens,
                      torch.empty(0, dtype=torch.int64), 0)
    return {"query": torch.randn(requests, heads, HEAD_DIM, generator=gen), "kv_cache": caches[0], "caches": caches,
            "table": table, "step": step, "new_kv": torch.empty(0, kv_heads, HEAD_DIM),
            "valid": (torch.arange(blocks * DECODE_BLOCK_SIZE) < lens[:, None]).view(requests, 1, 1, -1)}


def _torch_decode(c: dict[str, Any]) -> torch.Tensor:
    """The torch backend's batched decode path, as ``_decode_attention`` runs it."""
    q, kv, table = c["query"], c["kv_cache"], c["table"]
    b, kv_heads = q.shape[0], kv.shape[-2]
    flat = table.reshape(-1)
    k = kv[0].index_select(0, flat).view(b, -1, kv_heads, HEAD_DIM).transpose(1, 2)
    v = kv[1].index_select(0, flat).view(b, -1, kv_heads, HEAD_DIM).transpose(1, 2)
    o = F.scaled_dot_product_attention(q.view(b, kv_heads, -1, HEAD_DIM), k, v, attn_mask=c["valid"],
                                       scale=HEAD_DIM ** -0.5)
    return o.reshape(q.shape)


def decode_attention_report(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    from kiln.attention.cpu_attention import CpuAttentionKernel, build_cpu_attention

    record = RunRecord("decode-attention", "cpu")
    gen = torch.Generator().manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kiln-bench-kernel-") as tmp:
        kernel = CpuAttentionKernel(Path(tmp) / build_cpu_attention(Path(tmp)))
        for requests, context, step in DECODE_CASES[:1] if args.smoke else DECODE_CASES:
            lengths = _decode_lengths(requests, context, step)
            c = _decode_case(lengths, gen, layers=1 if args.smoke else DECODE_LAYERS)
            out = torch.empty_like(c["query"])
            layer = itertools.cycle(c["caches"])

            def native(c: dict[str, Any] = c, out: torch.Tensor = out, layer: Any = layer) -> None:
                kernel.layer(c["query"], c["new_kv"], c["new_kv"], out, next(layer), c["step"], HEAD_DIM ** -0.5, 0)

            def reference(c: dict[str, Any] = c, layer: Any = layer) -> torch.Tensor:
                return _torch_decode({**c, "kv_cache": next(layer)})

            if not kernel.layer(c["query"], c["new_kv"], c["new_kv"], out, c["kv_cache"], c["step"], HEAD_DIM ** -0.5,
                                0):
                raise RuntimeError("the decode-attention kernel refused the benchmark's tensors")
            error = (out - _torch_decode(c)).abs().max().item()
            timed = {name: time_per_call(fn, repeats=args.repeats, min_batch_seconds=0.01 if args.smoke else 0.2)
                     for name, fn in (("torch", reference), ("kernel", native))}
            kv_bytes = 2 * sum(lengths) * c["kv_cache"].shape[-2] * HEAD_DIM * 4
            rows.append({"requests": requests, "context": context, "falling_by": step, "max_abs_difference": error,
                         "kv_bytes": kv_bytes, **{f"{n}_ms": t["median_ms"] for n, t in timed.items()},
                         **{f"{n}_gb_per_s": kv_bytes / t["median_ms"] / 1e6 for n, t in timed.items()},
                         "speedup": timed["torch"]["median_ms"] / timed["kernel"]["median_ms"], "timings": timed})
    return {**record.head(torch_threads=args.threads),
            "settings": {"heads": SMOLLM2["num_attention_heads"], "kv_heads": SMOLLM2["num_key_value_heads"],
                         "head_dim": HEAD_DIM, "block_size": DECODE_BLOCK_SIZE, "cache_blocks": DECODE_CACHE_BLOCKS,
                         "layers_in_turn": 1 if args.smoke else DECODE_LAYERS,
                         "dtype": "float32", "smoke": args.smoke, "statistic": "median over batches"},
            "results": rows}


def _context_label(row: dict[str, Any]) -> str:
    lengths = _decode_lengths(row["requests"], row["context"], row.get("falling_by", 0))
    return str(row["context"]) if lengths[0] == lengths[-1] else f"{row['context']} ({lengths[0]}..{lengths[-1]})"


def render_decode_attention(report: dict[str, Any]) -> str:
    rows = [[str(r["requests"]), _context_label(r), fmt(r["torch_ms"], 3), fmt(r["kernel_ms"], 3), fmt(r["speedup"], 2),
             fmt(r["torch_gb_per_s"], 1), fmt(r["kernel_gb_per_s"], 1), f"{r['max_abs_difference']:.1e}"]
            for r in report["results"]]
    return "decode attention, one layer of SmolLM2-135M's heads (fp32, paged cache)\n\n" + format_table(
        ["requests", "context", "torch ms", "C kernel ms", "speedup", "torch GB/s", "kernel GB/s", "max diff"], rows)


# name -> (chunk lengths, their contexts): the prompts of bench.decode --throughput 64's first prefill step
# (prompt lengths 128 x 1, 1/8, 1/2, 1/4, 3/4 cycled, up to 2048 tokens), 8 of 512, one of 2048, and 8
# chunks of 256 tokens after 768 cached (a prefix cache's hit, or a long prompt's later chunk)
PREFILL_CASES = {"first step of 64 mixed requests": ([128, 16, 64, 32, 96] * 6, [128, 16, 64, 32, 96] * 6),
                 "8 x 512": ([512] * 8, [512] * 8), "1 x 2048": ([2048], [2048]),
                 "8 x 256 after 768 cached": ([256] * 8, [1024] * 8)}
PREFILL_BLOCK_SIZE = 16


def _prefill_step(q_lens: list[int], seq_lens: list[int], dtype: torch.dtype, gen: torch.Generator) -> dict[str, Any]:
    """One layer's prefill step of these chunks as a runner hands it to the attention backend: the metadata (block
    tables a random permutation of the cache's blocks), the cache, the queries and the new keys and values."""
    import numpy as np

    from kiln.attention.backend import CommonAttentionMetadata

    heads, kv_heads = SMOLLM2["num_attention_heads"], SMOLLM2["num_key_value_heads"]
    bs = PREFILL_BLOCK_SIZE
    per = [-(-n // bs) for n in seq_lens]
    perm = torch.randperm(sum(per), generator=gen)
    table = torch.zeros(len(q_lens), max(per), dtype=torch.int32)
    slots, used = [], 0
    for i, (q, n) in enumerate(zip(q_lens, seq_lens)):
        table[i, : per[i]] = perm[used : used + per[i]]
        used += per[i]
        slots += [int(table[i, p // bs]) * bs + p % bs for p in range(n - q, n)]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    common = CommonAttentionMetadata(
        num_actual_tokens=int(qsl[-1]), num_reqs=len(q_lens), max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_start_loc=torch.from_numpy(qsl), seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc_cpu=qsl,
        seq_lens_cpu=np.asarray(seq_lens, dtype=np.int32), block_size=bs)
    tokens = int(qsl[-1])
    return {"common": common, "kv_cache": torch.randn(2, sum(per), bs, kv_heads, HEAD_DIM, generator=gen).to(dtype),
            **{name: torch.randn(tokens, h, HEAD_DIM, generator=gen).to(dtype)
               for name, h in (("query", heads), ("key", kv_heads), ("value", kv_heads))}}


def prefill_attention_report(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    from kiln.attention.cpu_attention import CpuAttentionKernel, build_cpu_attention
    from kiln.attention.torch_backend import TorchAttentionBackend

    record = RunRecord("prefill-attention", "cpu")
    gen = torch.Generator().manual_seed(0)
    heads, scale = SMOLLM2["num_attention_heads"], HEAD_DIM ** -0.5
    cases = dict(list(PREFILL_CASES.items())[:1]) if args.smoke else PREFILL_CASES
    rows = []
    with tempfile.TemporaryDirectory(prefix="kiln-bench-kernel-") as tmp:
        kernel = CpuAttentionKernel(Path(tmp) / build_cpu_attention(Path(tmp)))
        if not kernel.prefills:
            raise RuntimeError("this CPU's build of the attention kernel has no prefill (it needs AVX-512)")
        torch_path = TorchAttentionBackend()
        with_kernel = TorchAttentionBackend(kernel)
        with_kernel.native_prefill_bf16_pairs = 1 << 62  # every chunk to the kernel, to time it in bf16 too
        for name, (q_lens, seq_lens) in cases.items():
            for dtype in (torch.float32, torch.bfloat16):
                c = _prefill_step(q_lens, seq_lens, dtype, gen)
                outs = {}
                calls = {}
                for label, backend in (("torch", torch_path), ("kernel", with_kernel)):
                    meta = backend.build_metadata(c["common"])
                    out = outs[label] = torch.empty_like(c["query"])

                    def call(backend: Any = backend, meta: Any = meta, out: torch.Tensor = out) -> None:
                        backend.forward(c["query"], c["key"], c["value"], out, c["kv_cache"], meta, scale, 0)

                    call()
                    calls[label] = call
                if len(with_kernel.build_metadata(c["common"]).prefill) != len(q_lens):
                    raise RuntimeError("the prefill-attention kernel did not take every chunk of the benchmark")
                error = (outs["kernel"].float() - outs["torch"].float()).abs().max().item()
                timed = {label: time_per_call(fn, repeats=args.repeats, min_batch_seconds=0.01 if args.smoke else 0.2)
                         for label, fn in calls.items()}
                # the products of each query with the keys it sees, QK and PV
                flops = sum(4 * (q * (n - q) + q * (q + 1) // 2) * heads * HEAD_DIM for q, n in zip(q_lens, seq_lens))
                rows.append({"case": name, "chunks": len(q_lens), "tokens": sum(q_lens),
                             "dtype": str(dtype).removeprefix("torch."), "max_abs_difference": error,
                             **{f"{n}_ms": t["median_ms"] for n, t in timed.items()},
                             **{f"{n}_gflop_per_s": flops / t["median_ms"] / 1e6 for n, t in timed.items()},
                             "speedup": timed["torch"]["median_ms"] / timed["kernel"]["median_ms"],
                             "timings": timed})
    return {**record.head(torch_threads=args.threads),
            "settings": {"heads": heads, "kv_heads": SMOLLM2["num_key_value_heads"], "head_dim": HEAD_DIM,
                         "block_size": PREFILL_BLOCK_SIZE, "smoke": args.smoke, "statistic": "median over batches",
                         "cases": {n: {"chunks": q, "contexts": k} for n, (q, k) in cases.items()}},
            "results": rows}


def render_prefill_attention(report: dict[str, Any]) -> str:
    rows = [[r["case"], r["dtype"], fmt(r["torch_ms"], 3), fmt(r["kernel_ms"], 3), fmt(r["speedup"], 2),
             fmt(r["torch_gflop_per_s"], 0), fmt(r["kernel_gflop_per_s"], 0), f"{r['max_abs_difference']:.1e}"]
            for r in report["results"]]
    return ("prefill attention, one layer of SmolLM2-135M's heads through the torch backend: its SDPA call a chunk "
            "against the C kernel (GFLOP/s: the pairs each query sees)\n\n"
            + format_table(["chunks", "dtype", "SDPA ms", "C kernel ms", "speedup", "SDPA GFLOP/s",
                            "kernel GFLOP/s", "max diff"], rows))


# ---------------------------------------------------------------------------- cpu linear
CPU_LINEAR_WEIGHTS = {k: QUANT_WEIGHTS[k] for k in ("lm_head", "gate_up", "down", "qkv")}


def _kernel_form(kernel: Any, kind: str, x: torch.Tensor, copies: list[tuple[Any, ...]], reference: torch.Tensor,
                 nbytes: int, repeats: int, batch_seconds: float) -> dict[str, Any]:
    """The C kernel on ``x`` and each copy's (weight, scales, offsets) in turn."""
    got = kernel(x, copies[0][0], copies[0][1], copies[0][2], None, kind)
    nxt = itertools.cycle(copies)

    def call() -> None:
        w, sc, off = next(nxt)
        kernel(x, w, sc, off, None, kind)

    t = time_per_call(call, repeats=repeats, min_batch_seconds=batch_seconds)
    return {**t, "bytes": nbytes, "copies": len(copies), "gb_per_s": nbytes / (t["median_ms"] / 1e3) / 1e9,
            "max_abs_error": float((got.float() - reference.float()).abs().max())}


def measure_cpu_linear_case(kernel: Any, name: str, shape: tuple[int, int], tokens: int, repeats: int,
                            batch_seconds: float) -> dict[str, Any]:
    """For fp32, bf16 and each packed format: what kiln ran before the C kernel
    (Inductor's reduction, or ``mm`` for bf16) against the kernel."""
    from kiln.models.quant import dequantize, pack, reduction

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=gen) * 0.02
    x = torch.randn(tokens, shape[1], generator=gen)
    rows = []
    with torch.inference_mode():
        for dtype, kind in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
            w, xd = weight.to(dtype), x.to(dtype)
            nbytes = math.prod(shape) * w.element_size()
            copies = [(c[0], None, None) for c in _copies([w], nbytes)]
            ref = F.linear(xd.float(), w.float())
            inductor = measure_quant_form(gemv_reduction, xd, [c[:1] for c in copies], ref.to(dtype), nbytes,
                                          repeats, batch_seconds)
            nxt = itertools.cycle(copies)
            mm = time_per_call(lambda: F.linear(xd, next(nxt)[0]), repeats=repeats, min_batch_seconds=batch_seconds)
            rows.append({"form": kind, "inductor_reduction": inductor, "mm": mm,
                         "kernel": _kernel_form(kernel, kind, xd, copies, ref, nbytes, repeats, batch_seconds)})
        for f, fmt_ in packings().items():
            words, scales, offsets = pack(quantized_weight(f, weight, gen), fmt_)
            ref = x @ dequantize(words, scales, offsets, fmt_).T
            nbytes = fmt_.nbytes(*shape)
            copies = _copies([words, scales, offsets], nbytes)
            inductor = measure_quant_form(lambda x, w, s, o, fmt_=fmt_: reduction(x, w, s, o, fmt_), x, copies,
                                          ref, nbytes, repeats, batch_seconds)
            rows.append({"form": f, "inductor_reduction": inductor,
                         "kernel": _kernel_form(kernel, f, x, copies, ref, nbytes, repeats, batch_seconds)})
    for r in rows:
        r["kernel_speedup"] = r["inductor_reduction"]["median_ms"] / r["kernel"]["median_ms"]
    return {"weight": name, "shape": list(shape), "tokens": tokens, "forms": rows}


def cpu_linear_report(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    from kiln.compiler import cpu_linear

    record = RunRecord("cpu-linear", "cpu")
    with tempfile.TemporaryDirectory(prefix="kiln-bench-kernel-") as tmp:
        kernel = cpu_linear.CpuLinearKernel(Path(tmp) / cpu_linear.SOURCE.build(Path(tmp)))
        results = _linear_cases(args, "cpu-linear", CPU_LINEAR_WEIGHTS, GEMV_TOKENS,
                                functools.partial(measure_cpu_linear_case, kernel))
    return {
        **record.head(),
        "settings": {
            "smoke": args.smoke, "activations": "float32 (bf16 for the bf16 form)",
            "threads": torch.get_num_threads(), "rotation_bytes": ROTATION_BYTES,
            "kernel": "kiln/compiler/cpu_linear.c through kiln.compiler.cpu_linear.CpuLinearKernel (ctypes)",
            "statistic": "median over batches of the per-call time; GB/s = weight bytes (packed: "
                         "QuantFormat.nbytes) / median time; kernel_speedup = Inductor's median / the kernel's",
            "compile": "torch.compile(dynamic=False, fullgraph=True) of the reduction, one per form and case",
        },
        "results": results,
    }


def render_cpu_linear(report: dict[str, Any]) -> str:
    rows = []
    for r in report["results"]:
        for f in r["forms"]:
            ind, ker = f["inductor_reduction"], f["kernel"]
            rows.append([r["weight"], "x".join(map(str, r["shape"])), str(r["tokens"]), f["form"],
                         fmt(ind["median_ms"], 3), fmt(f["mm"]["median_ms"], 3) if "mm" in f else "-",
                         fmt(ker["median_ms"], 3), fmt(ker["gb_per_s"], 1), fmt(f["kernel_speedup"], 2, "x"),
                         f"{ker['max_abs_error']:.1e}"])
    return "\n".join([
        f"small-batch linear: Inductor's reduction (and mm) against kiln's C kernel, CPU, "
        f"{report['settings']['threads']} threads; weights cycled through "
        f"{report['settings']['rotation_bytes'] // 2**20} MiB of copies",
        "",
        format_table(["weight", "shape", "tokens", "form", "inductor ms", "mm ms", "kernel ms", "kernel GB/s",
                      "kernel speedup", "kernel max abs err"], rows),
    ])


# ------------------------------------------------------------------------ many rows


def measure_many_rows_case(name: str, shape: tuple[int, int], tokens: int, repeats: int,
                           batch_seconds: float) -> dict[str, Any]:
    """MKL's ``F.linear`` against oneDNN, on the weight as it is and reordered
    once, on one weight shape and row count; each cycles through the same
    weight copies."""
    from kiln.compiler import onednn

    gen = torch.Generator().manual_seed(0)
    weights = [w for w, in _copies([torch.randn(shape, generator=gen) * 0.02], math.prod(shape) * 4)]
    x = torch.randn(tokens, shape[1], generator=gen)
    want = F.linear(x.double(), weights[0].double())
    onednn.prepack(weights)  # as a compiled model's load does
    forms: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "mkl": lambda w: F.linear(x, w),
        "onednn_plain": lambda w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
        "onednn": lambda w: onednn.implementation(x, w, None),  # on the reordered copy
    }
    flops = 2 * tokens * math.prod(shape)
    out: dict[str, Any] = {"weight": name, "shape": list(shape), "tokens": tokens, "weight_copies": len(weights)}
    with torch.inference_mode():
        for form, fn in forms.items():
            t = time_per_call(lambda fn=fn, nxt=_rotating(weights): fn(nxt()), repeats=repeats,
                              min_batch_seconds=batch_seconds)
            t["gflop_per_s"] = flops / (t["median_ms"] / 1e3) / 1e9
            t["max_abs_error"] = float((fn(weights[0]).double() - want).abs().max())
            out[form] = t
    out["onednn_plain_speedup"] = out["mkl"]["median_ms"] / out["onednn_plain"]["median_ms"]
    out["onednn_speedup"] = out["mkl"]["median_ms"] / out["onednn"]["median_ms"]
    return out


def many_rows_report(args: argparse.Namespace) -> dict[str, Any]:
    record = RunRecord("many-rows", "cpu")
    results = _linear_cases(args, "many-rows", MANY_ROWS_WEIGHTS, MANY_ROWS_TOKENS, measure_many_rows_case)
    return {
        **record.head(),
        "settings": {
            "smoke": args.smoke,
            "dtype": "float32",
            "threads": torch.get_num_threads(),
            "rotation_bytes": ROTATION_BYTES,
            "statistic": "median over batches of the per-call time; GFLOP/s = 2 x rows x out x in / median time",
            "forms": {"mkl": "F.linear(x, W)", "onednn_plain": "mkldnn._linear_pointwise(x, W, ...)",
                      "onednn": "kiln.compiler.onednn.implementation(x, W, None), W reordered by prepack first"},
            "grad_mode": "torch.inference_mode, as kiln's runner",
        },
        "results": results,
    }


def render_many_rows(report: dict[str, Any]) -> str:
    rows = [[r["weight"], "x".join(map(str, r["shape"])), str(r["tokens"]),
             fmt(r["mkl"]["median_ms"], 3), fmt(r["mkl"]["gflop_per_s"], 0),
             fmt(r["onednn_plain"]["median_ms"], 3), fmt(r["onednn_plain"]["gflop_per_s"], 0),
             fmt(r["onednn"]["median_ms"], 3), fmt(r["onednn"]["gflop_per_s"], 0),
             fmt(r["onednn_plain_speedup"], 2, "x"), fmt(r["onednn_speedup"], 2, "x"),
             f"{r['onednn']['max_abs_error']:.1e}"]
            for r in report["results"]]
    return "\n".join([
        f"many-row fp32 linear: MKL against oneDNN, CPU, {report['settings']['threads']} threads; weights "
        f"cycled through {report['settings']['rotation_bytes'] // 2**20} MiB of copies",
        "",
        format_table(["weight", "shape", "rows", "mkl ms", "mkl GFLOP/s", "onednn ms", "onednn GFLOP/s",
                      "reordered ms", "reordered GFLOP/s", "onednn speedup", "reordered speedup",
                      "max abs err"], rows),
    ])


# --------------------------------------------------------------------- step linears

PREFILL_ROWS = 512  # the rows of a prefill chunk: prompt tokens are timed at this many a call
FEW_STEP_ROWS = (8, 9, 12, 16)  # where the C kernel's fp32 rows meet oneDNN's
# what bench.decode --throughput 64 runs with its defaults (--prompt-len 128, --max-tokens 128, mixed lengths)
STEP_LINEAR_WORKLOAD = {"requests": 64, "prompt_len": 128, "max_tokens": 128}


def _throughput_schedule(requests: int, prompt_len: int, max_tokens: int) -> tuple[int, dict[int, int]]:
    """The prompt tokens of ``bench.decode``'s mixed-length throughput run and
    its decode steps by batch size: each request's first token comes with its
    prompt, then a request with a budget of B tokens is in B - 1 decode steps."""
    from bench.decode import throughput_lengths

    prompts, budgets = throughput_lengths(requests, prompt_len, max_tokens, same=False)
    steps: dict[int, int] = {}
    for s in range(1, max(budgets)):
        rows = sum(b - 1 >= s for b in budgets)
        steps[rows] = steps.get(rows, 0) + 1
    return sum(prompts), steps


def measure_step_linears(dtype: torch.dtype, rows_list: Sequence[int], repeats: int,
                         batch_seconds: float, kernel: Any = None) -> dict[str, Any]:
    """Milliseconds for a step's layer linears and its LM head at each row
    count; with ``kernel`` (a ``CpuLinearKernel``), also the whole step's by
    it where one call takes the rows (fp32: ``max_rows``), as few-row pieces
    run them, and fp32's by its panels at every row count, as many-row pieces
    run them where it has them."""
    from kiln.compiler import onednn
    from kiln.compiler.cpu_linear import dense_kind

    gen = torch.Generator().manual_seed(0)
    shapes = [MANY_ROWS_WEIGHTS[name] for name in ("qkv", "o_proj", "gate_up", "down")]
    layers = [[(torch.randn(shape, generator=gen) * 0.02).to(dtype) for shape in shapes]
              for _ in range(SMOLLM2["num_hidden_layers"])]
    head = (torch.randn(MANY_ROWS_WEIGHTS["lm_head"], generator=gen) * 0.02).to(dtype)
    onednn.prepack([w for layer in layers for w in layer] + [head])
    # fp32: the same weights laid out as the C kernel's panels (kiln_panels_linear), as kiln's
    # many-row pieces run them where the kernel has them
    laid_out = None
    if kernel is not None and kernel.panels and dtype == torch.float32:
        laid_out = [[onednn.kernel_weight(w, kernel) for w in layer] for layer in [*layers, [head]]]
    out: dict[str, Any] = {}
    with torch.inference_mode():
        for rows in rows_list:
            xs = [torch.randn(rows, shape[1], generator=gen).to(dtype) for shape in shapes]

            def layer_linears(xs: list[torch.Tensor] = xs) -> None:
                for layer in layers:
                    for x, w in zip(xs, layer):
                        onednn.implementation(x, w, None)

            xh = xs[0]  # hidden-size rows
            print(f"step-linears {str(dtype).removeprefix('torch.')} x {rows} rows ...", file=sys.stderr, flush=True)
            timed = {"layers": time_per_call(layer_linears, repeats=repeats, min_batch_seconds=batch_seconds),
                     "lm_head": time_per_call(lambda xh=xh: onednn.implementation(xh, head, None), repeats=repeats,
                                              min_batch_seconds=batch_seconds)}
            flops = {"layers": 2 * rows * sum(math.prod(s) for s in shapes) * len(layers),
                     "lm_head": 2 * rows * head.numel()}
            kind = dense_kind(dtype, dtype)
            if kernel is not None and kind in kernel.kinds and rows <= kernel.max_rows[kind]:
                def kernel_step(xs: list[torch.Tensor] = xs, xh: torch.Tensor = xh, kind: str = kind) -> None:
                    for layer in layers:
                        for x, w in zip(xs, layer):
                            kernel(x, w, None, None, None, kind)
                    kernel(xh, head, None, None, None, kind)

                timed["c_kernel_step"] = time_per_call(kernel_step, repeats=repeats, min_batch_seconds=batch_seconds)
                flops["c_kernel_step"] = flops["layers"] + flops["lm_head"]
            if laid_out is not None:
                def panels_step(xs: list[torch.Tensor] = xs, xh: torch.Tensor = xh) -> None:
                    for layer in laid_out[:-1]:
                        for x, w in zip(xs, layer):
                            w(x, None)
                    laid_out[-1][0](xh, None)

                timed["panels_step"] = time_per_call(panels_step, repeats=repeats, min_batch_seconds=batch_seconds)
                flops["panels_step"] = flops["layers"] + flops["lm_head"]
            for part, t in timed.items():
                t["gflop_per_s"] = flops[part] / (t["median_ms"] / 1e3) / 1e9
            out[str(rows)] = timed
    return out


def _throughput_bound(timings: dict[str, Any], prompt_tokens: int, steps: dict[int, int], requests: int,
                      output_tokens: int) -> dict[str, Any] | None:
    """The linears' share of the throughput run, from the measured row counts
    (None when a decode batch size was not measured: --smoke)."""
    if not all(str(rows) in timings for rows in (*steps, requests, PREFILL_ROWS)):
        return None
    ms = lambda rows, part: timings[str(rows)][part]["median_ms"]  # noqa: E731
    prefill = prompt_tokens / PREFILL_ROWS * ms(PREFILL_ROWS, "layers") + ms(requests, "lm_head")
    decode = sum(n * (ms(rows, "layers") + ms(rows, "lm_head")) for rows, n in steps.items())
    seconds = (prefill + decode) / 1e3
    return {"prefill_seconds": prefill / 1e3, "decode_seconds": decode / 1e3, "seconds": seconds,
            "output_tokens_per_s": output_tokens / seconds}


def step_linears_report(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    from kiln.compiler import cpu_linear, onednn

    record = RunRecord("step-linears", "cpu")
    work = STEP_LINEAR_WORKLOAD
    prompt_tokens, steps = _throughput_schedule(work["requests"], work["prompt_len"], work["max_tokens"])
    output_tokens = work["requests"] + sum(rows * n for rows, n in steps.items())
    # the C kernel's few rows (8, the other kinds' limit; 9 and 12, between it and fp32's 16), the decode
    # steps' batch sizes (the requests among them: the LM head of the prefill), then a prefill chunk
    rows_list = sorted({*FEW_STEP_ROWS, *steps}) + [PREFILL_ROWS]
    if args.smoke:
        rows_list = rows_list[:1]
    dtypes = [d for d in (torch.float32, torch.bfloat16) if d in onednn.DTYPES]
    if args.smoke:
        dtypes = dtypes[:1]
    results = []
    with tempfile.TemporaryDirectory(prefix="kiln-bench-kernel-") as tmp:
        try:
            kernel = cpu_linear.CpuLinearKernel(Path(tmp) / cpu_linear.SOURCE.build(Path(tmp)))
        except cpu_linear.KernelBuildError as e:  # a CPU without AVX2, or no compiler: oneDNN alone
            print(f"step-linears: no C kernel ({e})", file=sys.stderr)
            kernel = None
        for dtype in dtypes:
            timings = measure_step_linears(dtype, rows_list, min(args.repeats, 7), 0.02 if args.smoke else 0.3,
                                           kernel)
            results.append({"dtype": str(dtype).removeprefix("torch."), "timings": timings,
                            "bound": _throughput_bound(timings, prompt_tokens, steps, work["requests"],
                                                       output_tokens)})
    return {
        **record.head(),
        "settings": {
            "smoke": args.smoke,
            "threads": torch.get_num_threads(),
            "layers": SMOLLM2["num_hidden_layers"],
            "weights": {name: list(MANY_ROWS_WEIGHTS[name]) for name in ("qkv", "o_proj", "gate_up", "down", "lm_head")},
            "call": "kiln.compiler.onednn.implementation(x, W, None), every W reordered by prepack first",
            "c_kernel_step": "every layer linear and the LM head by kiln/compiler/cpu_linear.c, one call each, "
                             "where one call takes the rows (CpuLinearKernel.max_rows)",
            "panels_step": "fp32: every layer linear and the LM head by the C kernel's panels (kiln_panels_linear), "
                           "one call each, at every row count, where the kernel has them (AVX-512)",
            "statistic": "median over batches of the per-call time (at most 7 batches)",
            "workload": {**work, "lengths": "mixed, as bench.decode --throughput", "prompt_tokens": prompt_tokens,
                         "output_tokens": output_tokens,
                         "decode_steps_by_rows": {str(r): n for r, n in sorted(steps.items(), reverse=True)}},
            "bound": (f"prompt tokens x layers({PREFILL_ROWS} rows) / {PREFILL_ROWS} + lm_head(requests rows), plus "
                      "for each decode step layers(rows) + lm_head(rows): the linears alone, nothing else of a step"),
        },
        "results": results,
    }


def render_step_linears(report: dict[str, Any]) -> str:
    rows = []
    for r in report["results"]:
        for n, t in r["timings"].items():
            kernel, panels = t.get("c_kernel_step"), t.get("panels_step")
            rows.append([r["dtype"], n, fmt(t["layers"]["median_ms"], 1), fmt(t["layers"]["gflop_per_s"], 0),
                         fmt(t["lm_head"]["median_ms"], 2), fmt(t["lm_head"]["gflop_per_s"], 0),
                         fmt(t["layers"]["median_ms"] + t["lm_head"]["median_ms"], 1),
                         fmt(kernel["median_ms"], 1) if kernel else "-",
                         fmt(panels["median_ms"], 1) if panels else "-"])
    lines = [f"a step's linears by oneDNN on reordered weights, by the C kernel where one call takes the rows, and "
             f"fp32's by the C kernel's panels, "
             f"CPU, {report['settings']['threads']} threads (30 layers of the 135M shape + LM head)", "",
             format_table(["dtype", "rows", "layers ms", "layers GFLOP/s", "lm_head ms", "lm_head GFLOP/s",
                           "oneDNN step ms", "C kernel step ms", "panels step ms"], rows)]
    work = report["settings"]["workload"]
    for r in report["results"]:
        b = r["bound"]
        if b is not None:
            lines.append(f"{r['dtype']}: {work['requests']} requests of bench.decode --throughput "
                         f"({work['prompt_tokens']} prompt, {work['output_tokens']} output tokens) take at least "
                         f"{b['seconds']:.2f} s in linears alone ({b['prefill_seconds']:.2f} prefill + "
                         f"{b['decode_seconds']:.2f} decode): at most {b['output_tokens_per_s']:.1f} output tok/s")
    return "\n".join(lines)


# ------------------------------------------------------------------------ silu-mul
SILU_ROWS = (1, 8, 64, 512)


def _silu_mul_exact(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.double().chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul_report(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    from kiln.compiler import cpu_linear

    record = RunRecord("silu-mul", "cpu")
    inter = SMOLLM2["intermediate_size"]

    def inductor_form(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    results = []
    rows_list = SILU_ROWS[2:3] if args.smoke else SILU_ROWS
    batch_seconds = 0.02 if args.smoke else 0.2
    with tempfile.TemporaryDirectory(prefix="kiln-bench-kernel-") as tmp:
        kernel = cpu_linear.CpuLinearKernel(Path(tmp) / cpu_linear.SOURCE.build(Path(tmp)))
        for dtype, rows in itertools.product((torch.float32, torch.bfloat16), rows_list):
            x = (torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(rows)) * 4).to(dtype)
            exact = _silu_mul_exact(x)
            compiled = torch.compile(inductor_form, dynamic=False, fullgraph=True)
            forms = {"inductor": lambda: compiled(x), "kernel": lambda: kernel.silu_mul(x)}
            row: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."), "rows": rows}
            with torch.inference_mode():
                for form, fn in forms.items():
                    t = _in_us(time_per_call(fn, repeats=args.repeats, min_batch_seconds=batch_seconds))
                    got = fn().double()
                    t["max_rel_error"] = float(((got - exact).abs() / exact.abs().clamp_min(1e-6)).max())
                    row[form] = t
            row["kernel_speedup"] = row["inductor"]["median_us"] / row["kernel"]["median_us"]
            results.append(row)
    return {
        **record.head(),
        "settings": {
            "smoke": args.smoke, "threads": torch.get_num_threads(), "shape": [2 * inter],
            "kernel": "kiln/compiler/cpu_linear.c kiln_silu_mul through CpuLinearKernel.silu_mul",
            "inductor": "torch.compile(dynamic=False, fullgraph=True) of chunk + silu * up, its wrapper included",
            "statistic": "median over batches of the per-call time; kernel_speedup = Inductor's median / the "
                         "kernel's; max_rel_error against the activation in fp64 (denominator at least 1e-6)",
        },
        "results": results,
    }


def render_silu_mul(report: dict[str, Any]) -> str:
    rows = [[r["dtype"], str(r["rows"]), fmt(r["inductor"]["median_us"], 1), fmt(r["kernel"]["median_us"], 1),
             fmt(r["kernel_speedup"], 2, "x"), f"{r['inductor']['max_rel_error']:.1e}",
             f"{r['kernel']['max_rel_error']:.1e}"] for r in report["results"]]
    return "\n".join([
        f"silu(gate) * up on [rows, {report['settings']['shape'][0]}], CPU, {report['settings']['threads']} threads: "
        "Inductor's compiled function against kiln's C loop", "",
        format_table(["dtype", "rows", "inductor us", "kernel us", "kernel speedup", "inductor max rel err",
                      "kernel max rel err"], rows),
    ])


# ---------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_kernels", description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(BENCHMARKS),
                   help=f"comma-separated benchmarks to run, of: {', '.join(BENCHMARKS)} (default all)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed batches per figure (default 21; 3 with --smoke)")
    p.add_argument("--smoke", action="store_true",
                   help="a check of this script: short batches, gemv and quant-kernels on one weight at 1 token")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory (default bench/results)")
    args = p.parse_args(argv)
    args.only = args.only.replace(",", " ").split()
    unknown = [b for b in args.only if b not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark(s) {unknown}; known: {list(BENCHMARKS)}")
    if args.repeats is None:
        args.repeats = 3 if args.smoke else 21
    if args.repeats < 1 or args.threads < 1:
        p.error("--repeats and --threads must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if "op-overhead" in args.only:
        report = op_overhead_report(args)
        publish(report, "op-overhead", render_op_overhead(report), args.out)
    if "gemv" in args.only:
        if "op-overhead" in args.only:
            print()
        report = gemv_report(args)
        publish(report, "gemv", render_gemv(report), args.out)
    if "quant-kernels" in args.only:
        if "op-overhead" in args.only or "gemv" in args.only:
            print()
        report = quant_kernels_report(args)
        publish(report, "quant-kernels", render_quant_kernels(report), args.out)
    if "cpu-linear" in args.only:
        report = cpu_linear_report(args)
        publish(report, "cpu-linear", render_cpu_linear(report), args.out)
    if "many-rows" in args.only:
        report = many_rows_report(args)
        publish(report, "many-rows", render_many_rows(report), args.out)
    if "step-linears" in args.only:
        report = step_linears_report(args)
        publish(report, "step-linears", render_step_linears(report), args.out)
    if "silu-mul" in args.only:
        report = silu_mul_report(args)
        publish(report, "silu-mul", render_silu_mul(report), args.out)
    if "huge-pages" in args.only:
        report = huge_pages_report(args)
        publish(report, "huge-pages", render_huge_pages(report), args.out)
    if "decode-attention" in args.only:
        report = decode_attention_report(args)
        publish(report, "decode-attention", render_decode_attention(report), args.out)
    if "prefill-attention" in args.only:
        report = prefill_attention_report(args)
        publish(report, "prefill-attention", render_prefill_attention(report), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
