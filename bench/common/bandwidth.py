"""The memory-bandwidth view of a decode step: what it must read, what the
machine can read, and how close a measured rate comes.

A batch-1 decode step reads every weight once (the input embedding only as one
row, unless it is tied to the LM head, which reads all of it) and each layer's
keys and values of the whole context. On a CPU those bytes over the step time is
the achieved bandwidth; the machine's own figure is a plain ``sum`` over a
buffer far larger than the last-level cache, measured in the same run with the
same threads, so the ratio compares like with like.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["attach_bandwidth", "decode_traffic", "machine_read_bandwidth", "model_step_bytes", "roofline",
           "screened_traffic"]

_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_INPUT_EMBEDDING = "model.embed_tokens.weight"


def machine_read_bandwidth(nbytes: int = 1 << 30, repeats: int = 7) -> dict[str, Any]:
    """GB/s of ``torch.sum`` over an fp32 buffer of ``nbytes`` with the current
    torch thread count: the median and the best of ``repeats`` passes."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    buf.sum()  # fault the pages in and warm the threads
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"method": "torch.sum over an fp32 buffer", "bytes": nbytes, "threads": torch.get_num_threads(),
            "repeats": repeats, "gb_per_s": round(nbytes / times[len(times) // 2] / 1e9, 2),
            "best_gb_per_s": round(nbytes / times[0] / 1e9, 2)}


def decode_traffic(model_path: Path, model: dict[str, Any], dtype: str, mean_context: float) -> dict[str, Any]:
    """Bytes one batch-1 decode step reads in ``dtype``: weights (from the
    checkpoint's tensor list) and the KV cache at ``mean_context`` tokens.

    Weights are counted at the run dtype, as kiln holds them (a quantized GGUF is
    dequantized at load)."""
    from kiln.checkpoint import open_checkpoint

    size = _ELEMENT_BYTES[dtype]
    with open_checkpoint(Path(model_path)).reader() as reader:
        tensors = reader.tensors()
    elements = 0
    for t in tensors:
        n = 1
        for d in t.shape:
            n *= d
        if t.name == _INPUT_EMBEDDING and not model["tie_word_embeddings"]:
            n = t.shape[-1]  # one row per token
        elements += n
    kv = 2 * model["num_layers"] * model["num_kv_heads"] * model["head_dim"] * size * mean_context
    weights = elements * size
    return {"dtype": dtype, "weight_bytes": weights, "kv_bytes": round(kv), "mean_context": mean_context,
            "bytes_per_token": round(weights + kv)}


def model_step_bytes(model: torch.nn.Module) -> int:
    """Bytes of a loaded kiln model that one batch-1 decode step reads: every
    parameter and buffer as held (packed layers at their packed size), except
    the input embedding (one row; all of it when it is also the dense LM head)
    and the RoPE tables (one row each)."""
    embedding = model.embed_tokens.weight
    seen: set[int] = set()
    total = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t is embedding or name.startswith("rotary.") or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    head, fmt = model.logits_inputs()
    if fmt is None and head[0] is embedding:
        total += embedding.numel() * embedding.element_size()
    return total


def roofline(tokens_per_s: float | None, traffic: dict[str, Any], machine: dict[str, Any]) -> dict[str, Any] | None:
    """Achieved GB/s of a decode rate, the machine's figure, their ratio, and
    the rate the machine's bandwidth allows."""
    if tokens_per_s is None:
        return None
    achieved = traffic["bytes_per_token"] * tokens_per_s / 1e9
    return {"bytes_per_token": traffic["bytes_per_token"],
            "achieved_gb_per_s": round(achieved, 2), "machine_gb_per_s": machine["gb_per_s"],
            "fraction_of_machine": round(achieved / machine["gb_per_s"], 3),
            "roofline_tokens_per_s": round(machine["gb_per_s"] * 1e9 / traffic["bytes_per_token"], 1)}


def attach_bandwidth(model_path: Path, model: dict[str, Any], dtype: str, mean_context: float,
                     results: list[dict[str, Any]], machine: dict[str, Any]) -> dict[str, Any]:
    """Add ``bandwidth`` (:func:`roofline`) to each measured batch-1 result of
    one dtype; return the step's traffic."""
    traffic = decode_traffic(model_path, model, dtype, mean_context)
    for r in results:
        if "error" not in r:
            r["bandwidth"] = roofline(r.get("decode_tokens_per_s"), screened_traffic(traffic, r), machine)
    return traffic


def screened_traffic(traffic: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """``traffic`` as a greedy step of ``result``'s engine reads it: a kiln
    engine whose fp32 LM head has a greedy screen (its startup report's
    ``greedy_screen``, ``kiln.compiler.greedy_head``) reads the head's bf16
    tiles in place of its fp32 weight, so counting the fp32 head would
    overstate the bandwidth it reached."""
    screen = (result.get("startup_report") or {}).get("greedy_screen")
    if not screen:
        return traffic
    weights = traffic["weight_bytes"] - screen["head_bytes"] + screen["tile_bytes"]
    return {**traffic, "weight_bytes": weights, "bytes_per_token": round(weights + traffic["kv_bytes"]),
            "greedy_screen": screen}
