"""A roofline estimate of a batched workload: the time a batch of requests
would take if every step ran at the machine's limits, to set a throughput run
beside.

A batch-1 decode step is bounded by memory bandwidth alone
(``bench.common.bandwidth``). A batch of many requests is not: its prefill and
its full decode steps multiply each weight by tens to thousands of rows, so
their linears are bounded by the machine's matrix-multiply rate, while each
decode step still reads every request's keys and values once. The estimate
here runs the workload as a static schedule (every prompt first, then one
decode step per token position while any request still has budget) and gives
each step

* its linears (every layer's projections, and the LM head for the rows that
  sample): the longer of their multiply-adds at the machine's matrix-multiply
  rate and their weights read once at its read bandwidth;
* a decode step's keys and values of every running request, read at the read
  bandwidth, after the linears (a layer's attention needs its projections);
* a prompt's causal attention, counted as multiply-adds at the matrix rate.

The rates are measured in the same run: ``torch.mm`` of two square matrices
in the run's dtype (``machine_matmul_rate``) and ``torch.sum`` over a buffer far
larger than the last-level cache (``machine_read_bandwidth``). It is an
estimate, not a bound: a kernel may beat the library's matrix rate on some
shape, and an engine that overlaps a layer's attention with the next
projections, or keeps keys and values in a large last-level cache, can run
below it. What it shows is how far an engine is from the machine, and how much
faster than a baseline any engine on that machine could be.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ModelCost", "machine_matmul_rate", "model_cost", "throughput_roofline"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def machine_matmul_rate(dtype: str, size: int = 2048, repeats: int = 5) -> dict[str, Any]:
    """GFLOP/s of ``torch.mm`` of two ``size`` x ``size`` matrices in ``dtype``
    with the current torch thread count: the median and the best of
    ``repeats`` products (fp32: the BLAS's vector product; bf16 on a CPU
    with AMX: its tile product)."""
    a = torch.randn(size, size, dtype=_DTYPES[dtype])
    b = torch.randn(size, size, dtype=_DTYPES[dtype])
    for _ in range(2):
        torch.mm(a, b)  # warm the threads and the library's buffers
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    times.sort()
    flops = 2 * size**3
    return {"method": f"torch.mm of two {size} x {size} matrices", "dtype": dtype,
            "threads": torch.get_num_threads(), "repeats": repeats,
            "gflop_per_s": round(flops / times[len(times) // 2] / 1e9, 1),
            "best_gflop_per_s": round(flops / times[0] / 1e9, 1)}


@dataclass(frozen=True)
class ModelCost:
    """What one token costs a decoder, from its shape: multiply-adds are
    counted as 2 FLOPs, bytes at the run dtype.

    ``body_flops``: every layer's q/k/v/o and MLP projections for one token;
    ``head_flops``: the LM head for one sampled row; ``weight_bytes``: the
    weights a step reads (``bench.common.bandwidth.decode_traffic``); ``kv_bytes``:
    one position's keys and values over all layers; ``attention_flops``: the
    factor of a causal prompt's attention, n (n + 1) / 2 pairs of positions
    each costing it."""

    body_flops: int
    head_flops: int
    weight_bytes: int
    kv_bytes: int
    attention_flops: int


def model_cost(model: dict[str, Any], dtype: str, weight_bytes: int) -> ModelCost:
    """The costs of ``model`` (``bench.common.models.describe_model``'s fields)."""
    h, inter, layers = model["hidden_size"], model["intermediate_size"], model["num_layers"]
    q, kv = model["num_attention_heads"] * model["head_dim"], model["num_kv_heads"] * model["head_dim"]
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter
    return ModelCost(body_flops=2 * layers * per_layer, head_flops=2 * model["vocab_size"] * h,
                     weight_bytes=weight_bytes, kv_bytes=2 * layers * kv * _ELEMENT_BYTES[dtype],
                     attention_flops=2 * 2 * layers * q)


def throughput_roofline(cost: ModelCost, prompt_lens: list[int], output_lens: list[int], matmul_gflops: float,
                        read_gb_per_s: float) -> dict[str, Any]:
    """The roofline estimate (module docstring) of requests with these prompt
    lengths and token budgets: seconds for the prefill (every prompt, and
    the first token of each), for the decode steps, and the share of the
    decode steps spent reading keys and values."""
    if len(prompt_lens) != len(output_lens):
        raise ValueError(f"{len(prompt_lens)} prompt lengths against {len(output_lens)} token budgets")
    matmul, read = matmul_gflops * 1e9, read_gb_per_s * 1e9
    prompt_tokens = sum(prompt_lens)
    prefill_flops = (prompt_tokens * cost.body_flops + len(prompt_lens) * cost.head_flops
                     + sum(n * (n + 1) // 2 for n in prompt_lens) * cost.attention_flops)
    prefill = max(prefill_flops / matmul, cost.weight_bytes / read) if prompt_lens else 0.0
    decode = kv_seconds = 0.0
    steps = 0
    for t in range(1, max(output_lens, default=0)):  # decode step t samples token t + 1 of each running request
        running = [p for p, o in zip(prompt_lens, output_lens) if o > t]
        linears = max(len(running) * (cost.body_flops + cost.head_flops) / matmul, cost.weight_bytes / read)
        kv = sum(p + t for p in running) * cost.kv_bytes / read
        decode += linears + kv
        kv_seconds += kv
        steps += 1
    return {"prefill_seconds": round(prefill, 4), "decode_seconds": round(decode, 4),
            "seconds": round(prefill + decode, 4), "decode_steps": steps,
            "kv_read_seconds": round(kv_seconds, 4), "matmul_gflop_per_s": matmul_gflops,
            "read_gb_per_s": read_gb_per_s}
