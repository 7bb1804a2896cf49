"""Quantized linears on a real model: batch-1 decode with dense fp32 weights,
with kiln's per-row int8 (``quantization="int8"``) and with the GGUF file's
own blocks kept packed (``quantization="gguf"``), both weight-only, and the
same two with their activations rounded to int8 too (``"int8-a8"``,
``"gguf-a8"``: integer products with AVX512-VNNI), in one run.

Run from the repository root::

    python -m bench.quantized                       # SmolLM2-135M-Instruct Q4_1 (`kiln fetch-demo`), -O2
    python -m bench.quantized --smoke               # a check of this script: random-demo, few tokens

The engines are ``bench.adapters.KilnEngine`` (one streamed greedy request per
run, prefix caching off), set up one after another into one compile cache and
then taking turns, one timed run each per round. For each mode the report gives
decode tok/s, the bytes a step reads (the loaded model's parameters and buffers
as held: packed layers at their packed size; plus the KV cache at the mean
context), the achieved GB/s against the machine's ``sum`` bandwidth measured in
the same run, and greedy agreement with the dense model over ``--prompts`` chat
prompts (the share of tokens before the first difference, and how many prompts
agree throughout). A quantized model is a different model: agreement below 1 is
its quantization error, not a bug (tests/test_quantization.py checks kiln's
packed layers against the dequantized reference).

The demo file stores its linear layers as Q4_1 and its (tied) embedding as
Q8_0: ``gguf`` runs them as kiln's ``q4`` and ``q8_0`` formats, the embedding
lookup stays dense. JSON goes to ``bench/results/quantized-cpu-<stamp>.json``
and ``quantized-cpu-latest.json``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.adapters import BASELINES, KilnEngine
from bench.common.bandwidth import decode_traffic, machine_read_bandwidth, model_step_bytes, roofline
from bench.common.harness import BenchSettings, EngineSpec, run_engines
from bench.common.models import chat_prompts, describe_model, load_tokenizer, resolve_model_arg
from bench.common.report import RESULTS_DIR, RunRecord, fmt, markdown_table, publish

MODES = ("dense", "int8", "gguf", "int8-a8", "gguf-a8")  # "dense": quantization=None
BASELINE = "transformers"  # eager; measured in the same run, taking turns with kiln


def _quantization(mode: str) -> str | None:
    return None if mode == "dense" else mode


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.quantized", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo", help="a .gguf file, checkpoint directory, demo or random-demo")
    p.add_argument("--level", type=int, default=2, help="kiln optimization level (default 2)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per timed run (default 64)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per engine (default 5)")
    p.add_argument("--prompts", type=int, default=8, help="chat prompts for the agreement check (default 8)")
    p.add_argument("--agreement-tokens", type=int, default=32, help="greedy tokens per agreement prompt")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--smoke", action="store_true", help="random-demo, 8 tokens, 1 repeat, 2 prompts")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory (default bench/results)")
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.replace(",", " ").split()]
    bad = [m for m in args.modes if m not in MODES]
    if bad or "dense" not in args.modes:
        p.error(f"--modes: {bad or 'dense is the reference and must be included'}; known: {list(MODES)}")
    if args.smoke:
        args.model, args.max_tokens, args.repeats, args.prompts, args.agreement_tokens = "random-demo", 8, 1, 2, 8
    args.model_path = resolve_model_arg(args.model)
    if args.model_path.suffix.lower() != ".gguf":  # a checkpoint directory has no blocks to keep
        args.modes = [m for m in args.modes if not m.startswith("gguf")]
    return args


def _decode(args: argparse.Namespace, prompt: list[int],
            cache: Path) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Batch-1 decode per mode and of transformers eager (dense fp32), the
    engines taking turns."""
    specs = []
    for mode in args.modes:
        settings = BenchSettings(args.max_tokens, args.repeats, "cpu", "float32", kiln_cache_dir=cache,
                                 quantization=_quantization(mode))
        specs.append(EngineSpec({"engine": "kiln", "level": args.level, "label": mode},
                                lambda s=settings: _labelled(KilnEngine(args.model_path, prompt, args.level, s),
                                                             s)))
    base = BenchSettings(args.max_tokens, args.repeats, "cpu", "float32")
    specs.append(EngineSpec({"engine": BASELINE, "label": BASELINE},
                            lambda: BASELINES[BASELINE](args.model_path, prompt, base)))
    results = run_engines(specs, args.repeats, None)
    return dict(zip(args.modes, results)), results[-1]


def _labelled(engine: KilnEngine, settings: BenchSettings) -> KilnEngine:
    engine.label = f"-O{engine.level} {settings.quantization or 'dense'}"
    return engine


def _agreement(args: argparse.Namespace, prompts: list[list[int]], cache: Path) -> dict[str, dict[str, Any]]:
    """Per mode: the step bytes of the loaded model, and its greedy tokens
    against the dense model's over ``prompts`` (loads from the warm cache)."""
    from kiln import Runtime, SamplingParams

    params = SamplingParams(max_tokens=args.agreement_tokens, temperature=0, ignore_eos=True)
    tokens: dict[str, list[list[int]]] = {}
    out: dict[str, dict[str, Any]] = {}
    for mode in args.modes:
        rt = Runtime.load(args.model_path, optimization_level=args.level, quantization=_quantization(mode),
                          cache_dir=cache, enable_prefix_caching=False)
        model = rt.engine.runner.model
        tokens[mode] = [o.token_ids for o in rt.generate(prompts, params)]
        out[mode] = {"weight_bytes": model_step_bytes(model), "packed_layers": rt.startup_report["packed_layers"]}
        del rt
    for mode in args.modes:
        prefix = [next((i for i, (a, b) in enumerate(zip(t, d)) if a != b), len(d))
                  for t, d in zip(tokens[mode], tokens["dense"])]
        out[mode].update(agreement=round(sum(prefix) / sum(len(d) for d in tokens["dense"]), 3),
                         prompts_equal=sum(p == len(d) for p, d in zip(prefix, tokens["dense"])),
                         prompts=len(prompts))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    record = RunRecord("quantized", "cpu")
    torch.set_num_threads(args.threads)
    model = describe_model(args.model_path, args.model_path.name)
    _, ids, _ = chat_prompts(load_tokenizer(args.model_path), max(args.prompts, 1))
    cache = Path(tempfile.mkdtemp(prefix="kiln-bench-quantized-"))
    try:
        before = machine_read_bandwidth()
        results, baseline = _decode(args, ids[0], cache)
        machine = max(before, machine_read_bandwidth(), key=lambda m: m["gb_per_s"])
        checks = _agreement(args, ids[: args.prompts], cache)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    kv = decode_traffic(args.model_path, model, "float32", len(ids[0]) + args.max_tokens / 2)["kv_bytes"]
    dense_rate = results["dense"].get("decode_tokens_per_s")
    for mode, r in results.items():
        r.update(checks[mode])
        traffic = {"bytes_per_token": checks[mode]["weight_bytes"] + kv}
        r["bytes_per_token"] = traffic["bytes_per_token"]
        r["bandwidth"] = roofline(r.get("decode_tokens_per_s"), traffic, machine)
        rate = r.get("decode_tokens_per_s")
        r["speedup_vs_dense"] = round(rate / dense_rate, 3) if rate and dense_rate else None
        base_rate = baseline.get("decode_tokens_per_s")
        r[f"speedup_vs_{BASELINE}"] = round(rate / base_rate, 3) if rate and base_rate else None
        r.pop("token_ids", None)
    return {**record.head(torch_threads=args.threads), "model": model,
            "settings": {"level": args.level, "max_tokens": args.max_tokens, "repeats": args.repeats,
                         "prompt_tokens": len(ids[0]), "agreement_prompts": args.prompts,
                         "agreement_tokens": args.agreement_tokens, "kv_bytes_per_token": kv, "smoke": args.smoke},
            "machine_bandwidth": machine, "results": results,
            "baseline": {k: v for k, v in baseline.items() if k not in ("runs", "token_ids")}}


def render(report: dict[str, Any]) -> str:
    rows = []
    for mode, r in report["results"].items():
        bw = r.get("bandwidth") or {}
        rows.append([mode, ", ".join(f"{n} {f}" for f, n in r.get("packed_layers", {}).items()) or "-",
                     fmt(r.get("decode_tokens_per_s"), 1), fmt(r.get("speedup_vs_dense"), 2, "x"),
                     fmt(r.get(f"speedup_vs_{BASELINE}"), 2, "x"),
                     fmt(r.get("bytes_per_token", 0) / 1e6, 1), fmt(bw.get("achieved_gb_per_s"), 1),
                     fmt(bw.get("fraction_of_machine", 0) * 100, 0, "%"), fmt(bw.get("roofline_tokens_per_s"), 1),
                     f"{r.get('agreement', 0):.3f} ({r.get('prompts_equal')}/{r.get('prompts')})",
                     r.get("error", "")])
    s, m = report["settings"], report["machine_bandwidth"]
    return "\n".join([
        f"batch-1 decode, {report['model']['name']}, -O{s['level']}, fp32 activations, "
        f"{report['machine']['torch_threads']} threads; machine sum bandwidth {m['gb_per_s']} GB/s",
        "",
        f"{BASELINE} (dense fp32, same run): {fmt(report['baseline'].get('decode_tokens_per_s'), 1)} tok/s",
        "",
        markdown_table(["mode", "packed layers", "decode tok/s", "vs dense", f"vs {BASELINE}", "MB a step", "achieved GB/s",
                        "of machine", "roofline tok/s", f"greedy agreement ({s['agreement_tokens']} tokens)",
                        "error"], rows),
    ])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    publish(report, "quantized", render(report), args.out)
    failed = [m for m, r in report["results"].items() if "error" in r]
    if failed:
        print(f"failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
