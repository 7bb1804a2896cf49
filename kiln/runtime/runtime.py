"""The public entry point: ``Runtime.load(path)`` then ``generate`` / ``stream``."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kiln.runtime.bundle import BUNDLE_COMPILED_DIR, bundle_model_dirs, private_inductor_copy, read_bundle

if TYPE_CHECKING:
    from kiln.compiler.backend import CompiledModel
# backend is light to import; what needs torch._dynamo / torch._inductor is imported in _compile
from kiln.compiler.backend import CompileStats
from kiln.config import DEFAULT_LEVEL, CompilationConfig, CUDAGraphMode, EngineConfig, default_cache_dir
from kiln.graphs import CUDAGraphDispatcher, TorchCUDAGraphs
from kiln.kernels.backends import get_attention_backend, resolve_attention_backend
from kiln.runtime.block_pool import BlockPool
from kiln.runtime.detokenizer import IncrementalDetokenizer
from kiln.runtime.loader import load_model
from kiln.runtime.model_config import CheckpointError, ModelConfig, parse_dtype
from kiln.runtime.model_runner import CaptureReport, ModelRunner
from kiln.runtime.request import Request, RequestOutput, SamplingParams, StreamDelta
from kiln.runtime.scheduler import Scheduler

__all__ = ["Runtime"]

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]

_ENGINE_FIELDS = {"kv_cache_memory_bytes", "gpu_memory_utilization", "seed"}
_LOAD_FIELDS = {"on_mismatch", "weights_path"}
_COMPILATION_FIELDS = {
    "compile_sizes",
    "splitting_ops",
    "inductor_options",
    "cudagraph_mode",
    "cudagraph_capture_sizes",
}


@dataclass
class _Tracked:
    request: Request
    detok: IncrementalDetokenizer
    emitted_tokens: int = 0


class _Timer:
    def __init__(self) -> None:
        self.phases: dict[str, float] = {}

    def __call__(self, name: str) -> "_Phase":
        return _Phase(self, name)


class _Phase:
    def __init__(self, timer: _Timer, name: str) -> None:
        self.timer, self.name = timer, name

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.timer.phases[self.name] = round(time.perf_counter() - self.t0, 4)


def _resolve_device(device: "str | torch.device | None") -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} was asked for, but CUDA is not available")
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"device={str(device)!r} is not supported; use 'cpu' or 'cuda'")
    return dev


def _resolve_dtype(dtype: "torch.dtype | str | None", config: ModelConfig, device: torch.device) -> torch.dtype:
    if dtype is not None:
        return parse_dtype(dtype)
    ckpt = config.checkpoint_dtype or torch.float32
    if device.type == "cpu" and ckpt == torch.float16:
        return torch.float32  # CPU fp16 GEMMs are slow and lossy; fp32 is the safe default
    return ckpt


def _load_tokenizer(path: Path) -> Any:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if not any((path / n).is_file() for n in names):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        raise CheckpointError(f"{path}: the tokenizer could not be loaded: {e}") from e


class Runtime:
    """A loaded model with its KV cache, scheduler and runner.

    Build one with :meth:`Runtime.load`. ``generate`` runs a batch of prompts to
    completion, ``stream`` yields one prompt's text as it is produced; for finer
    control, ``add_request`` and ``step`` drive the engine one step at a time, and
    new requests may join between any two steps.
    """

    def __init__(self) -> None:  # use Runtime.load
        self.model_path: Path
        self.model_config: ModelConfig
        self.compilation_config: CompilationConfig
        self.engine_config: EngineConfig
        self.tokenizer: Any
        self.device: torch.device
        self.dtype: torch.dtype
        self.startup_report: dict[str, Any] = {}
        self._tracked: dict[int, _Tracked] = {}
        self._next_id = 0

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(
        cls,
        path: "str | Path",
        *,
        optimization_level: int | None = None,
        device: "str | torch.device | None" = None,
        dtype: "torch.dtype | str | None" = None,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        block_size: int | None = None,
        num_kv_blocks: int | None = None,
        cache_dir: "str | Path | None" = None,
        attention_backend: str | None = None,
        **overrides: Any,
    ) -> "Runtime":
        """Load a Hugging Face checkpoint directory, a bundle written by
        ``kiln compile``, or ``"demo"``.

        ``optimization_level`` defaults to 2, or to the level a bundle was
        compiled at. ``cache_dir`` holds compiled entries (default: kiln's cache
        directory). ``attention_backend`` is ``"auto"`` (Triton on CUDA, torch
        elsewhere), ``"torch"`` or ``"triton"``; left as ``None`` it comes from
        ``KILN_ATTENTION_BACKEND``, else ``"auto"``. ``overrides`` take engine
        fields (``kv_cache_memory_bytes``, ``gpu_memory_utilization``,
        ``seed``), compilation fields
        (``compile_sizes``, ``cudagraph_mode``, ...), ``on_mismatch``
        (``"error"``, the default, or ``"recompile"``: what to do with a bundle
        built for another torch, kiln, device or config) and ``weights_path``
        (where a bundle built without weights finds them); an unknown name is an
        error.
        """
        t_start = time.perf_counter()
        timer = _Timer()
        unknown = set(overrides) - _ENGINE_FIELDS - _COMPILATION_FIELDS - _LOAD_FIELDS
        if unknown:
            raise TypeError(
                f"Runtime.load() got unknown option(s) {sorted(unknown)}; known: "
                f"{sorted(_ENGINE_FIELDS | _COMPILATION_FIELDS | _LOAD_FIELDS)}"
            )
        on_mismatch = overrides.pop("on_mismatch", "error")
        if on_mismatch not in ("error", "recompile"):
            raise ValueError(f"on_mismatch must be 'error' or 'recompile', got {on_mismatch!r}")
        weights_path = overrides.pop("weights_path", None)
        self = cls()
        self.device = _resolve_device(device)
        backend_name = resolve_attention_backend(attention_backend, self.device)
        self.cache_root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        if str(path) == "demo":
            from kiln.demo import ensure_demo_model

            with timer("build_demo"):
                path = ensure_demo_model(self.cache_root)
        path = Path(path)

        bundle = read_bundle(path)
        comp_overrides = {k: v for k, v in overrides.items() if k in _COMPILATION_FIELDS}
        if bundle is not None:
            # The bundle's settings are the defaults; anything asked for differently is
            # a mismatch, reported (or recompiled) when the factors are compared.
            self.model_path, self.weights_path = bundle_model_dirs(path, bundle, weights_path)
            stored = bundle["compilation"]
            level = stored["level"] if optimization_level is None else optimization_level
            if level == stored["level"]:
                for k in _COMPILATION_FIELDS:
                    if stored.get(k) is not None:
                        comp_overrides.setdefault(k, stored[k])
            dtype = dtype if dtype is not None else bundle["dtype"]
            if max_num_batched_tokens is None:
                max_num_batched_tokens = bundle["engine"]["max_num_batched_tokens"]
        else:
            self.model_path = self.weights_path = path
            level = DEFAULT_LEVEL if optimization_level is None else optimization_level
        compilation = CompilationConfig(level=level, **comp_overrides)
        engine = EngineConfig(
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            **{k: v for k, v in overrides.items() if k in _ENGINE_FIELDS},
        )
        with timer("load_config"):
            self.model_config = ModelConfig.from_dir(self.model_path)
        self.dtype = _resolve_dtype(dtype, self.model_config, self.device)
        with timer("load_tokenizer"):
            self.tokenizer = _load_tokenizer(self.model_path)
        eos = self.model_config.eos_token_ids
        if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = (int(self.tokenizer.eos_token_id),)
        self._eos_token_ids = eos

        self.engine_config = self._resolve_engine(engine)
        e = self.engine_config
        assert e.max_model_len and e.block_size and e.max_num_batched_tokens and e.max_num_seqs
        self.compilation_config = compilation.resolve(
            device_type=self.device.type,
            max_num_seqs=e.max_num_seqs,
            max_num_batched_tokens=e.max_num_batched_tokens,
        )

        with timer("load_weights"):
            # RoPE tables cover every position the checkpoint knows, whatever max_model_len
            # is: the table is a graph input, and its shape must not tie compiled code
            # to one engine setting.
            self.rope_positions = max(self.model_config.max_position_embeddings, e.max_model_len)
            model = load_model(self.weights_path, self.model_config, self.dtype, self.device, self.rope_positions)
        with timer("allocate_kv_cache"):
            num_blocks = self._num_kv_blocks(model)
            kv_caches = self._allocate_kv_caches(num_blocks)
        if e.max_model_len > num_blocks * e.block_size:
            if max_model_len is not None:
                raise ValueError(
                    f"max_model_len={max_model_len} needs {-(-max_model_len // e.block_size)} KV blocks of "
                    f"{e.block_size} tokens, the cache holds {num_blocks}; raise num_kv_blocks or the memory "
                    "budget, or lower max_model_len"
                )
            e.max_model_len = num_blocks * e.block_size
            logger.info("max_model_len capped at %d tokens, what the KV cache holds", e.max_model_len)
        e.num_kv_blocks = num_blocks

        forward = None
        self.cache_entry: Path | None = None
        stats = CompileStats()
        if self.compilation_config.level > 0:
            forward, stats = self._compile(model, path if bundle is not None else None, on_mismatch)
            timer.phases.update(stats.phases)
        self.compiled = forward

        with timer("attention_backend"):
            self.attention_backend = get_attention_backend(backend_name)
        self.pool = BlockPool(num_blocks, e.block_size)
        self.scheduler = Scheduler(self.pool, e.max_num_seqs, e.max_num_batched_tokens, e.max_model_len)
        self.runner = ModelRunner(
            model,
            kv_caches,
            block_size=e.block_size,
            max_num_batched_tokens=e.max_num_batched_tokens,
            max_num_seqs=e.max_num_seqs,
            max_model_len=e.max_model_len,
            device=self.device,
            seed=e.seed,
            forward=forward,
            attention_backend=self.attention_backend,
        )
        capture = self._setup_cuda_graphs(forward is not None, timer)
        kv_bytes = sum(t.numel() * t.element_size() for t in kv_caches)
        self.startup_report = {
            "phases": timer.phases,
            "total_seconds": round(time.perf_counter() - t_start, 4),
            "optimization_level": self.compilation_config.level,
            "compilation": self.compilation_config.to_dict(),
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "architecture": self.model_config.architecture,
            "cudagraph_mode": self.cudagraph_mode.value,
            "cudagraph_capture_sizes": (
                self.runner.dispatcher.capture_sizes if self.runner.dispatcher is not None else []
            ),
            "cudagraphs_captured": capture.graphs,
            "cudagraph_capture_seconds": capture.seconds,
            "cudagraph_memory_bytes": capture.memory_bytes,
            "attention_backend": self.attention_backend.name,
            "dynamo_traces": stats.dynamo_traces,
            "inductor_compiles": stats.inductor_compiles,
            "artifacts_loaded": stats.artifacts_loaded,
            "compile_cache": stats.cache,
            "pieces": stats.pieces,
            "unique_pieces": stats.unique_pieces,
            "compile_seconds": stats.compile_seconds,
            "num_kv_blocks": num_blocks,
            "kv_cache_bytes": kv_bytes,
            "max_model_len": e.max_model_len,
        }
        logger.info(
            "loaded %s (%s, %s on %s, -O%d, compile cache %s) in %.2fs: %d KV blocks of %d tokens",
            path, self.model_config.architecture, self.startup_report["dtype"], self.device,
            self.compilation_config.level, stats.cache, self.startup_report["total_seconds"],
            num_blocks, e.block_size,
        )
        return self

    def _setup_cuda_graphs(self, compiled: bool, timer: "_Timer") -> CaptureReport:
        """Install and capture CUDA graphs when the resolved mode asks for them;
        the dispatcher downgrades the mode to what the attention backend and the
        compiled model allow. ``self.cudagraph_mode`` is the mode that runs."""
        requested = self.compilation_config.cudagraph_mode or CUDAGraphMode.NONE
        self.cudagraph_mode = requested
        if requested is CUDAGraphMode.NONE:
            return CaptureReport()
        dispatcher = CUDAGraphDispatcher(
            requested,
            list(self.compilation_config.cudagraph_capture_sizes or []),
            support=self.attention_backend.cudagraph_support,
            has_pieces=compiled,
            max_num_seqs=self.engine_config.max_num_seqs,  # type: ignore[arg-type]
        )
        self.cudagraph_mode = dispatcher.mode
        if dispatcher.mode is CUDAGraphMode.NONE:
            return CaptureReport()
        self.runner.install_cuda_graphs(dispatcher, TorchCUDAGraphs())
        with timer("cudagraph_capture"):
            return self.runner.capture_graphs()

    def cache_factors(self) -> dict[str, Any]:
        """What the compiled code of this runtime depends on (the cache key's input)."""
        from kiln.cache.keys import cache_factors

        model_fields = {**self.model_config.key_fields(), "rope_positions": self.rope_positions}
        return cache_factors(model_fields, self.dtype, self.compilation_config.to_dict(), self.device)

    def _compile(
        self, model: torch.nn.Module, bundle_dir: Path | None, on_mismatch: str
    ) -> "tuple[CompiledModel, CompileStats]":
        # Imported here: torch._dynamo and torch._inductor take seconds to import,
        # which an eager (-O0) start should not pay.
        from kiln.compiler.cached import FactorMismatchError, load_entry, load_or_compile
        from kiln.kernels.attention import EAGER_IMPLEMENTATIONS

        e = self.engine_config
        factors = self.cache_factors()
        if bundle_dir is not None:
            entry = bundle_dir / BUNDLE_COMPILED_DIR
            try:
                t0 = time.perf_counter()
                inductor = private_inductor_copy(bundle_dir)
                found = load_entry(
                    entry, model, e.max_num_batched_tokens,  # type: ignore[arg-type]
                    factors=factors, source="bundle", inductor_dir=inductor, strict=True,
                    eager_impls=EAGER_IMPLEMENTATIONS,
                )
                if found is not None:
                    found[1].phases["copy_inductor_cache"] = round(time.perf_counter() - t0, 4)
            except FactorMismatchError:
                if on_mismatch != "recompile":
                    raise
                logger.warning("bundle %s was built for another setup; compiling into %s", bundle_dir, self.cache_root)
                found = None
            if found is not None:
                self.cache_entry = entry
                return found
            logger.warning("bundle %s: compiling into the user cache %s", bundle_dir, self.cache_root)
        compiled, stats, self.cache_entry = load_or_compile(
            model,
            self.compilation_config,
            max_num_tokens=e.max_num_batched_tokens,  # type: ignore[arg-type]
            device=self.device,
            factors=factors,
            cache_root=self.cache_root,
            eager_impls=EAGER_IMPLEMENTATIONS,
            header={"model": self.model_config.architecture, "model_path": str(self.model_path),
                    "level": self.compilation_config.level},
        )
        return compiled, stats

    def _resolve_engine(self, e: EngineConfig) -> EngineConfig:
        cuda = self.device.type == "cuda"
        mc = self.model_config
        resolved = EngineConfig(**{f: getattr(e, f) for f in e.__dataclass_fields__})
        resolved.block_size = e.block_size or EngineConfig.DEFAULT_BLOCK_SIZE
        resolved.max_num_seqs = e.max_num_seqs or (256 if cuda else EngineConfig.DEFAULT_MAX_NUM_SEQS)
        resolved.max_num_batched_tokens = e.max_num_batched_tokens or EngineConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS
        if e.max_model_len is not None and e.max_model_len > mc.max_position_embeddings:
            logger.warning(
                "max_model_len=%d exceeds the checkpoint's max_position_embeddings=%d",
                e.max_model_len, mc.max_position_embeddings,
            )
        resolved.max_model_len = e.max_model_len or mc.max_position_embeddings
        if resolved.max_num_seqs > resolved.max_num_batched_tokens:
            resolved.max_num_seqs = resolved.max_num_batched_tokens
        return resolved

    def _bytes_per_block(self) -> int:
        mc, e = self.model_config, self.engine_config
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * mc.num_layers * e.block_size * mc.num_kv_heads * mc.head_dim * itemsize  # type: ignore[operator]

    def _num_kv_blocks(self, model: torch.nn.Module) -> int:
        e = self.engine_config
        if e.num_kv_blocks is not None:
            return e.num_kv_blocks
        per_block = self._bytes_per_block()
        # Never more than every sequence at full length needs.
        useful = e.max_num_seqs * (-(-e.max_model_len // e.block_size))  # type: ignore[operator]
        if self.device.type == "cuda":
            budget = self._cuda_kv_budget(model)
        else:
            budget = e.kv_cache_memory_bytes or EngineConfig.DEFAULT_CPU_KV_BYTES
        blocks = min(useful, budget // per_block)
        if blocks < 1:
            raise ValueError(
                f"the KV cache budget ({budget} bytes) holds no block of {per_block} bytes; "
                "raise kv_cache_memory_bytes / gpu_memory_utilization or set num_kv_blocks"
            )
        return int(blocks)

    def _cuda_kv_budget(self, model: torch.nn.Module) -> int:
        e = self.engine_config
        if e.kv_cache_memory_bytes:
            return e.kv_cache_memory_bytes
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        # A throwaway runner measures the activation peak of the largest step.
        probe = ModelRunner(
            model, [], block_size=e.block_size, max_num_batched_tokens=e.max_num_batched_tokens,  # type: ignore[arg-type]
            max_num_seqs=e.max_num_seqs, max_model_len=e.max_model_len, device=self.device,  # type: ignore[arg-type]
        )
        probe.profile_run()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del probe
        total = torch.cuda.get_device_properties(self.device).total_memory
        return max(0, int(total * e.gpu_memory_utilization) - peak)

    def _allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        mc, e = self.model_config, self.engine_config
        shape = (2, num_blocks, e.block_size, mc.num_kv_heads, mc.head_dim)
        # Uninitialised on purpose: attention reads only slots written this request,
        # and touching gigabytes of zeros would cost seconds of startup.
        return [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(mc.num_layers)]

    # ---------------------------------------------------------------- requests
    def _tokenize(self, prompt: Prompt, index: int) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"prompt {index} is empty")
            if self.tokenizer is None:
                raise ValueError(
                    f"prompt {index} is text, but {self.model_path} has no tokenizer; pass token ids"
                )
            return list(self.tokenizer.encode(prompt)), prompt
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        try:
            ids = [int(t) for t in prompt]
            if any(isinstance(t, (bool, float)) for t in prompt):
                raise TypeError
        except (TypeError, ValueError):
            raise ValueError(f"prompt {index} must be a string or a list of token ids, got {prompt!r:.80}") from None
        return ids, None

    def _validate(self, ids: list[int], params: SamplingParams, index: int) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params for prompt {index} must be a SamplingParams, got {type(params).__name__}")
        params.validate(f"params[{index}]")
        if not ids:
            raise ValueError(f"prompt {index} is empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt {index}: token id {bad} is outside the vocabulary [0, {vocab})")
        limit = self.engine_config.max_model_len
        if len(ids) >= limit:  # type: ignore[operator]
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens; max_model_len={limit} leaves no room to generate"
            )

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> int:
        """Queue one prompt; it joins the running batch at the next ``step``."""
        return self._add_many([prompt], [params or SamplingParams()])[0]

    def _add_many(self, prompts: list[Prompt], params: list[SamplingParams]) -> list[int]:
        # Validate every prompt before queueing any: a bad batch schedules nothing.
        prepared = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            ids, text = self._tokenize(prompt, i)
            self._validate(ids, p, i)
            prepared.append((ids, text, p))
        rids = []
        for ids, text, p in prepared:
            rid = self._next_id
            self._next_id += 1
            req = Request(rid, ids, p, eos_token_ids=self._eos_token_ids, prompt=text)
            self._tracked[rid] = _Tracked(req, IncrementalDetokenizer(self.tokenizer, ids, p.stop_strings))
            self.scheduler.add(req)
            rids.append(rid)
        return rids

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[StreamDelta]:
        """Run one engine step; return what it added to each request that moved."""
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler could not place any request in the KV cache")
            return []
        sampled = self.runner.execute(sched)
        self.scheduler.update(sched, sampled)
        deltas = []
        for s in sched.scheduled:
            if not s.samples:
                continue
            tracked = self._tracked[s.request.request_id]
            req = tracked.request
            new_ids = req.output_token_ids[tracked.emitted_tokens :]
            tracked.emitted_tokens = len(req.output_token_ids)
            tracked.detok.add(new_ids, final=req.finished)
            if tracked.detok.stopped and not req.finished:
                self.scheduler.finish(req, "stop")
            deltas.append(
                StreamDelta(req.request_id, tracked.detok.take(req.finished), new_ids, req.finish_reason)
            )
        return deltas

    def get_output(self, request_id: int) -> RequestOutput:
        tracked = self._tracked[request_id]
        req = tracked.request
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=list(req.prompt_token_ids),
            token_ids=list(req.output_token_ids),
            text=tracked.detok.text,
            finish_reason=req.finish_reason,
        )

    def release(self, request_id: int) -> RequestOutput:
        """Return a finished request's output and forget it."""
        out = self.get_output(request_id)
        if out.finished:
            del self._tracked[request_id]
        return out

    def abort(self, request_id: int) -> None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is not None:
            self.scheduler.finish(tracked.request, "abort")

    @staticmethod
    def _normalize_prompts(prompts: Any) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        if isinstance(prompts, torch.Tensor):
            return [prompts.tolist()] if prompts.dim() == 1 else prompts.tolist()
        if isinstance(prompts, Sequence) and prompts and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompts
        ):
            return [list(prompts)]
        if isinstance(prompts, Sequence):
            return list(prompts)
        raise ValueError(f"prompts must be a string, a list of token ids, or a list of either; got {type(prompts).__name__}")

    def generate(
        self, prompts: Any, params: "SamplingParams | Sequence[SamplingParams] | None" = None
    ) -> list[RequestOutput]:
        """Run prompts to completion; one output per prompt, in order.

        ``prompts``: a string, a list of token ids, or a list of either.
        ``params``: one SamplingParams for all, or one per prompt."""
        plist = self._normalize_prompts(prompts)
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or SamplingParams()] * len(plist)
        else:
            param_list = list(params)
            if len(param_list) != len(plist):
                raise ValueError(f"got {len(param_list)} SamplingParams for {len(plist)} prompts")
        rids = self._add_many(plist, param_list)
        try:
            while any(not self._tracked[r].request.finished for r in rids):
                self.step()
        except BaseException:
            for r in rids:
                self.abort(r)
            raise
        return [self.release(r) for r in rids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yield the text and token ids each step adds to ``prompt``'s output; the
        last delta carries the finish reason."""
        rid = self.add_request(prompt, params)
        try:
            while not self._tracked[rid].request.finished:
                for delta in self.step():
                    if delta.request_id == rid and (delta.text or delta.token_ids or delta.finished):
                        yield delta
        finally:
            if rid in self._tracked:
                if not self._tracked[rid].request.finished:
                    self.abort(rid)
                else:
                    del self._tracked[rid]

    @property
    def stats(self):  # noqa: ANN201
        """Step timing accumulated by the runner (prepare, model, sample)."""
        return self.runner.stats
