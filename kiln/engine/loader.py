"""Loading, as a short sequence of named steps, each a function of its own:

    parse_options -> open_source -> resolve_config -> build_model
      -> compile_or_load -> size_kv_cache -> build_engine -> capture_graphs
      -> startup report

``load_engine`` runs them all, timing each phase; ``build_compiled`` (what
``kiln compile`` runs) stops after the compile, with no KV cache, scheduler,
runner or CUDA graphs. Every step reads the one frozen ``ResolvedConfig``.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kiln.attention.backend import create_attention_backend, resolve_attention_backend
from kiln.cache.bundle import Bundle, BuildRecord, read_bundle
from kiln.cache.keys import cache_key
from kiln.cache.lookup import FactorMismatchError, manifest_if_loadable
from kiln.cache.store import private_copy, read_manifest, writable
from kiln.checkpoint import Checkpoint, open_checkpoint
from kiln.checkpoint.names import resolve_model_name
from kiln.compiler.replay import covers
from kiln.config import DEFAULT_LEVEL, CompilationConfig, CUDAGraphMode, EngineConfig, default_cache_dir
from kiln.engine.background_compile import BackgroundCompile, BuildSpec, share_cores
from kiln.engine.kv_cache_manager import KVCacheManager
from kiln.engine.config import (
    ResolvedConfig,
    kv_bytes_per_block,
    resolve_dtype,
    resolve_engine_sizes,
    sampling_defaults,
)
from kiln.engine.core import Engine
from kiln.engine.detokenizer import vocab_bytes
from kiln.engine.runner import CaptureReport, ModelRunner
from kiln.engine.scheduler import Scheduler
from kiln.engine.speculative import NgramProposer
from kiln.graphs import CpuCallGraphs, CUDAGraphDispatcher, GraphCapturer, NativeReplay, TorchCUDAGraphs
from kiln.models import CausalLM, build_model, parse_dtype, parse_model_config
from kiln.models.memory import collapse_to_huge_pages, zeroed_host_memory
from kiln.models.quant import QUANTIZATION_MODES, packed_layers

if TYPE_CHECKING:
    from kiln.compiler.cached import CompiledEntry
    from kiln.compiler.pipeline import CompileStats

__all__ = ["LoadOptions", "LoadedEngine", "build_compiled", "load_engine", "parse_options"]

logger = logging.getLogger(__name__)

_LOAD_FIELDS = {"on_mismatch", "weights_path", "compile", "quantization"}
COMPILE_MODES = ("blocking", "background", "eager-first")
_COMPILATION_FIELDS = {"compile_sizes", "splitting_ops", "inductor_options", "cudagraph_mode",
                       "cudagraph_capture_sizes"}


class Phases:
    """Seconds per named load phase."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.t0 = time.perf_counter()

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = round(self.seconds.get(name, 0.0) + time.perf_counter() - t0, 4)

    def total(self) -> float:
        return round(time.perf_counter() - self.t0, 4)


# ------------------------------------------------------------------ 1. options
@dataclass(frozen=True)
class LoadOptions:
    """What the caller asked for, validated before anything is read from disk."""

    path: str
    optimization_level: int | None
    device: torch.device
    dtype: torch.dtype | None  # None: the checkpoint's (or the bundle's)
    engine: EngineConfig
    compilation: dict[str, Any]  # the compilation fields the user set
    cache_dir: Path
    attention_backend: str
    on_mismatch: str
    weights_path: Path | None
    # "blocking": compile (or load) before serving; "background": serve eagerly while compiling on a
    # miss; "eager-first": serve eagerly until the compiled pieces are loaded (and built, on a miss)
    compile: str
    quantization: str | None  # packed linear layers (kiln.models.quant); None: dense weights


def _resolve_device(device: "str | torch.device | None") -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r} is not a device; use 'cpu' or 'cuda'") from None
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"device={str(device)!r} is not supported; use 'cpu' or 'cuda'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} was asked for, but CUDA is not available")
    return dev


def parse_options(path: "str | Path", *, optimization_level: int | None = None, device: Any = None,
                  dtype: Any = None, cache_dir: "str | Path | None" = None, attention_backend: str | None = None,
                  **fields_: Any) -> LoadOptions:
    """Check every option (types included) before anything loads; ``fields_``
    are EngineConfig fields, compilation fields and the bundle options."""
    engine_fields = {f.name for f in fields(EngineConfig)}
    known = engine_fields | _COMPILATION_FIELDS | _LOAD_FIELDS
    unknown = set(fields_) - known
    if unknown:
        raise TypeError(f"Runtime.load() got unknown option(s) {sorted(unknown)}; known: {sorted(known)}")
    on_mismatch = fields_.get("on_mismatch") or "error"
    if on_mismatch not in ("error", "recompile"):
        raise ValueError(f"on_mismatch must be 'error' or 'recompile', got {on_mismatch!r}")
    compile_mode = fields_.get("compile") or "blocking"
    if compile_mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {', '.join(map(repr, COMPILE_MODES))}, got {compile_mode!r}")
    quantization = fields_.get("quantization")
    if quantization is not None and quantization not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be None or one of {list(QUANTIZATION_MODES)}, got {quantization!r}")
    if optimization_level is not None:
        CompilationConfig(level=optimization_level)  # raises for an unknown level
    compilation = {k: v for k, v in fields_.items() if k in _COMPILATION_FIELDS and v is not None}
    CompilationConfig(**compilation)  # raises naming a bad field
    dev = _resolve_device(device)
    weights_path = fields_.get("weights_path")
    return LoadOptions(
        path=str(path), optimization_level=optimization_level, device=dev,
        dtype=parse_dtype(dtype) if dtype is not None else None,
        engine=EngineConfig(**{k: v for k, v in fields_.items() if k in engine_fields and v is not None}),
        compilation=compilation,
        cache_dir=Path(cache_dir).expanduser() if cache_dir else default_cache_dir(),
        attention_backend=resolve_attention_backend(attention_backend, dev), on_mismatch=on_mismatch,
        weights_path=Path(weights_path).expanduser() if weights_path else None, compile=compile_mode,
        quantization=quantization,
    )


# ------------------------------------------------------------------ 2. source
@dataclass(frozen=True)
class ModelSource:
    """What the path names: a checkpoint, perhaps inside a bundle, and its tokenizer."""

    checkpoint: Checkpoint
    bundle: Bundle | None
    tokenizer: Any


def open_source(options: LoadOptions, phases: Phases) -> ModelSource:
    """The path, demo name or Hugging Face repo id (local cache only), opened."""
    with phases("open_source"):
        path = resolve_model_name(options.path, options.cache_dir)
        bundle = read_bundle(path) if path.is_dir() else None
        checkpoint = bundle.checkpoint(options.weights_path) if bundle is not None else open_checkpoint(path)
    with phases("load_tokenizer"):
        tokenizer = checkpoint.load_tokenizer(options.cache_dir)
    return ModelSource(checkpoint, bundle, tokenizer)


# ------------------------------------------------------------------ 3. config
def _compilation_for(options: LoadOptions, bundle: Bundle | None) -> CompilationConfig:
    """The user's compilation fields; a bundle's settings fill the rest when the
    level is the bundle's (anything asked for differently is a mismatch,
    reported or recompiled when the factors are compared)."""
    if bundle is None:
        level = DEFAULT_LEVEL if options.optimization_level is None else options.optimization_level
        return CompilationConfig(level=level, **options.compilation)
    stored = bundle.manifest["compilation"]
    level = stored["level"] if options.optimization_level is None else options.optimization_level
    merged = dict(options.compilation)
    if level == stored["level"]:
        for k in _COMPILATION_FIELDS:
            if stored.get(k) is not None:
                merged.setdefault(k, stored[k])
    return CompilationConfig(level=level, **merged)


def _quantization_for(options: LoadOptions, source: ModelSource) -> str | None:
    """The quantization asked for, else the bundle's; ``gguf`` (``-a8``) needs a GGUF file."""
    quantization = options.quantization
    if quantization is None and source.bundle is not None:
        quantization = (source.bundle.manifest["factors"]["model"].get("quantization") or {}).get("mode")
    if quantization in ("gguf", "gguf-a8") and source.checkpoint.format != "gguf":
        raise ValueError(f"quantization={quantization!r} keeps a GGUF file's Q8_0/Q4_0/Q4_1 blocks packed, but "
                         f"{source.checkpoint.path} is a {source.checkpoint.format} checkpoint; use "
                         f"{quantization.replace('gguf', 'int8')!r}")
    return quantization


def resolve_config(source: ModelSource, options: LoadOptions) -> ResolvedConfig:
    model = parse_model_config(source.checkpoint)
    bundle = source.bundle
    dtype = resolve_dtype(options.dtype or (bundle.manifest["dtype"] if bundle else None), model, options.device)
    user = options.engine
    if bundle is not None and user.max_num_batched_tokens is None:
        user = EngineConfig(**{**{f.name: getattr(user, f.name) for f in fields(user)},
                               "max_num_batched_tokens": bundle.manifest["engine"]["max_num_batched_tokens"]})
    sizes = resolve_engine_sizes(user, model, dtype, options.device)
    eos = model.eos_token_ids
    if not eos and source.tokenizer is not None and source.tokenizer.eos_token_id is not None:
        eos = (int(source.tokenizer.eos_token_id),)
    return ResolvedConfig(
        model=model,
        compilation=_compilation_for(options, bundle).resolve(
            device_type=options.device.type, max_num_seqs=sizes.max_num_seqs,
            max_num_batched_tokens=sizes.max_num_batched_tokens),
        device=options.device, dtype=dtype, attention_backend=options.attention_backend,
        max_model_len=sizes.max_model_len, max_num_seqs=sizes.max_num_seqs,
        max_num_batched_tokens=sizes.max_num_batched_tokens, block_size=sizes.block_size,
        num_kv_blocks=sizes.num_kv_blocks, kv_cache_memory_bytes=user.kv_cache_memory_bytes,
        gpu_memory_utilization=user.gpu_memory_utilization, seed=user.seed,
        enable_prefix_caching=user.enable_prefix_caching, speculative=user.speculative_config,
        rope_positions=max(model.max_position_embeddings, sizes.max_model_len), eos_token_ids=eos,
        checkpoint_identity=source.checkpoint.identity(), quantization=_quantization_for(options, source),
        sampling_defaults=sampling_defaults(source.checkpoint.generation_config(),
                                            source.checkpoint.generation_config_source()),
    )


# ------------------------------------------------------------------ 4. model
def load_model(config: ResolvedConfig, source: ModelSource, weights: bool = True) -> CausalLM:
    """The model with its weights; on CPU they move into huge pages in the
    background once read (``kiln.models.memory``)."""
    model = build_model(config.model, source.checkpoint, config.dtype, config.device, config.rope_positions,
                        weights=weights, quantization=config.quantization)
    if weights:
        collapse_to_huge_pages(model)
    return model


# ------------------------------------------------------------------ 5. compile
def compile_or_load(model: CausalLM, config: ResolvedConfig, source: ModelSource, options: LoadOptions,
                    cache_root: Path | None = None) -> "CompiledEntry | None":
    """The compiled pieces: from the bundle, else the automatic cache (compiling
    on a miss); None at -O0. Imported here: torch._dynamo and torch._inductor take
    seconds to import, which an eager start should not pay."""
    if config.compilation.level == 0:
        return None
    from kiln.attention.op import EAGER_IMPLEMENTATIONS
    from kiln.compiler.cached import load_or_compile

    factors = config.cache_factors()
    cache_root = cache_root or options.cache_dir
    bundle = source.bundle
    if bundle is not None:
        try:
            found = _load_bundle(model, config, bundle)
            if found is not None:
                return found
            logger.warning("bundle %s: its compiled entry is unusable; compiling into the user cache %s",
                           bundle.path, cache_root)
        except FactorMismatchError:
            if options.on_mismatch != "recompile":
                raise
            logger.warning("bundle %s was built for another setup; compiling into %s", bundle.path, cache_root)
    return load_or_compile(
        model, config.compilation, max_num_tokens=config.max_num_batched_tokens, device=config.device,
        factors=factors, cache_root=cache_root, eager_impls=EAGER_IMPLEMENTATIONS,
        header={"model": config.model.architecture, "level": config.compilation.level},
    )


def _load_bundle(model: CausalLM, config: ResolvedConfig, bundle: Bundle) -> "CompiledEntry | None":
    """The bundle's entry, its kernels read from a private copy of its Inductor
    cache; FactorMismatchError when it was built for another setup."""
    from kiln.attention.op import EAGER_IMPLEMENTATIONS
    from kiln.compiler.cached import load_entry

    inductor = private_copy(bundle.inductor_dir, "kiln-inductor-")
    return load_entry(bundle.compiled_dir, model, config.max_num_batched_tokens, factors=config.cache_factors(),
                      source="bundle", inductor_dir=inductor, strict=True, eager_impls=EAGER_IMPLEMENTATIONS)


def _load_cached(model: CausalLM, config: ResolvedConfig, cache_root: Path, source: str) -> "CompiledEntry | None":
    """The automatic cache's entry for ``config``, loaded without a lock; None
    when it is missing, incomplete or damaged. A missing one costs no import of
    Dynamo or Inductor."""
    factors = config.cache_factors()
    entry = cache_root / "compiled" / cache_key(factors)
    if read_manifest(entry) is None:
        return None
    from kiln.attention.op import EAGER_IMPLEMENTATIONS
    from kiln.compiler.cached import load_entry

    inductor = cache_root / "inductor"
    if not writable(inductor):
        inductor = private_copy(inductor, "kiln-inductor-")
    return load_entry(entry, model, config.max_num_batched_tokens, factors=factors, source=source,
                      inductor_dir=inductor, lock_free=True, eager_impls=EAGER_IMPLEMENTATIONS)


def _jsonable_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``Runtime.load`` options as JSON values, for the background build process."""
    out: dict[str, Any] = {}
    for k, v in kwargs.items():
        if v is None or k == "compile":
            continue
        if isinstance(v, torch.dtype):
            v = str(v).removeprefix("torch.")
        elif isinstance(v, (torch.device, Path)):
            v = str(v)
        out[k] = v
    return json.loads(json.dumps(out, default=str))


def start_background_compile(b: "_Built", kwargs: dict[str, Any]) -> BackgroundCompile:
    """Build the compiled pieces in another process while the engine runs
    eagerly (``kiln.engine.background_compile``). A read-only cache gets a
    private one, removed at exit."""
    config, model = b.config, b.model
    cache_root = b.options.cache_dir
    if not (writable(cache_root / "compiled") and writable(cache_root / "inductor")):
        cache_root = private_copy(None, "kiln-cache-")
        logger.warning("kiln's cache %s is read-only: the background build goes to the temporary cache %s",
                       b.options.cache_dir, cache_root)
    threads, during, workers = share_cores(config.device.type)
    spec = BuildSpec(b.options.path, {**_jsonable_options(kwargs), "cache_dir": str(cache_root)},
                     cache_key(config.cache_factors()), cache_root, threads=threads, workers=workers)

    entry = cache_root / "compiled" / spec.key
    return BackgroundCompile(spec, lambda: _load_cached(model, config, cache_root, "background"),
                             t0=b.phases.t0, threads_while_building=during,
                             after_swap=functools.partial(capture_graphs, config=config),
                             needs_compiler=lambda: not _replays(entry)).start()


# ------------------------------------------------------------------ 6. KV cache
def size_kv_cache(config: ResolvedConfig, model: CausalLM, compiled: Any) -> int:
    """Blocks of KV cache: the resolved count, else (GPU) what free memory holds
    after a profiling run of the largest step."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(config.device)
    probe = ModelRunner(model, [], create_attention_backend(config.attention_backend), block_size=config.block_size,
                        max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
                        max_model_len=config.max_model_len, device=config.device, compiled=compiled)
    probe.profile_run()
    torch.cuda.synchronize(config.device)
    peak = torch.cuda.max_memory_allocated(config.device)
    del probe
    total = torch.cuda.get_device_properties(config.device).total_memory
    per_block = kv_bytes_per_block(config.model, config.block_size, config.dtype)
    blocks = min(max(0, int(total * config.gpu_memory_utilization) - peak) // per_block,
                 config.max_num_seqs * -(-config.max_model_len // config.block_size))
    if blocks * config.block_size < config.max_model_len:
        raise ValueError(
            f"max_model_len={config.max_model_len} needs {-(-config.max_model_len // config.block_size)} KV "
            f"blocks, GPU memory holds {blocks}; raise gpu_memory_utilization or lower max_model_len"
        )
    return int(blocks)


def allocate_kv_cache(config: ResolvedConfig, num_blocks: int) -> list[torch.Tensor]:
    """One cache tensor per layer, zeroed: the torch backend's batched decode
    reads slots no request wrote (padding up to the longest context, masked out),
    and masked garbage still poisons a softmax when it holds NaN or Inf. On CPU
    the zeros are lazy (an anonymous mapping: pages fault in zero-filled when
    first written, so a large cache costs nothing at startup); on a GPU they are
    a device-side fill."""
    mc = config.model
    shape = (2, num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim)
    if config.device.type != "cpu":
        return [torch.zeros(shape, dtype=config.dtype, device=config.device) for _ in range(mc.num_layers)]
    per_layer = math.prod(shape) * torch.empty((), dtype=config.dtype).element_size()
    memory = zeroed_host_memory(per_layer * mc.num_layers)
    return [memory[i * per_layer: (i + 1) * per_layer].view(config.dtype).view(shape) for i in range(mc.num_layers)]


# ------------------------------------------------------------------ 7. engine
def build_engine(config: ResolvedConfig, model: CausalLM, compiled: Any, kv_caches: list[torch.Tensor],
                 background: BackgroundCompile | None = None, tokenizer: Any = None) -> Engine:
    num_blocks = kv_caches[0].shape[1]
    kv = KVCacheManager(num_blocks, config.block_size, enable_caching=config.enable_prefix_caching)
    proposer = NgramProposer(config.speculative) if config.speculative is not None else None
    scheduler = Scheduler(kv, config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len, proposer)
    runner = ModelRunner(
        model, kv_caches, create_attention_backend(config.attention_backend), block_size=config.block_size,
        max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
        max_model_len=config.max_model_len, device=config.device, seed=config.seed, compiled=compiled,
    )
    vocab = config.model.vocab_size
    return Engine(scheduler, runner, vocab_size=vocab, eos_token_ids=config.eos_token_ids, background=background,
                  vocab_bytes=functools.partial(vocab_bytes, tokenizer, vocab) if tokenizer is not None else None)


# ------------------------------------------------------------------ 8. CUDA graphs
def capture_graphs(runner: ModelRunner, config: ResolvedConfig) -> tuple[CUDAGraphMode, CaptureReport]:
    """Install and capture graphs when the resolved mode asks for them: CUDA
    graphs on a GPU, CPU call graphs on a CPU (``kiln.graphs.cpu``, which
    need the compiled model's exported code). The dispatcher downgrades the
    mode to what the attention backend and the compiled model allow. Returns
    the mode that runs. (A background build's pieces get theirs when they are
    swapped in.)"""
    requested = config.compilation.cudagraph_mode or CUDAGraphMode.NONE
    if requested is CUDAGraphMode.NONE:
        return requested, CaptureReport()
    cpu = config.device.type == "cpu"
    compiled = runner.compiled
    if cpu:
        why_not = compiled.call_graph_refusal() if compiled is not None else "no compiled pieces"
        if why_not is not None:
            logger.info("no CPU call graphs: %s", why_not)
            return CUDAGraphMode.NONE, CaptureReport()
    graphs: GraphCapturer = (CpuCallGraphs(compiled.native_sites, _native_replay(compiled), compiled.allocation_sites)
                             if cpu else TorchCUDAGraphs())
    dispatcher = CUDAGraphDispatcher(
        requested, list(config.compilation.cudagraph_capture_sizes or []),
        support=runner.attention_backend.cudagraph_support, has_pieces=runner.compiled is not None,
        max_num_seqs=config.max_num_seqs,
    )
    if dispatcher.mode is CUDAGraphMode.NONE:
        return dispatcher.mode, CaptureReport()
    runner.install_cuda_graphs(dispatcher, graphs)
    report = runner.capture_graphs()
    return (dispatcher.mode if dispatcher.capture_sizes else CUDAGraphMode.NONE), report


def _native_replay(compiled: Any) -> NativeReplay | None:
    """The C loop a CPU call graph's replay runs in: the C linear kernel's
    (``kiln_replay``), when the compiled model has one built with it."""
    kernel = getattr(compiled, "linear_kernel", None)
    if kernel is None or kernel.replay_loop is None:
        return None
    return NativeReplay(kernel.replay_loop, kernel.replay_args)


# ------------------------------------------------------------------ all of it
@dataclass(frozen=True)
class LoadedEngine:
    engine: Engine
    tokenizer: Any
    config: ResolvedConfig
    source: ModelSource
    compiled: "CompiledEntry | None"  # what the engine started with
    startup_report: dict[str, Any]
    background: BackgroundCompile | None = None  # the build started on a cache miss (compile="background")

    def report(self) -> dict[str, Any]:
        """The startup report, with the background build's state as of now."""
        if self.background is None:
            return self.startup_report
        return {**self.startup_report, "background_compile": self.background.report()}

    def compiled_entry(self) -> "CompiledEntry | None":
        """The compiled entry the engine runs now."""
        if self.background is not None and self.background.entry is not None:
            return self.background.entry
        return self.compiled

    def close(self) -> None:
        """Stop a background build that is still running."""
        if self.background is not None:
            self.background.stop()


def _compile_report(stats: "CompileStats | None") -> dict[str, Any]:
    keys = ("dynamo_traces", "inductor_compiles", "artifacts_loaded", "kernels_rebuilt", "pieces",
            "unique_pieces", "compile_seconds")
    if stats is None:
        return {k: {} if k == "compile_seconds" else 0 for k in keys} | {"compile_cache": "off", "artifact_loader": ""}
    return {k: getattr(stats, k) for k in keys} | {"compile_cache": stats.cache, "artifact_loader": stats.artifact_loader}


def _greedy_screen_report(compiled: "CompiledEntry | None") -> dict[str, int] | None:
    head = compiled.model.greedy_head if compiled is not None else None
    return head.report() if head is not None else None


def startup_report(config: ResolvedConfig, engine: Engine, compiled: "CompiledEntry | None", mode: CUDAGraphMode,
                   capture: CaptureReport, phases: Phases, compile_mode: str,
                   reordered_weight_bytes: int = 0) -> dict[str, Any]:
    kv_bytes = sum(t.numel() * t.element_size() for t in engine.runner.kv_caches)
    dispatcher = engine.runner.dispatcher
    return {
        "phases": phases.seconds,
        "total_seconds": phases.total(),
        "compile_mode": compile_mode,
        # what the first step runs; a background build's state: Runtime.startup_report, stats()
        "execution": "compiled" if compiled is not None else "eager",
        "config": config.to_dict(),
        "optimization_level": config.compilation.level,
        "compilation": config.compilation.to_dict(),
        "device": str(config.device),
        "dtype": str(config.dtype).removeprefix("torch."),
        "quantization": config.quantization,
        "packed_layers": packed_layers(engine.runner.model),
        "architecture": config.model.architecture,
        "attention_backend": engine.runner.attention_backend.name,
        # the compiled entry's CPU attention library (kiln.attention.cpu_attention), or None
        "attention_kernel": _attention_kernel_name(engine.runner.attention_backend),
        # the small-batch linear library its few-token pieces and LM head call (kiln.compiler.cpu_linear)
        "linear_kernel": _linear_kernel_name(compiled),
        # the many-row linears' weights, reordered for oneDNN and held beside them (kiln.compiler.onednn)
        "reordered_weight_bytes": reordered_weight_bytes,
        # an fp32 head's greedy screen (kiln.compiler.greedy_head): the bytes a greedy step reads of it, or None
        "greedy_screen": _greedy_screen_report(compiled),
        "cudagraph_mode": mode.value,
        "cudagraph_capture_sizes": dispatcher.capture_sizes if dispatcher is not None else [],
        "cudagraphs_captured": capture.graphs,
        "cudagraph_capture_seconds": capture.seconds,
        "cudagraph_memory_bytes": capture.memory_bytes,
        **_compile_report(compiled.stats if compiled else None),
        "num_kv_blocks": engine.scheduler.kv.num_blocks,
        "enable_prefix_caching": config.enable_prefix_caching,
        "speculative_config": config.speculative.to_dict() if config.speculative is not None else None,
        "kv_cache_bytes": kv_bytes,
        "max_model_len": config.max_model_len,
    }


@dataclass(frozen=True)
class _Built:
    """The steps ``load_engine`` and ``build_compiled`` share: a model, ready to compile."""

    phases: Phases
    options: LoadOptions
    source: ModelSource
    config: ResolvedConfig
    model: CausalLM


def _build(path: "str | Path", kwargs: dict[str, Any], weights: bool = True) -> _Built:
    """Options, source, config and model. Without ``weights`` the parameters are
    checked against the checkpoint but left uninitialised: compiled code does
    not depend on their values."""
    phases = Phases()
    options = parse_options(path, **kwargs)
    source = open_source(options, phases)
    with phases("load_config"):
        config = resolve_config(source, options)
    if config.quantization is not None and config.compilation.level == 0:
        logger.warning("quantization=%r at -O0: packed layers dequantize their whole weight on every call, "
                       "slower than dense weights; the packed kernels come with -O1 and above", config.quantization)
    with phases("load_weights"):
        model = load_model(config, source, weights)
    return _Built(phases, options, source, config, model)


def _compiled_at_start(b: _Built, kwargs: dict[str, Any]) -> "tuple[CompiledEntry | None, BackgroundCompile | None]":
    """Blocking: the compiled pieces, compiled now on a miss. Background: the
    pieces when a bundle or the cache holds them, else none yet and a build
    started in another process. Eager-first: none yet when the bundle or the
    cache holds them, loaded in the background; a miss as background."""
    if b.config.compilation.level == 0:
        return None, None
    eager_first = b.options.compile == "eager-first"
    if eager_first:
        with b.phases("find_compiled"):
            deferred = deferred_load(b)
        if deferred is not None:
            return None, deferred
    if b.options.compile == "blocking" or b.source.bundle is not None:
        if _needs_compiler(b):
            with b.phases("import_compiler"):  # Dynamo and Inductor: seconds, the bulk of such a start
                from kiln.compiler.artifacts import warm_up

                warm_up(b.options.cache_dir)
        return compile_or_load(b.model, b.config, b.source, b.options), None
    if not eager_first:
        with b.phases("load_cached"):
            found = _load_cached(b.model, b.config, b.options.cache_dir, "hit")
        if found is not None:
            return found, None
    with b.phases("start_background_compile"):
        return None, start_background_compile(b, kwargs)


def _needs_compiler(b: _Built) -> bool:
    """Whether this start imports Inductor: not when the entry it would load (the
    bundle's, else the cache's) has all its artifacts' code exported to run
    without it (``kiln.compiler.replay``). Decided from the manifest alone; an
    entry that turns out damaged or foreign is rebuilt or refused as before,
    its imports then paid inside ``load_artifacts`` or the compile."""
    bundle = b.source.bundle
    entry = bundle.compiled_dir if bundle is not None else (
        b.options.cache_dir / "compiled" / cache_key(b.config.cache_factors()))
    return not _replays(entry)


def _replays(entry: Path) -> bool:
    """The entry's manifest says every artifact loads without Inductor."""
    manifest = read_manifest(entry)
    return manifest is not None and covers(manifest)


def deferred_load(b: _Built) -> BackgroundCompile | None:
    """``compile="eager-first"``: when the bundle's entry or the cache's can be
    loaded as it is (checked from its files, without importing the compiler),
    its load, which the engine swaps in between two steps; else None (a
    bundle's entry is then loaded or rebuilt as ``"blocking"`` does). A bundle
    built for another setup raises FactorMismatchError here, before anything
    serves, unless ``on_mismatch="recompile"``."""
    config, model, bundle = b.config, b.model, b.source.bundle
    factors = config.cache_factors()
    if bundle is not None:
        try:
            manifest = manifest_if_loadable(bundle.compiled_dir, factors, bundle.inductor_dir, strict=True)
            if manifest is not None:
                return _load_later(b, lambda: _load_bundle(model, config, bundle), "bundle", covers(manifest))
        except FactorMismatchError:
            if b.options.on_mismatch != "recompile":
                raise
        return None
    cache_root = b.options.cache_dir
    entry = cache_root / "compiled" / cache_key(factors)
    manifest = manifest_if_loadable(entry, factors, cache_root / "inductor")
    if manifest is None:
        return None
    return _load_later(b, lambda: _load_cached(model, config, cache_root, "hit"), "hit", covers(manifest))


def _load_later(b: _Built, load: "Callable[[], CompiledEntry | None]", found: str,
                replays: bool) -> BackgroundCompile:
    """``replays``: the entry loads without Inductor, so nothing is imported
    first and the swap comes at the step after the first."""
    threads, during, _ = share_cores(b.config.device.type)  # the loading thread's imports take a core
    return BackgroundCompile(None, load, t0=b.phases.t0, threads_while_building=threads if replays else during,
                             after_swap=functools.partial(capture_graphs, config=b.config), found=found,
                             needs_compiler=lambda: not replays).start()


def load_engine(path: "str | Path", **kwargs: Any) -> LoadedEngine:
    """Every load step in order; see ``kiln.Runtime.load`` for the options."""
    b = _build(path, kwargs)
    phases, options, source, config, model = b.phases, b.options, b.source, b.config, b.model
    compiled, background = _compiled_at_start(b, kwargs)
    reordered = 0
    if compiled is not None:
        phases.seconds.update(compiled.stats.phases)
        with phases("layout_weights"):  # the C kernel's layouts; oneDNN's copies in a thread, which nothing waits for
            reordered = compiled.model.reorder_weights(config.max_num_seqs)
    with phases("allocate_kv_cache"):
        kv_caches = allocate_kv_cache(config, size_kv_cache(config, model, compiled and compiled.model))
    engine = build_engine(config, model, compiled and compiled.model, kv_caches, background, source.tokenizer)
    with phases("cudagraph_capture"):
        mode, capture = capture_graphs(engine.runner, config) if background is None else (CUDAGraphMode.NONE,
                                                                                        CaptureReport())
    report = startup_report(config, engine, compiled, mode, capture, phases, options.compile, reordered)
    logger.info(
        "loaded %s (%s, %s on %s, -O%d, compile cache %s) in %.2fs: %d KV blocks of %d tokens",
        options.path, config.model.architecture, report["dtype"], config.device, config.compilation.level,
        report["compile_cache"], report["total_seconds"], report["num_kv_blocks"], config.block_size,
    )
    return LoadedEngine(engine, source.tokenizer, config, source, compiled, report, background)


def build_compiled(path: "str | Path", cache_root: Path, **kwargs: Any) -> tuple[BuildRecord, dict[str, Any]]:
    """``kiln compile``: resolve, build the model and compile it into
    ``cache_root`` (``kiln compile``'s private cache, whose Inductor directory
    then holds exactly what the entry needs; a background build's automatic
    cache). No KV cache, scheduler, runner or CUDA graphs. The weights are
    checked (names, shapes) but not read: the code does not depend on their
    values. Returns the build record and a report (phases, counts)."""
    b = _build(path, kwargs, weights=False)
    phases, source, config = b.phases, b.source, b.config
    compiled = compile_or_load(b.model, config, source, b.options, cache_root=cache_root)
    if compiled is None:
        raise ValueError("a bundle holds compiled pieces: use -O1 or above")
    phases.seconds.update(compiled.stats.phases)
    checkpoint = source.checkpoint
    record = BuildRecord(
        entry=compiled.entry, inductor_dir=compiled.inductor_dir, factors=config.cache_factors(),
        compilation=config.compilation.to_dict(), dtype=str(config.dtype).removeprefix("torch."),
        max_num_batched_tokens=config.max_num_batched_tokens, architecture=config.model.architecture,
        checkpoint_format=checkpoint.format, metadata_files=checkpoint.metadata_files(),
        weight_files=checkpoint.weight_files(), weights_source=checkpoint.weights_source,
    )
    report = {"phases": phases.seconds, "total_seconds": phases.total(), "optimization_level": config.compilation.level,
              **_compile_report(compiled.stats)}
    return record, report


def _linear_kernel_name(compiled: Any) -> str | None:
    kernel = getattr(getattr(compiled, "model", None), "linear_kernel", None)
    return kernel.path.name if kernel is not None else None


def _attention_kernel_name(backend: Any) -> str | None:
    kernel = getattr(backend, "decode_kernel", None)
    return kernel.path.name if kernel is not None else None
