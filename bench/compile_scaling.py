"""Cold compile time against depth: the same width, 2 layers and 24 layers.

Identical decoder-layer pieces are compiled once, so the number of Inductor
compilations must not grow with depth and the cold compile time should barely
move (target: 24 layers <= 1.5x 2 layers). Each load runs in a fresh process with
an empty compile cache.

    python -m bench.compile_scaling [-O 2]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.decode import DEFAULT_OUT_DIR, _path_placeholders, machine_info, scrub_paths

CHILD = r"""
import json, sys
from kiln import Runtime
rt = Runtime.load(sys.argv[1], optimization_level=int(sys.argv[2]), cache_dir=sys.argv[3], num_kv_blocks=64)
r = rt.startup_report
print(json.dumps({k: r[k] for k in ("phases", "total_seconds", "inductor_compiles", "pieces", "unique_pieces")}))
"""


def build(path: Path, layers: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                         tie_word_embeddings=True, rms_norm_eps=1e-5)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(path))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compile_scaling")
    p.add_argument("-O", dest="level", type=int, default=2, choices=[1, 2, 3])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR)
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kiln-scaling-"))
    results: dict[int, Any] = {}
    try:
        for layers in (2, 24):
            model = work / f"l{layers}"
            build(model, layers)
            proc = subprocess.run([sys.executable, "-c", CHILD, str(model), str(args.level), str(work / f"c{layers}")],
                                  capture_output=True, text=True, timeout=3600)
            if proc.returncode != 0:
                raise RuntimeError(proc.stderr[-3000:])
            results[layers] = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cold = {n: r["phases"]["trace"] + r["phases"]["split"] + r["phases"]["compile"] for n, r in results.items()}
    now = dt.datetime.now(dt.timezone.utc)
    report = {
        "benchmark": "compile_scaling",
        "started_at": now.isoformat(timespec="seconds"),
        "machine": machine_info("cpu"),
        "level": args.level,
        "width": "SmolLM2-135M (hidden 576, 9/3 heads, intermediate 1536, vocab 49152)",
        "results": {str(n): r for n, r in results.items()},
        "cold_compile_seconds": {str(n): s for n, s in cold.items()},
        "ratio_24_over_2": cold[24] / cold[2],
        "same_inductor_compiles": results[2]["inductor_compiles"] == results[24]["inductor_compiles"],
        "target_ratio_max": 1.5,
    }
    print(f"cold compile at -O{args.level} (trace + split + Inductor), SmolLM2-135M width:")
    for n in (2, 24):
        r = results[n]
        print(f"  {n:2d} layers: {cold[n]:7.2f} s, {r['inductor_compiles']} Inductor compilations, "
              f"{r['pieces']} pieces ({r['unique_pieces']} unique)")
    print(f"  24 / 2 = {report['ratio_24_over_2']:.2f}x (target <= 1.5x)")
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = now.strftime("%Y%m%d-%H%M%S")
    text = json.dumps(scrub_paths(report, _path_placeholders()), indent=2) + "\n"
    for name in (f"compile-scaling-cpu-{stamp}.json", "compile-scaling-cpu-latest.json"):
        tmp = args.out / (name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, args.out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
