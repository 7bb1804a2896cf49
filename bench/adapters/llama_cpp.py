"""llama.cpp as a measured system: its ``llama-bench`` tool on one GGUF file, a
run being one process that measures a 512-token prefill (``pp512``) and 128
decode steps (``tg128``) once each, after its own untimed warm-up.

An optional baseline: kiln does not depend on llama.cpp, and nothing of it is
in this repository; ``bench.llama_cpp`` takes the directory of a build of it.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

from bench.common.harness import Engine, median, rate_spread

__all__ = ["DECODE_TOKENS", "PREFILL_TOKENS", "LlamaBench", "llama_tool", "rate_summary"]

PREFILL_TOKENS = 512
DECODE_TOKENS = 128


def llama_tool(build: Path, name: str) -> Path:
    """A tool of a llama.cpp build directory (``bin/<name>``)."""
    return build / "bin" / name


class LlamaBench(Engine):
    """llama.cpp's ``llama-bench`` on one file: a run is one process measuring
    pp512 and tg128 once each (after llama-bench's own untimed warm-up)."""

    engine = "llama.cpp"

    def __init__(self, build: Path, model_file: Path, precision: str, threads: int) -> None:
        self.label = precision
        self.cmd = [str(llama_tool(build, "llama-bench")), "-m", str(model_file), "-t", str(threads),
                    "-p", str(PREFILL_TOKENS), "-n", str(DECODE_TOKENS), "-r", "1", "-o", "json"]
        self.info: dict[str, Any] = {}

    def run_once(self) -> dict[str, Any]:
        done = subprocess.run(self.cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"llama-bench failed ({exit_reason(done.returncode)}): {' '.join(self.cmd)}: "
                               f"{done.stderr[-2000:]}")
        rows = json.loads(done.stdout)
        pp = [r for r in rows if r["n_prompt"] == PREFILL_TOKENS and r["n_gen"] == 0]
        tg = [r for r in rows if r["n_gen"] == DECODE_TOKENS and r["n_prompt"] == 0]
        if len(pp) != 1 or len(tg) != 1:
            raise RuntimeError(f"llama-bench gave {len(pp)} pp{PREFILL_TOKENS} and {len(tg)} tg{DECODE_TOKENS} "
                               f"results, not one each: {done.stdout[:500]}")
        pp, tg = pp[0], tg[0]
        self.info = {k: tg.get(k) for k in ("build_commit", "build_number", "cpu_info", "backends", "model_type",
                                             "model_size", "n_threads", "type_k", "type_v")}
        # llama-bench generates no text to compare: token_ids is empty
        return {"token_ids": [], "decode_tokens_per_s": tg["avg_ts"], "prefill_tokens_per_s": pp["avg_ts"]}

    def summary(self, runs: list[dict[str, Any]]) -> dict[str, Any]:
        return {**rate_summary(self.engine, self.label, runs), **self.info}


def exit_reason(returncode: int) -> str:
    """A child's exit status as a reader wants it: ``exit status 1``, or the
    signal that killed it (``killed by SIGSEGV``: a llama.cpp build for
    ``-march=native`` faulted in its AMX int8 code on prompts of a quantized
    file on one machine here, while ``tg128`` ran; its build without AMX ran
    both)."""
    if returncode >= 0:
        return f"exit status {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"


def rate_summary(engine: str, label: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The medians of runs holding ``decode_tokens_per_s`` and
    ``prefill_tokens_per_s``, the decode rates' spread, and the runs."""
    runs = [{k: v for k, v in r.items() if k != "token_ids"} for r in runs]
    decode = [r["decode_tokens_per_s"] for r in runs]
    return {"engine": engine, "label": label, "decode_tokens_per_s": median(decode),
            "prefill_tokens_per_s": median([r["prefill_tokens_per_s"] for r in runs]),
            **rate_spread(decode), "runs": runs}
