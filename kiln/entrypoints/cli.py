"""The ``kiln`` command line: generate, chat, compile, cache, fetch-demo."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kiln.config import DEFAULT_LEVEL, CUDAGraphMode
from kiln.entrypoints.openai.reasoning import REASONING_PARSERS
from kiln.entrypoints.openai.tool_parsers import TOOL_PARSERS
from kiln.quick_exit import exit_now

__all__ = ["main"]

MODEL_HELP = ("a checkpoint directory, a .gguf file, a bundle from `kiln compile`, a Hugging Face repo id "
              "in the local cache, 'demo' (SmolLM2-135M-Instruct, after `kiln fetch-demo`) or 'random-demo'")


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


_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
          "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


def _byte_size(value: str) -> int:
    """``4G``, ``512MiB``, ``1.5GB`` or a count of bytes, as an int: K, M, G, T
    are powers of 1000 and Ki, Mi, Gi, Ti of 1024, with or without ``B``, as
    vLLM reads its memory sizes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?)?b?\s*", value, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"{value!r} is not a size: bytes, or a number with K, M, G, T, Ki, Mi, "
                                         "Gi or Ti (4G, 512MiB)")
    size = int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])
    if size < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive size")
    return size


def _add_model_options(p: argparse.ArgumentParser, levels: list[int]) -> None:
    p.add_argument(
        "-O", dest="level", type=int, default=None, choices=levels,
        help=f"optimization level (default {DEFAULT_LEVEL}, or a bundle's): 0 eager, 1 compiled range, "
             "2 + exact sizes, 3 + autotuning",
    )
    p.add_argument("--compile-sizes", type=_sizes, default=None, metavar="N,N,...",
                   help="token counts compiled exactly (default: the level's)")
    p.add_argument("--cudagraph-mode", default=None, choices=[m.value for m in CUDAGraphMode],
                   help="CUDA graph mode (GPU only; default: the level's)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the checkpoint's)")
    p.add_argument("--quantization", default=None, choices=["int8", "gguf", "int8-a8", "gguf-a8"],
                   help="packed linear layers: int8 (per-row int8 from any checkpoint) or gguf (a GGUF file's "
                        "Q8_0/Q4_0/Q4_1 tensors kept as stored); -a8 also rounds their inputs to int8 (faster "
                        "with AVX512-VNNI, as llama.cpp); default: dense weights (a bundle's setting)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("-v", "--verbose", action="store_true", help="log progress and print reports")


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template (a file, or the template itself) instead of the tokenizer's")
    p.add_argument("--attention-backend", default=None, choices=["auto", "torch", "triton"],
                   help="attention kernels (default: $KILN_ATTENTION_BACKEND, else auto: triton on CUDA, torch on CPU)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=_byte_size, default=None, metavar="SIZE",
                   help="memory for the KV cache: bytes, or with a unit (4G, 512MiB, 1.5GB; default: 2 GiB on CPU, "
                        "--gpu-memory-utilization of the GPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="the share of GPU memory the model and its KV cache may take, in (0, 1] (default 0.9)")
    p.add_argument("--block-size", type=int, default=None, help="tokens a KV cache block (default 16)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding by prompt lookup, as vLLM takes it: \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
                        "(greedy requests; default: off)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="recompute shared prompt prefixes instead of reusing their cached KV blocks")
    p.add_argument("--cache-dir", default=None, help="kiln's cache directory")
    p.add_argument("--compile", default=None, choices=["blocking", "background", "eager-first"],
                   help="on a compile-cache miss: compile before serving (blocking), or serve eagerly at once and "
                        "swap the compiled pieces in when a background build finishes (background); eager-first: "
                        "serve eagerly at once even on a hit or from a bundle, and swap the compiled pieces in "
                        "once loaded (or built); default: background for `kiln serve`, blocking otherwise")


def _add_run_options(p: argparse.ArgumentParser, max_tokens: int) -> None:
    """A model to run, and how to sample it."""
    p.add_argument("--model", default="demo", help=f"{MODEL_HELP} (default 'demo')")
    _add_model_options(p, [0, 1, 2, 3])
    _add_engine_options(p)
    p.add_argument("--max-tokens", type=int, default=max_tokens, help=f"tokens to generate (default {max_tokens})")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--min-tokens", type=int, default=0, help="no EOS or stop before this many tokens (default 0)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divides the logits of tokens seen so far (above 1: fewer repeats; default 1, off)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2] (default 0, off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2] (default 0, off)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    structured = p.add_mutually_exclusive_group()
    structured.add_argument("--json", dest="structured", action="store_const", const="json_object", default=None,
                            help="keep the answer to a JSON object")
    structured.add_argument("--json-schema", default=None, metavar="FILE",
                            help="keep the answer to a value of the JSON Schema in FILE")


def _sampling_params(args: argparse.Namespace) -> Any:
    """The sampling flags as SamplingParams, checked before anything loads (a bad
    flag must not wait for a compile); errors name the flag."""
    from kiln import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, min_p=args.min_p, min_tokens=args.min_tokens,
                            repetition_penalty=args.repetition_penalty,
                            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                            seed=args.seed, ignore_eos=args.ignore_eos,
                            structured=_json_schema(args.json_schema) or args.structured)
    try:
        params.validate("SamplingParams")
    except ValueError as e:
        message = str(e).replace("SamplingParams.structured", "--json-schema")
        for f in dataclasses.fields(params):
            message = message.replace(f"SamplingParams.{f.name}", "--" + f.name.replace("_", "-"))
        raise ValueError(message) from None
    return params


def _json_schema(path: str | None) -> dict[str, Any] | None:
    """``--json-schema FILE``: the schema, or a ValueError naming the file."""
    if path is None:
        return None
    try:
        schema = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"--json-schema: cannot read {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--json-schema: {path} is not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema: {path} must hold a JSON Schema object, got {type(schema).__name__}")
    return schema


def _load_options(args: argparse.Namespace) -> dict[str, Any]:
    """The flags of a command that runs a model, as Runtime.load options."""
    return dict(
        optimization_level=args.level, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
        quantization=args.quantization, max_num_seqs=getattr(args, "max_num_seqs", None),
        max_num_batched_tokens=args.max_num_batched_tokens,
        cache_dir=args.cache_dir, attention_backend=args.attention_backend,
        enable_prefix_caching=args.enable_prefix_caching, kv_cache_memory_bytes=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization, block_size=args.block_size,
        seed=getattr(args, "engine_seed", None), speculative_config=args.speculative_config,
        compile=args.compile or ("background" if args.command == "serve" else "blocking"),
        **_compilation_overrides(args),
    )


def _load(args: argparse.Namespace) -> Any:
    from kiln import Runtime

    rt = Runtime.load(args.model, **_load_options(args))
    if args.verbose:
        print(json.dumps(rt.startup_report, indent=2), file=sys.stderr)
    return rt


def _generate(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    template = _chat_template(args.chat_template)
    rt = _load(args)
    t0 = time.perf_counter()
    first, n, reason = None, 0, None
    messages = [{"role": "user", "content": args.prompt}]
    for delta in (rt.stream_chat(messages, params, chat_template=template) if args.chat
                  else rt.stream(args.prompt, params)):
        first = first or time.perf_counter()
        n += len(delta.token_ids)
        reason = delta.finish_reason
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    elapsed = time.perf_counter() - t0
    sys.stdout.write("\n")
    decode_rate = (n - 1) / (time.perf_counter() - first) if first and n > 1 else 0.0
    print(
        f"kiln: {n} tokens in {elapsed:.2f}s ({n / elapsed if elapsed else 0:.1f} tok/s, "
        f"decode {decode_rate:.1f} tok/s), finish={reason}, startup {rt.startup_report['total_seconds']:.2f}s, "
        f"-O{rt.startup_report['optimization_level']} on {rt.device}",
        file=sys.stderr,
    )
    return 0


def _chat(args: argparse.Namespace) -> int:
    from kiln.entrypoints.chat_repl import ChatSession, run_repl

    params = _sampling_params(args)
    template = _chat_template(args.chat_template)
    rt = _load(args)
    if sys.stdin.isatty():
        r = rt.startup_report
        print(f"kiln chat: {args.model} ({r['architecture']}, -O{r['optimization_level']}, loaded in "
              f"{r['total_seconds']:.1f}s). Ctrl-C stops an answer; /exit leaves.", file=sys.stderr)
    return run_repl(ChatSession(rt, params, args.system, chat_template=template), verbose=args.verbose)


def _compile(args: argparse.Namespace) -> int:
    import shutil
    import tempfile

    from kiln.cache.bundle import write_bundle
    from kiln.engine.loader import build_compiled

    t0 = time.perf_counter()
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not empty; choose another --out")
    # A private cache: its Inductor directory then holds exactly what the bundle needs.
    private = Path(tempfile.mkdtemp(prefix="kiln-compile-"))
    try:
        record, r = build_compiled(
            args.model, private, optimization_level=args.level, device=args.device, dtype=args.dtype,
            quantization=args.quantization, max_num_batched_tokens=args.max_num_batched_tokens,
            **_compilation_overrides(args),
        )
        summary = write_bundle(record, out, args.include_weights)
    finally:
        shutil.rmtree(private, ignore_errors=True)
    mib = 1 << 20
    print(
        f"kiln: bundle {summary['path']}: -O{r['optimization_level']}, {r['pieces']} pieces "
        f"({r['unique_pieces']} unique), {r['inductor_compiles']} Inductor compilations in "
        f"{r['phases'].get('compile', 0):.1f}s (trace {r['phases'].get('trace', 0):.1f}s); "
        f"compiled {summary['compiled_bytes'] / mib:.1f} MiB, model files {summary['model_bytes'] / mib:.1f} MiB"
        f"{'' if args.include_weights else ' (no weights)'}; {time.perf_counter() - t0:.1f}s in all",
        file=sys.stderr,
    )
    return 0


def _cache_root(args: argparse.Namespace) -> Path:
    from kiln.config import default_cache_dir

    return Path(args.cache_dir).expanduser() if args.cache_dir else default_cache_dir()


def _cache(args: argparse.Namespace) -> int:
    from kiln.cache.entries import clear_entries, list_entries, verify_entries

    root = _cache_root(args)
    if args.action == "ls":
        rows = list_entries(root)
        if not rows:
            print(f"no compiled entries in {root}")
        for e in rows:
            print(f"{e.key}  {e.model:<22} -O{e.level}  {e.size / (1 << 20):8.1f} MiB  "
                  f"{_age(e.age_seconds):>8}  {'ok' if e.complete else 'incomplete'}")
        return 0
    if args.action == "verify":
        bad = 0
        for key, problems in verify_entries(root):
            bad += bool(problems)
            print(f"{key}  {'ok' if not problems else 'CORRUPT: ' + ', '.join(problems[:5])}")
        return 1 if bad else 0
    removed = clear_entries(root)  # CacheClearError (an OSError) names what could not be removed
    print(f"removed {removed} compiled entries from {root}")
    return 0


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def _chat_template(value: str | None) -> str | None:
    """``--chat-template``: a Jinja file, or (as vLLM takes it) the template itself."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template: {value} is not a file (nor a Jinja template)")


def _serve(args: argparse.Namespace) -> int:
    from kiln.engine.loader import parse_options
    from kiln.entrypoints.openai.server import serve

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(TOOL_PARSERS)})")
    template = _chat_template(args.chat_template)
    options = _load_options(args)
    parse_options(args.model, **options)  # a bad option fails now, not after the port opened
    return serve(args.model, host=args.host, port=args.port, served_model_name=args.served_model_name,
                 load_options=options, log_level="info" if args.verbose else "warning", chat_template=template,
                 tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                 api_key=args.api_key or os.environ.get("KILN_API_KEY") or None)


def _fetch_demo(args: argparse.Namespace) -> int:
    from kiln.checkpoint.demo import chat_model_path, fetch_chat_model

    path = fetch_chat_model(chat_model_path(_cache_root(args)).parent)
    print(f"kiln: demo model at {path} ({path.stat().st_size / (1 << 20):.0f} MiB)", file=sys.stderr)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="kiln: a compiler-centric LLM inference runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("generate", help="generate text from a prompt, streamed to stdout")
    p.add_argument("--prompt", default="Once upon a time", help="prompt text")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    _add_run_options(p, max_tokens=128)
    p = sub.add_parser("chat", help="an interactive chat: Ctrl-C stops an answer, /exit or end of input leaves")
    p.add_argument("--system", default=None, help="a system message opening the conversation")
    _add_run_options(p, max_tokens=512)
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, ...)")
    p.add_argument("model", nargs="?", default="demo", help=f"{MODEL_HELP} (default 'demo')")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the model's name in the API (default: MODEL)")
    p.add_argument("--seed", dest="engine_seed", type=int, default=None, metavar="N",
                   help="the engine's seed: sampled requests without a seed of their own draw from it (default 0)")
    p.add_argument("--api-key", default=None,
                   help="ask every /v1 request for 'Authorization: Bearer KEY' (401 otherwise; default: "
                        "$KILN_API_KEY, else none)")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="parse the tool calls a chat answer writes into OpenAI's tool_calls when a request offers "
                        "tools: hermes (<tool_call> blocks: Qwen2.5, Qwen3, Hermes), llama3_json (Llama 3.1+) or "
                        "mistral ([TOOL_CALLS])")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted as vLLM takes it; --tool-call-parser alone enables tool_choice 'auto'")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="send a chat answer's <think> reasoning as reasoning_content, apart from its content: "
                        "qwen3 or deepseek_r1 (whose template opens <think> in the prompt)")
    _add_engine_options(p)
    _add_model_options(p, [0, 1, 2, 3])
    p = sub.add_parser("compile", help="prebuild a relocatable bundle: Runtime.load(DIR) then starts warm")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--out", required=True, help="bundle directory to create (must not exist or be empty)")
    _add_model_options(p, [1, 2, 3])
    p.add_argument("--include-weights", action="store_true",
                   help="copy the weights (safetensors files, or the .gguf) into the bundle")
    for name, help_ in (("cache", "list, verify or clear compiled entries"),
                        ("fetch-demo", "download the demo model (SmolLM2-135M-Instruct, ~93 MB) once")):
        p = sub.add_parser(name, help=help_)
        if name == "cache":
            p.add_argument("action", choices=["ls", "verify", "clear"])
        p.add_argument("--cache-dir", default=None, help="kiln's cache directory (default: KILN_CACHE_DIR, ...)")
    return parser


COMMANDS = {"generate": _generate, "chat": _chat, "serve": _serve, "compile": _compile, "cache": _cache,
            "fetch-demo": _fetch_demo}


# Commands whose process has nothing left to do once they return (no server, no
# threads at work): ``run`` ends it without the interpreter's teardown.
_DONE_WHEN_RETURNED = {"compile"}


def main(argv: Sequence[str] | None = None, *, exit_when_done: bool = False) -> int:
    """Run one ``kiln`` command; its exit status. With ``exit_when_done`` (the
    console command), a command of ``_DONE_WHEN_RETURNED`` that succeeded ends
    the process itself (``kiln.quick_exit.exit_now``)."""
    args = _parser().parse_args(argv)
    verbose = getattr(args, "verbose", False)
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        code = COMMANDS[args.command](args)
    except (ValueError, TypeError, OSError) as e:
        if verbose:
            raise
        print(f"kiln: error: {e}", file=sys.stderr)
        return 1 if isinstance(e, OSError) else 2  # 2: the input was at fault
    except KeyboardInterrupt:
        return 130
    if exit_when_done and code == 0 and args.command in _DONE_WHEN_RETURNED:
        exit_now(code)
    return code


def run() -> None:
    """The ``kiln`` console command (and ``python -m kiln``)."""
    sys.exit(main(exit_when_done=True))


if __name__ == "__main__":
    run()
