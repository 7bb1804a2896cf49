"""The printed tables of ``bench.decode``, made from its JSON report (batch 1:
:func:`render_report`; throughput: :func:`render_throughput_report`)."""

from __future__ import annotations

from typing import Any

from bench.common.harness import NOISY_SPREAD
from bench.common.report import fmt, format_table

REFERENCE_BASELINE = "transformers"  # speedups and token checks are against this one


def _model_head(report: dict[str, Any]) -> str:
    m, s, mach = report["model"], report["settings"], report["machine"]
    gpu = f" ({mach['gpu']})" if mach.get("gpu") else ""
    return (
        f"{m['name']} ({m['architecture']}, {m['num_layers']} layers, "
        f"hidden {m['hidden_size']}, heads {m['num_attention_heads']}/{m['num_kv_heads']} kv, "
        f"vocab {m['vocab_size']}), {s['dtype']} on {mach['device']}{gpu}, "
        f"torch threads {mach['torch_threads']} of {mach['cpu_count']} CPUs"
    )


def _cold_start(r: dict[str, Any]) -> str:
    return fmt(r["load_seconds"] + (r.get("compile_seconds") or 0.0), 1, "s")


def _results(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [*report["kiln"], *report["baselines"].values()]


def _cudagraph_section(report: dict[str, Any]) -> list[str]:
    """kiln's CUDA graph figures per level (CUDA runs only)."""
    if not report["settings"]["device"].startswith("cuda"):
        return []
    rows = []
    for k in report["kiln"]:
        if "error" in k:
            continue
        g, mem = k.get("cudagraphs", {}), k.get("cuda_memory") or {}
        graph_bytes = g.get("cudagraph_memory_bytes")
        rows.append([
            k["label"], str(g.get("cudagraph_mode", "n/a")), str(g.get("cudagraphs_captured", "n/a")),
            fmt(g.get("cudagraph_capture_seconds"), 2, "s"),
            fmt(graph_bytes / 2**20 if graph_bytes is not None else None, 1),
            fmt(mem["allocated_by_load_bytes"] / 2**20 if "allocated_by_load_bytes" in mem else None, 0),
            str(k.get("attention_backend") or "n/a"),
        ])
    if not rows:
        return []
    return ["", "kiln CUDA graphs (from startup_report; n/a: not reported by this kiln)",
            format_table(["kiln", "mode", "captured", "capture", "graph MiB", "load MiB (allocated)",
                          "attention"], rows)]


def _trailer(report: dict[str, Any]) -> list[str]:
    """The CUDA graph table, the engines not measured, and a note on noisy runs."""
    parts = _cudagraph_section(report)
    errors = [f"{r['engine']} {r['label']} not measured: {r['error']}" for r in _results(report) if "error" in r]
    if errors:
        parts += ["", *errors]
    noisy = [f"{r['engine']} {r['label']}" for r in _results(report) if r.get("spread", 0.0) > NOISY_SPREAD]
    if noisy:
        parts += ["", f"note: the runs of {', '.join(noisy)} have a spread over {NOISY_SPREAD:.0%}: "
                      "the machine was busy; rerun, raise --repeats, or try --threads 1"]
    return parts


def _batch1_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for k in report["kiln"]:
        if "error" in k:
            rows.append(["kiln", k["label"], "n/a", "n/a", "n/a", "n/a", "n/a", "n/a", "unavailable", "n/a"])
            continue
        match = k.get("tokens_match")
        rows.append([
            "kiln", k["label"], fmt(k["decode_tokens_per_s"]), fmt(k["ms_per_token"]),
            fmt(k.get("prefill_tokens_per_s"), 1), fmt(100 * k["spread"], 0, "%"),
            fmt(k.get(f"speedup_vs_{REFERENCE_BASELINE}"), suffix="x"),
            fmt(k.get(f"paired_speedup_vs_{REFERENCE_BASELINE}"), suffix="x"),
            "-" if match is None else ("yes" if match else f"NO (from token {k['first_mismatch']})"),
            fmt(k["load_seconds"], 1, "s"),
        ])
    for name, b in report["baselines"].items():
        if "error" in b:
            rows.append([name, b["label"], "n/a", "n/a", "n/a", "n/a", "-", "-", "unavailable", "n/a"])
            continue
        ref = name == REFERENCE_BASELINE
        rows.append([name, b["label"], fmt(b["decode_tokens_per_s"]), fmt(b["ms_per_token"]),
                     fmt(b.get("prefill_tokens_per_s"), 1), fmt(100 * b["spread"], 0, "%"),
                     "1.00x" if ref else "-", "-",
                     "(reference)" if ref else "-", _cold_start(b)])
    return rows


def render_report(report: dict[str, Any]) -> str:
    """The human-readable summary of a batch-1 report."""
    s = report["settings"]
    head = (
        f"decode benchmark: {_model_head(report)}\n"
        f"batch 1, greedy, prompt {s['prompt_len']} tokens, {s['max_tokens']} new tokens; "
        f"decode excludes prefill; median of {s['repeats']} runs after a warm-up, engines taking turns"
    )
    rates = format_table(
        ["engine", "config", "decode tok/s", "ms/token", "prefill tok/s", "spread", f"kiln/{REFERENCE_BASELINE}",
         "paired", "tokens match", "cold start"],
        _batch1_rows(report),
    )
    legend = (f"prefill tok/s: prompt tokens / time to the first token; spread: (best - worst) / median of "
              f"an engine's runs; paired: median over rounds of "
              f"kiln's rate / {REFERENCE_BASELINE}'s in the same round; cold start: kiln's Runtime.load "
              "into an empty compile cache (trace + compile), transformers' load (+ its torch.compile warm-up)")
    parts = [head, "", rates, legend]
    overhead_rows = [
        [k["label"], *(fmt(k[key], 3) for key in ("step_wall_ms", "model_ms", "outside_model_ms", "prepare_ms",
                                                   "sample_ms", "other_ms"))]
        for k in report["kiln"] if "error" not in k
    ]
    if overhead_rows:
        parts += ["", "kiln per decode step, ms (outside model = step wall - model = prepare + sample + other)",
                  format_table(["kiln", "step wall", "model", "outside model", "prepare", "sample", "other"],
                               overhead_rows)]
    return "\n".join(parts + _bandwidth_section(report) + _trailer(report))


def _bandwidth_section(report: dict[str, Any]) -> list[str]:
    """Bytes per token, achieved GB/s and the share of the machine's bandwidth."""
    bw = report.get("bandwidth")
    if not bw:
        return []
    t, m = bw["traffic"], bw["machine"]
    rows = [[r["engine"], r["label"], fmt(r["bandwidth"].get("bytes_per_token", t["bytes_per_token"]) / 1e6, 1),
             fmt(r["bandwidth"]["achieved_gb_per_s"], 1),
             fmt(100 * r["bandwidth"]["fraction_of_machine"], 0, "%"), fmt(r["bandwidth"]["roofline_tokens_per_s"], 1)]
            for r in _results(report) if r.get("bandwidth")]
    return ["", f"memory bandwidth: a decode step reads {t['bytes_per_token'] / 1e6:.1f} MB "
                f"(weights {t['weight_bytes'] / 1e6:.1f} MB + KV {t['kv_bytes'] / 1e6:.1f} MB at "
                f"{t['mean_context']:.0f} tokens of context); the machine reads {m['gb_per_s']:.1f} GB/s "
                f"({m['method']}, {m['bytes'] >> 20} MiB, {m['threads']} threads, median of {m['repeats']}); "
                "an engine's MB a step differ where it reads less (kiln's greedy screen: the LM head in bf16)",
            format_table(["engine", "config", "MB a step", "achieved GB/s", "of machine", "roofline tok/s"], rows)]


def _throughput_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for r in _results(report):
        if "error" in r:
            rows.append([r["engine"], r["label"], "n/a", "n/a", "n/a", "n/a", "n/a", "n/a", "unavailable", "n/a"])
            continue
        matching = r.get("requests_matching_reference")
        rows.append([
            r["engine"], r["label"], fmt(r["output_tokens_per_s"], 1), fmt(r["wall_seconds"], 2, "s"),
            fmt(r.get("prefill_seconds"), 2, "s"), fmt(r.get("decode_seconds"), 2, "s"),
            fmt(100 * r["spread"], 0, "%"), fmt(r.get(f"speedup_vs_{REFERENCE_BASELINE}"), suffix="x"),
            "(reference)" if r["engine"] == REFERENCE_BASELINE else
            ("-" if matching is None else f"{matching}/{report['settings']['num_requests']}"),
            _cold_start(r),
        ])
    return rows


def _lengths(s: dict[str, Any]) -> str:
    if s.get("lengths") != "mixed":
        return f"prompt {s['prompt_len']} + {s['max_tokens']} new tokens each"
    return (f"mixed lengths: prompts {min(s['prompt_lens'])}-{max(s['prompt_lens'])} tokens "
            f"({s['prompt_tokens']} in all), {min(s['output_lens'])}-{max(s['output_lens'])} new tokens "
            f"({s['output_tokens']} in all)")


def render_throughput_report(report: dict[str, Any]) -> str:
    """The human-readable summary of a throughput report."""
    s = report["settings"]
    head = (
        f"decode throughput benchmark: {_model_head(report)}\n"
        f"{s['num_requests']} requests submitted at once, {_lengths(s)}, greedy; whole batch timed (prefill "
        f"included); median of {s['repeats']} runs after a warm-up, engines taking turns"
    )
    table = format_table(["engine", "config", "output tok/s", "batch wall", "prefill", "decode", "spread",
                          f"vs {REFERENCE_BASELINE}", "requests match", "cold start"], _throughput_rows(report))
    legend = ("output tok/s: requests x new tokens / wall time of the whole batch; prefill / decode: kiln's "
              "steps that ran prompt tokens / the others, transformers' one-token generate of the batch / "
              "the rest; requests match: requests "
              f"whose greedy tokens equal {REFERENCE_BASELINE}'s (informational: batched low-precision "
              "arithmetic diverges at near-ties); cold start: load (+ compile) as in the batch-1 table")
    parts = [head, "", table, legend]
    steps = [[k["label"], fmt(k["steps"], 0), fmt(k["step_wall_ms"], 2), fmt(k["model_ms"], 2)]
             for k in report["kiln"] if "error" not in k]
    if steps:
        parts += ["", "kiln engine steps per batch (median), ms per step",
                  format_table(["kiln", "steps", "step wall", "model (host)"], steps)]
    return "\n".join(parts + _roofline_section(report) + _trailer(report))


def _roofline_section(report: dict[str, Any]) -> list[str]:
    """The workload's roofline estimate and each engine's share of it (CPU runs)."""
    est = report.get("roofline")
    if not est:
        return []
    m, r = est["matmul"], est["read"]
    rows = [[x["engine"], x["label"], fmt(x["wall_seconds"], 2, "s"), fmt(100 * x["roofline_fraction"], 0, "%")]
            for x in _results(report) if "roofline_fraction" in x]
    ceiling = est.get(f"ceiling_speedup_vs_{REFERENCE_BASELINE}")
    return ["", f"roofline estimate (bench.common.roofline): {est['seconds']:.2f} s = prefill "
                f"{est['prefill_seconds']:.2f} s + {est['decode_steps']} decode steps {est['decode_seconds']:.2f} s "
                f"(of which reading keys and values {est['kv_read_seconds']:.2f} s), at {m['gflop_per_s']:.0f} "
                f"GFLOP/s ({m['method']}, {m['dtype']}) and {r['gb_per_s']:.1f} GB/s ({r['method']}), "
                f"weights {est['weight_bytes'] / 1e6:.1f} MB"
                + (f"; an engine at the estimate would be {ceiling:.2f}x {REFERENCE_BASELINE}" if ceiling else ""),
            format_table(["engine", "config", "batch wall", "estimate / wall"], rows)]
