"""kiln against llama.cpp on one machine, one model file and one run: batch-1
decode (llama.cpp's ``tg128``) and a 512-token prompt's prefill (``pp512``) in
fp32, bf16 and the demo file's own Q4_1 blocks.

Run from the repository root, with a llama.cpp build of your own (an optional
baseline, not a dependency: for example the ``vendor/llama.cpp`` of PyPI's
``llama-cpp-python`` sdist, ``cmake -G Ninja -DCMAKE_BUILD_TYPE=Release`` and
``ninja llama-bench llama-quantize``, about 8 minutes on 2 cores)::

    python -m bench.llama_cpp --llama-cpp path/to/llama.cpp/build
    python -m bench.llama_cpp --llama-cpp BUILD --precisions f32,q4_1 --repeats 5
    python -m bench.llama_cpp --llama-cpp BUILD --precisions f32,q8_0,q8_0-a8,q4_1,q4_1-a8

The model is the demo file (``kiln fetch-demo``: SmolLM2-135M-Instruct,
linears in Q4_1, embedding in Q8_0) unless ``--model`` names another GGUF.
``llama-quantize --allow-requantize`` writes its F32 and BF16 copies into a
temporary directory: the same dequantized weights in both systems, and each
system reads the very file the other one does. Per precision, kiln loads that
file at ``--level`` (``dtype`` float32 or bfloat16; the Q4_1 file with
``quantization="gguf"``, its blocks kept packed, and as ``q4_1-a8`` with
``"gguf-a8"``, its activations also rounded to int8 as llama.cpp's are; the
Q8_0 copy, ``llama-quantize``'s too, the same two ways). With ``f32`` among
the precisions, each kiln figure is also given against kiln's own fp32.

The engines take turns (``bench.common.harness.run_engines``), one run each per
round. A llama.cpp run is one ``llama-bench -p 512 -n 128 -r 1`` process (its own
warm-up included, not timed); a kiln run is one 512-token prompt (random ids,
one new token: time to the first token) and one short chat prompt decoding 128
tokens, streamed (prefix caching off). llama.cpp's ``tg128`` decodes from an
empty context, kiln's after a prompt of a few dozen tokens: its steps read a
little more KV, a fraction of a percent of a step's bytes here.

Decode is bound by memory bandwidth, so the report gives each figure's share of
the machine's limit: the model file's bytes (every weight read once a step; the
tied embedding as the LM head) over the machine's ``sum`` bandwidth measured in
the same run. Prefill is bound by arithmetic. JSON goes to
``bench/results/llama-cpp-cpu-<stamp>.json`` and ``llama-cpp-cpu-latest.json``.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.adapters.kiln_engine import KilnAdapter
from bench.adapters.llama_cpp import DECODE_TOKENS, PREFILL_TOKENS, LlamaBench, llama_tool, rate_summary
from bench.common.bandwidth import machine_read_bandwidth
from bench.common.harness import BenchSettings, EngineSpec, run_engines
from bench.common.models import chat_prompts, load_tokenizer, make_prompt, resolve_model_arg
from bench.common.report import RESULTS_DIR, RunRecord, fmt, markdown_table, publish

# precision -> (llama-quantize's type name, or None for the file as given; kiln's dtype; kiln's quantization)
PRECISIONS: dict[str, tuple[str | None, str, str | None]] = {
    "f32": ("F32", "float32", None),
    "bf16": ("BF16", "bfloat16", None),
    "q4_1": (None, "float32", "gguf"),
    "q4_1-a8": (None, "float32", "gguf-a8"),  # kiln rounding the activations to int8, as llama.cpp does
    "q8_0": ("Q8_0", "float32", "gguf"),  # requantized by llama-quantize; kiln keeps its blocks packed
    "q8_0-a8": ("Q8_0", "float32", "gguf-a8"),
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.llama_cpp", description=__doc__.splitlines()[0])
    p.add_argument("--llama-cpp", type=Path, required=True,
                   help="llama.cpp's build directory (holding bin/llama-bench and bin/llama-quantize)")
    p.add_argument("--model", default="demo", help="a .gguf file, or demo (default)")
    p.add_argument("--precisions", default=",".join(PRECISIONS),
                   help=f"comma-separated, of {', '.join(PRECISIONS)} (default all)")
    p.add_argument("--level", type=int, default=2, help="kiln optimization level (default 2)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine (default 3)")
    p.add_argument("--threads", type=int, default=2, help="threads for both systems (default 2)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory (default bench/results)")
    args = p.parse_args(argv)
    args.precisions = args.precisions.replace(",", " ").split()
    bad = [x for x in args.precisions if x not in PRECISIONS]
    if bad or not args.precisions:
        p.error(f"--precisions: unknown {bad}; known: {list(PRECISIONS)}")
    for tool in ("llama-bench", "llama-quantize"):
        if not llama_tool(args.llama_cpp, tool).is_file():
            p.error(f"--llama-cpp {args.llama_cpp}: no bin/{tool} there (build it: ninja {tool})")
    args.model_path = resolve_model_arg(args.model)
    if args.model_path.suffix.lower() != ".gguf":
        p.error(f"--model {args.model}: {args.model_path} is not a .gguf file (llama.cpp reads GGUF only)")
    return args


def model_files(args: argparse.Namespace, workdir: Path) -> dict[str, Path]:
    """Per precision, the GGUF file both systems read: the model as given, or
    ``llama-quantize``'s copy of it in ``workdir``."""
    files = {}
    for precision in args.precisions:
        target = PRECISIONS[precision][0]
        if target is None:
            files[precision] = args.model_path
            continue
        out = workdir / f"{args.model_path.stem}.{target}.gguf"
        if out.exists():  # a precision sharing its file with another (q8_0, q8_0-a8)
            files[precision] = out
            continue
        cmd = [str(llama_tool(args.llama_cpp, "llama-quantize")), "--allow-requantize", str(args.model_path), str(out),
               target, str(args.threads)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"llama-quantize to {target} failed ({done.returncode}): {done.stderr[-2000:]}")
        files[precision] = out
    return files


class KilnPair(KilnAdapter):
    """kiln on one file: a run is one 512-token prefill (one new token) and one
    128-token decode from a short chat prompt, each streamed alone."""

    def __init__(self, model_file: Path, precision: str, level: int, chat_prompt: list[int], vocab_size: int) -> None:
        _, dtype, quantization = PRECISIONS[precision]
        settings = BenchSettings(DECODE_TOKENS, 1, "cpu", dtype, quantization=quantization)
        super().__init__(model_file, level, settings, max_num_seqs=1,
                         max_model_len=max(PREFILL_TOKENS + 1, len(chat_prompt) + DECODE_TOKENS + 1))
        self.label = f"-O{level} {precision}"
        self.chat_prompt = chat_prompt
        self.long_prompt = make_prompt(vocab_size, PREFILL_TOKENS, seed=0)

    def run_once(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        for _ in self.rt.stream(self.long_prompt, self._params(1)):
            pass
        prefill = time.perf_counter() - t0
        tokens: list[int] = []
        t_first = t_last = 0.0
        for delta in self.rt.stream(self.chat_prompt, self._params(DECODE_TOKENS + 1)):
            t_last = time.perf_counter()
            if not tokens:
                t_first = t_last
            tokens.extend(delta.token_ids)
        # the first token comes from the prompt's prefill; the other 128 are decode steps
        return {"token_ids": tokens, "prefill_tokens_per_s": PREFILL_TOKENS / prefill,
                "decode_tokens_per_s": (len(tokens) - 1) / (t_last - t_first)}

    def summary(self, runs: list[dict[str, Any]]) -> dict[str, Any]:
        return {**self._head(), **rate_summary(self.engine, self.label, runs)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    record = RunRecord("llama-cpp", "cpu")
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.model_path)
    _, ids, _ = chat_prompts(tokenizer, 1)
    workdir = Path(tempfile.mkdtemp(prefix="kiln-bench-llama-cpp-"))
    try:
        files = model_files(args, workdir)
        specs = []
        for precision, path in files.items():
            specs.append(EngineSpec({"engine": "llama.cpp", "label": precision},
                                    lambda path=path, precision=precision: LlamaBench(args.llama_cpp, path, precision,
                                                                                      args.threads)))
            specs.append(EngineSpec({"engine": "kiln", "level": args.level, "label": f"-O{args.level} {precision}"},
                                    lambda path=path, precision=precision: KilnPair(
                                        path, precision, args.level, ids[0], len(tokenizer))))
        before = machine_read_bandwidth()
        results = run_engines(specs, args.repeats, None)
        machine = max(before, machine_read_bandwidth(), key=lambda m: m["gb_per_s"])
        sizes = {p: f.stat().st_size for p, f in files.items()}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    rows: dict[str, dict[str, Any]] = {}
    for i, precision in enumerate(files):
        llama, kiln = results[2 * i], results[2 * i + 1]  # run_engines keeps the specs' order
        limit = machine["gb_per_s"] * 1e9 / sizes[precision]
        row: dict[str, Any] = {"file_bytes": sizes[precision], "roofline_tokens_per_s": round(limit, 1),
                               "llama.cpp": llama, "kiln": kiln}
        for key in ("decode_tokens_per_s", "prefill_tokens_per_s"):
            a, b = kiln.get(key), llama.get(key)
            row[f"{key.removesuffix('_tokens_per_s')}_kiln_vs_llama_cpp"] = round(a / b, 3) if a and b else None
        rows[precision] = row
    dense = rows.get("f32", {}).get("kiln", {}).get("decode_tokens_per_s")
    for row in rows.values():
        rate = row["kiln"].get("decode_tokens_per_s")
        row["decode_kiln_vs_kiln_f32"] = round(rate / dense, 3) if rate and dense else None
    return {**record.head(torch_threads=args.threads),
            "model": {"file": args.model_path.name, "tokenizer_vocab": len(tokenizer)},
            "settings": {"level": args.level, "repeats": args.repeats, "threads": args.threads,
                         "prefill_tokens": PREFILL_TOKENS, "decode_tokens": DECODE_TOKENS,
                         "kiln_decode_prompt_tokens": len(ids[0]),
                         "schedule": "engines take turns: each round runs every engine once, order rotating"},
            "machine_bandwidth": machine, "results": rows}


def render(report: dict[str, Any]) -> str:
    rows = []
    for precision, r in report["results"].items():
        llama, kiln, limit = r["llama.cpp"], r["kiln"], r["roofline_tokens_per_s"]

        def share(rate: float | None) -> str:
            return fmt(rate / limit * 100 if rate else None, 0, "%")

        rows.append([precision, fmt(r["file_bytes"] / 1e6, 1),
                     fmt(llama.get("decode_tokens_per_s"), 1), fmt(kiln.get("decode_tokens_per_s"), 1),
                     fmt(r["decode_kiln_vs_llama_cpp"], 2, "x"), fmt(r.get("decode_kiln_vs_kiln_f32"), 2, "x"),
                     f"{share(llama.get('decode_tokens_per_s'))} / {share(kiln.get('decode_tokens_per_s'))}",
                     fmt(llama.get("prefill_tokens_per_s"), 1), fmt(kiln.get("prefill_tokens_per_s"), 1),
                     fmt(r["prefill_kiln_vs_llama_cpp"], 2, "x"),
                     "; ".join(x["error"] for x in (llama, kiln) if "error" in x)])
    s, m = report["settings"], report["machine_bandwidth"]
    return "\n".join([
        f"{report['model']['file']}, {s['threads']} threads, kiln -O{s['level']}; machine sum bandwidth "
        f"{m['gb_per_s']} GB/s",
        "",
        markdown_table(["precision", "file MB", "llama.cpp tg128", "kiln decode", "kiln / llama.cpp",
                        "kiln / kiln f32", "of the bandwidth limit (llama.cpp / kiln)", "llama.cpp pp512", "kiln prefill 512",
                        "kiln / llama.cpp", "error"], rows),
    ])


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    report = run(args)
    publish(report, "llama-cpp", render(report), args.out)
    failed = [p for p, r in report["results"].items() if "error" in r["kiln"] or "error" in r["llama.cpp"]]
    if failed:
        print(f"failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
