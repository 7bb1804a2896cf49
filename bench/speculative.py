"""Speculative decoding by prompt lookup: one request at a time, kiln with
and without it, and transformers' own prompt lookup as the baseline.

    python -m bench.speculative [--max-tokens 128] [--repeats 3] [--k 4]

SmolLM2-135M-Instruct (``kiln fetch-demo``), fp32, greedy, at ``-O2``,
answers chat prompts of four kinds: copying a passage, editing code (most of
the answer is the code again), continuing a list, and a free story (which
copies little). Each prompt runs through kiln plain, kiln with
``speculative_config={"method": "ngram", "num_speculative_tokens": K,
"prompt_lookup_max": 4, "prompt_lookup_min": 2}``, transformers ``generate``
(eager, sdpa) and transformers ``generate(prompt_lookup_num_tokens=K)``, in
turns, a round each repeat; the figure is output tokens over the wall time of
the request (prefill included), the median over rounds. Also reported: the
steps kiln took, the drafts it ran and kept, and whether each engine's tokens
equal plain kiln's (greedy decoding with and without drafts should give the
same tokens; a verifying step's several rows and a plain step's one row may
round differently, so near-ties can differ).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common.report import RESULTS_DIR, RunRecord, fmt, format_table, publish

PASSAGE = ("The river Seine rises at Source-Seine, 30 kilometres northwest of Dijon, and flows through Paris "
           "into the English Channel at Le Havre. It is navigable by ocean-going vessels as far as Rouen, and "
           "its tributaries include the Marne, the Oise and the Yonne.")
CODE = ("def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return totl / len(values)\n\n"
        "def variance(values):\n    m = mean(values)\n    return sum((v - m) ** 2 for v in values) / len(values)\n")
PROMPTS = {
    "copy a passage": f"Repeat this text exactly, word for word:\n\n{PASSAGE}",
    "edit code": f"Fix the typo in this Python code and write out the whole corrected code:\n\n{CODE}",
    "continue a list": "Continue this list to twelve lines:\n1. January\n2. February\n3. March\n4. April",
    "free story": "Write a short story about a lighthouse keeper.",
}


def _kiln_run(rt: Any, ids: list[int], max_tokens: int) -> dict[str, Any]:
    from kiln import SamplingParams

    before = rt.stats()
    t0 = time.perf_counter()
    out = rt.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0))[0]
    wall = time.perf_counter() - t0
    after = rt.stats()
    return {"token_ids": out.token_ids, "seconds": wall, "tokens_per_s": len(out.token_ids) / wall,
            "steps": after.steps - before.steps, "drafts": after.num_draft_tokens - before.num_draft_tokens,
            "accepted": after.num_accepted_tokens - before.num_accepted_tokens}


def _hf_run(model: Any, ids: list[int], max_tokens: int, eos: list[int], lookup: int | None) -> dict[str, Any]:
    extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
                             **extra)
    wall = time.perf_counter() - t0
    tokens = out[0, len(ids):].tolist()
    return {"token_ids": tokens, "seconds": wall, "tokens_per_s": len(tokens) / wall}


def _median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"])
    return {**ordered[len(ordered) // 2], "runs_tokens_per_s": [r["tokens_per_s"] for r in runs]}


def speculative_report(args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    from kiln import Runtime
    from kiln.checkpoint.demo import chat_model_path
    from kiln.entrypoints.chat import render_chat

    path = chat_model_path()
    if not path.is_file():
        raise SystemExit(f"bench.speculative needs the demo model at {path}: run `kiln fetch-demo` first")
    record = RunRecord("speculative", "cpu")
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    engines = {"kiln -O2": Runtime.load(str(path)), "kiln -O2, prompt lookup": Runtime.load(str(path),
                                                                                          speculative_config=spec)}
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    eos = list(engines["kiln -O2"].config.eos_token_ids)
    runners = {**{name: (lambda ids, rt=rt: _kiln_run(rt, ids, args.max_tokens)) for name, rt in engines.items()},
               "transformers": lambda ids: _hf_run(hf, ids, args.max_tokens, eos, None),
               "transformers, prompt lookup": lambda ids: _hf_run(hf, ids, args.max_tokens, eos, args.k)}
    results = []
    for kind, text in PROMPTS.items():
        ids = render_chat(engines["kiln -O2"].tokenizer, [{"role": "user", "content": text}])
        for run in runners.values():
            run(ids)  # warm-up
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in runners}
        for _ in range(args.repeats):  # the engines take turns
            for name, run in runners.items():
                runs[name].append(run(ids))
        plain = runs["kiln -O2"][0]["token_ids"]
        for name in runners:
            row = _median_row(runs[name])
            row["same_tokens_as_plain_kiln"] = row["token_ids"] == plain
            results.append({"prompt": kind, "engine": name, "prompt_tokens": len(ids),
                            **{k: v for k, v in row.items() if k != "token_ids"}, "tokens": len(row["token_ids"])})
    for rt in engines.values():
        rt.close()
    return {**record.head(torch_threads=torch.get_num_threads()),
            "settings": {"model": path.name, "dtype": "float32", "level": 2, "greedy": True,
                         "max_tokens": args.max_tokens, "repeats": args.repeats, "speculative_config": spec,
                         "transformers": f"generate, eager, prompt_lookup_num_tokens={args.k} for its lookup",
                         "statistic": "median tokens/s over rounds taking turns", "prompts": PROMPTS},
            "results": results}


def render(report: dict[str, Any]) -> str:
    base = {(r["prompt"]): r["tokens_per_s"] for r in report["results"] if r["engine"] == "transformers"}
    rows = []
    for r in report["results"]:
        kept = f"{r['accepted']}/{r['drafts']}" if "drafts" in r else "-"
        rows.append([r["prompt"], r["engine"], str(r["tokens"]), str(r.get("steps", "-")), kept,
                     fmt(r["tokens_per_s"], 1), f"{r['tokens_per_s'] / base[r['prompt']]:.2f}x",
                     "yes" if r["same_tokens_as_plain_kiln"] else "no"])
    s = report["settings"]
    return (f"Prompt lookup on {s['model']} (fp32, greedy, batch 1), CPU, {report['machine']['torch_threads']} "
            f"threads; speculative_config {s['speculative_config']}\n\n"
            + format_table(["prompt", "engine", "tokens", "steps", "drafts kept", "tokens/s", "vs transformers",
                            "tokens = plain kiln"], rows))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.speculative", description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens a request at most (default 128)")
    p.add_argument("--repeats", type=int, default=3, help="rounds of the four engines (default 3)")
    p.add_argument("--k", type=int, default=4, help="drafts a step at most, both engines (default 4)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory (default bench/results)")
    args = p.parse_args(argv)
    if min(args.max_tokens, args.repeats, args.k, args.threads) < 1:
        p.error("--max-tokens, --repeats, --k and --threads must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    report = speculative_report(args)
    publish(report, "speculative", render(report), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
