"""The ``kiln`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

from kiln.config import DEFAULT_LEVEL, CUDAGraphMode

__all__ = ["main"]


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None
    if any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"token counts must be positive, got {text!r}")
    return sizes


def _compilation_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Only the flags the user gave: a level's defaults must not be overwritten."""
    overrides: dict[str, Any] = {}
    if args.compile_sizes is not None:
        overrides["compile_sizes"] = args.compile_sizes
    if args.cudagraph_mode is not None:
        overrides["cudagraph_mode"] = args.cudagraph_mode
    return overrides


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt, streamed to stdout")
    p.add_argument("--model", default="demo", help="checkpoint directory, or 'demo' (default)")
    p.add_argument("--prompt", default="Once upon a time", help="prompt text")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument(
        "-O", dest="level", type=int, default=DEFAULT_LEVEL, choices=[0, 1, 2, 3],
        help=f"optimization level (default {DEFAULT_LEVEL}): 0 eager, 1 compiled range, 2 + exact sizes, 3 + autotuning",
    )
    p.add_argument("--compile-sizes", type=_sizes, default=None, metavar="N,N,...",
                   help="token counts compiled exactly (default: the level's)")
    p.add_argument("--cudagraph-mode", default=None, choices=[m.value for m in CUDAGraphMode],
                   help="CUDA graph mode (GPU only; default: the level's)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the checkpoint's)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--cache-dir", default=None, help="kiln's cache directory")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress and print the startup report")


def _generate(args: argparse.Namespace) -> int:
    from kiln import Runtime, SamplingParams

    rt = Runtime.load(
        args.model,
        optimization_level=args.level,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        cache_dir=args.cache_dir,
        **_compilation_overrides(args),
    )
    if args.verbose:
        print(json.dumps(rt.startup_report, indent=2), file=sys.stderr)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    t0 = time.perf_counter()
    first = None
    n = 0
    reason = None
    for delta in rt.stream(args.prompt, params):
        if first is None:
            first = time.perf_counter()
        n += len(delta.token_ids)
        reason = delta.finish_reason
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    elapsed = time.perf_counter() - t0
    sys.stdout.write("\n")
    decode_rate = (n - 1) / (time.perf_counter() - first) if first and n > 1 else 0.0
    print(
        f"kiln: {n} tokens in {elapsed:.2f}s ({n / elapsed if elapsed else 0:.1f} tok/s, "
        f"decode {decode_rate:.1f} tok/s), finish={reason}, "
        f"startup {rt.startup_report['total_seconds']:.2f}s, -O{args.level} on {rt.device}",
        file=sys.stderr,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln", description="kiln: a compiler-centric LLM inference runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "generate":
            return _generate(args)
    except (ValueError, OSError) as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
