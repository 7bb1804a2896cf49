"""The synchronous front-end: ``Runtime.load(path)`` then ``generate`` / ``stream``.

Threading contract: a ``Runtime`` may be used from any number of threads. Every
call that touches the engine takes one lock, and whichever thread is waiting for
output steps the engine for everyone: requests added from several threads are
batched together, and each request's output goes to its own collector, so no
consumer sees, or loses, another's tokens. A stream paused by its consumer keeps
its output until it is read. At most one thread runs a step at a time.
"""

from __future__ import annotations

import itertools
import numbers
import threading
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from kiln.engine.core import RequestNotFoundError
from kiln.engine.loader import LoadedEngine, load_engine
from kiln.engine.output_processor import OutputProcessor
from kiln.engine.outputs import EngineStats, RequestOutput, StreamDelta
from kiln.engine.request import SamplingParams
from kiln.entrypoints.chat import render_chat

__all__ = ["Runtime"]

Prompt = str | Sequence[int]


def _is_token(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _normalize_prompts(prompts: Any) -> list[Any]:
    """A list of prompts from one prompt (text or token ids) or a list of them."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, torch.Tensor):
        return [prompts.tolist()] if prompts.dim() == 1 else prompts.tolist()
    if hasattr(prompts, "tolist") and not isinstance(prompts, (list, tuple)):  # numpy arrays
        prompts = prompts.tolist()
    if isinstance(prompts, (list, tuple)) and prompts and all(_is_token(t) for t in prompts):
        return [list(prompts)]
    if isinstance(prompts, (list, tuple)):
        return list(prompts)
    raise ValueError(
        f"prompts must be a string, a list of token ids, or a list of either; got {type(prompts).__name__}"
    )


def _normalize_params(params: Any, count: int, default: SamplingParams) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or default] * count
    if not isinstance(params, (list, tuple)):
        raise ValueError(f"params must be a SamplingParams or a list of them, got {type(params).__name__}")
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    return list(params)


class Runtime:
    """A loaded model served by one engine. Build one with :meth:`Runtime.load`.

    ``generate`` runs a batch of prompts to completion, ``stream`` yields one
    prompt's text as it is produced; ``add_request`` / ``step`` drive the engine
    one step at a time, and new requests join the running batch at any step.
    Safe to use from several threads (see the module docstring).
    """

    def __init__(self, loaded: LoadedEngine) -> None:
        self.engine = loaded.engine
        self.tokenizer = loaded.tokenizer
        self.config = loaded.config
        self._loaded = loaded
        self._processor = OutputProcessor(loaded.tokenizer)
        self._lock = threading.RLock()
        self._ids = itertools.count()
        weakref.finalize(self, loaded.close)  # a background build nobody will use stops

    @classmethod
    def load(
        cls,
        path: "str | Path",
        *,
        optimization_level: int | None = None,
        device: "str | torch.device | None" = None,
        dtype: "torch.dtype | str | None" = None,
        quantization: str | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        block_size: int | None = None,
        num_kv_blocks: int | None = None,
        cache_dir: "str | Path | None" = None,
        attention_backend: str | None = None,
        compile: str = "blocking",
        **overrides: Any,
    ) -> "Runtime":
        """Load a Hugging Face checkpoint directory, a ``.gguf`` file, a bundle
        written by ``kiln compile``, ``"demo"`` or a repo id in the local
        Hugging Face cache.

        ``optimization_level`` defaults to 2, or to the level a bundle was
        compiled at. ``compile="blocking"`` (the default) compiles the model
        before ``load`` returns when the compile cache has no entry for it;
        ``compile="background"`` returns at eager speed instead, compiles in
        another process and swaps the compiled pieces in between two steps when
        they are ready (``startup_report["background_compile"]`` and
        ``stats().execution`` say when). ``compile="eager-first"`` does the
        same on a miss and also on a hit or from a bundle: the first step runs
        eagerly, then the compiled pieces are loaded (Dynamo and Inductor's
        imports in a thread) and swapped in; a bundle built for another setup
        still raises before anything serves. ``quantization`` packs the linear
        layers and LM head (``kiln.models.quant``): ``"int8"`` quantizes any
        checkpoint's weights per row; ``"gguf"`` keeps a GGUF file's Q8_0,
        Q4_0 and Q4_1 tensors as stored (other types stay dense);
        ``"int8-a8"`` and ``"gguf-a8"`` also round the packed layers' inputs
        to int8 per 32 elements, as llama.cpp does (integer products with
        AVX512-VNNI; greedy tokens further from the dense model's). It pays with
        compiled pieces (``-O1`` and above); eagerly each call dequantizes. ``cache_dir`` holds compiled entries (default: kiln's cache
        directory). ``attention_backend`` is ``"auto"`` (Triton on CUDA, torch
        elsewhere), ``"torch"`` or ``"triton"``; left as ``None`` it comes from
        ``KILN_ATTENTION_BACKEND``, else ``"auto"``. ``overrides`` take engine
        fields (``kv_cache_memory_bytes``, ``gpu_memory_utilization``, ``seed``,
        ``speculative_config``: ``{"method": "ngram", ...}`` as vLLM takes it,
        ``kiln.config.SpeculativeConfig``), compilation fields (``compile_sizes``, ``cudagraph_mode``,
        ``cudagraph_capture_sizes``, ``inductor_options``, ``splitting_ops``),
        ``on_mismatch`` (``"error"``, the default, or ``"recompile"``: what to
        do with a bundle built for another torch, kiln, device or config) and
        ``weights_path`` (where a bundle built without weights finds them).
        Every option is checked before anything loads; an unknown name is a
        ``TypeError``, a bad value a ``ValueError`` naming the option.
        """
        return cls(load_engine(
            path, optimization_level=optimization_level, device=device, dtype=dtype, quantization=quantization,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
            num_kv_blocks=num_kv_blocks, cache_dir=cache_dir, attention_backend=attention_backend, compile=compile,
            **overrides,
        ))

    # ------------------------------------------------------------- properties
    @property
    def startup_report(self) -> dict[str, Any]:
        """Seconds per load phase, the resolved config, KV cache size and
        compile counts; with ``compile="background"``, the build's state as of
        now (``background_compile``: state, seconds, when the swap happened)."""
        return self._loaded.report()

    @property
    def compiled(self) -> Any:
        """The compiled entry the engine runs (None while eager)."""
        return self._loaded.compiled_entry()

    def close(self) -> None:
        """Stop a background compile that is still running; the engine keeps
        serving with what it runs now."""
        self._loaded.close()

    @property
    def device(self) -> torch.device:
        return self.config.device

    @property
    def model_config(self) -> Any:
        return self.config.model

    def default_params(self) -> SamplingParams:
        """What a request without SamplingParams gets: the checkpoint's
        generation defaults (temperature, top_p, top_k, min_p,
        repetition_penalty) over kiln's, as vLLM does;
        ``startup_report["config"]["sampling_defaults"]`` says where each came
        from."""
        return SamplingParams(**{k: v for k, (v, _) in self.config.sampling_defaults.items()})

    def stats(self) -> EngineStats:
        with self._lock:
            return self.engine.stats()

    def has_unfinished(self) -> bool:
        with self._lock:
            return self.engine.has_unfinished()

    # ---------------------------------------------------------------- requests
    def _prepare(self, prompt: Any, params: SamplingParams, index: int | None) -> tuple[list[int], str | None]:
        where = "prompt" if index is None else f"prompt {index}"
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"{where} is empty")
            if self.tokenizer is None:
                raise ValueError(f"{where} is text, but the model has no tokenizer; pass token ids")
            ids, text = list(self.tokenizer.encode(prompt)), prompt
        else:
            if isinstance(prompt, torch.Tensor) or hasattr(prompt, "tolist"):
                prompt = prompt.tolist()
            if not isinstance(prompt, (list, tuple)) or not all(_is_token(t) for t in prompt):
                raise ValueError(f"{where} must be a string or a list of token ids, got {prompt!r:.80}")
            ids, text = [int(t) for t in prompt], None
        self.engine.check_request(ids, params, index)
        return ids, text

    def _add_many(self, prompts: list[Any], params: list[SamplingParams], indexed: bool = True,
                  cache_salt: str | None = None) -> list[int]:
        """Validate every prompt, then queue them all: a bad batch queues nothing."""
        with self._lock:
            prepared = [self._prepare(p, sp, i if indexed else None) for i, (p, sp) in enumerate(zip(prompts, params))]
            rids = []
            for (ids, text), sp in zip(prepared, params):
                rid = next(self._ids)
                self.engine.add_request(rid, ids, sp, cache_salt)
                self._processor.add_request(rid, text, ids, sp)
                rids.append(rid)
            return rids

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, *, cache_salt: str | None = None
                    ) -> int:
        """Queue one prompt; it joins the running batch at the next ``step``.
        Requests with different ``cache_salt`` never share cached KV blocks."""
        return self._add_many([prompt], [params or self.default_params()], indexed=False, cache_salt=cache_salt)[0]

    def _step_locked(self) -> list[StreamDelta]:
        processed = self._processor.process(self.engine.step())
        if processed.to_abort:
            self.engine.abort(processed.to_abort)
        return processed.deltas

    def step(self) -> list[StreamDelta]:
        """Run one engine step; return what it added to each request that moved."""
        with self._lock:
            return self._step_locked()

    def _known(self, request_id: int) -> None:
        if request_id not in self._processor:
            raise RequestNotFoundError(f"no request {request_id!r}: it was never added, or was released")

    def get_output(self, request_id: int) -> RequestOutput:
        with self._lock:
            self._known(request_id)
            return self._processor.get_output(request_id)

    def release(self, request_id: int) -> RequestOutput:
        """Return a request's output; once it is finished, forget it."""
        with self._lock:
            out = self.get_output(request_id)
            if out.finished:
                self._processor.release(request_id)
            return out

    def abort(self, request_id: int) -> None:
        """End a request now (its KV blocks are free before the next step) and
        forget it. Like vLLM's, idempotent: an unknown or released id is ignored."""
        with self._lock:
            self.engine.abort([request_id])
            self._processor.release(request_id)

    # ---------------------------------------------------------------- drivers
    def _drive(self, request_ids: list[int]) -> None:
        """Step the engine until every request of ``request_ids`` has finished."""
        while True:
            with self._lock:
                if all(self._processor.finished(r) for r in request_ids):
                    return
                self._step_locked()

    def generate(self, prompts: Any, params: "SamplingParams | Sequence[SamplingParams] | None" = None, *,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """Run prompts to completion; one output per prompt, in order.

        ``prompts``: a string, a list of token ids, or a list of either.
        ``params``: one SamplingParams for all, or one per prompt. Prompts that
        start alike share the KV blocks of their common prefix (prefix caching),
        unless their ``cache_salt`` differs."""
        plist = _normalize_prompts(prompts)
        rids = self._add_many(plist, _normalize_params(params, len(plist), self.default_params()),
                              cache_salt=cache_salt)
        try:
            self._drive(rids)
        except BaseException:
            with self._lock:
                self.engine.abort(rids)
                for r in rids:
                    self._processor.release(r)
            raise
        return [self.release(r) for r in rids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Queue ``prompt`` now (invalid input raises here, not at the first
        ``next``) and return an iterator over what each step adds to its output;
        the last delta carries the finish reason."""
        rid = self.add_request(prompt, params)
        return self._stream(rid)

    def chat(self, messages: Any, params: SamplingParams | None = None, *,
             chat_template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None,
             chat_template: str | None = None, continue_final_message: bool = False) -> RequestOutput:
        """Answer a conversation: ``messages`` (``[{"role": "user", "content":
        "..."}, ...]``) rendered by the chat template (``chat_template``, else
        the tokenizer's) with the assistant's generation prompt, ``tools``
        (OpenAI's function definitions) offered to it; with
        ``continue_final_message`` the answer continues the last message (an
        assistant reply begun by the caller) instead. Invalid messages raise
        ValueError naming the index and field. The answer is text: the calls a
        model writes in it are parsed by ``kiln.entrypoints.openai.tool_parsers``."""
        ids = render_chat(self.tokenizer, messages, chat_template_kwargs, tools=tools, chat_template=chat_template,
                          continue_final_message=continue_final_message)
        return self.generate([ids], params)[0]

    def stream_chat(self, messages: Any, params: SamplingParams | None = None, *,
                    chat_template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None,
                    chat_template: str | None = None, continue_final_message: bool = False) -> Iterator[StreamDelta]:
        """``chat``, streamed as ``stream`` does."""
        ids = render_chat(self.tokenizer, messages, chat_template_kwargs, tools=tools, chat_template=chat_template,
                          continue_final_message=continue_final_message)
        return self.stream(ids, params)

    def _stream(self, rid: int) -> Iterator[StreamDelta]:
        try:
            while True:
                with self._lock:
                    if rid not in self._processor:
                        return  # aborted by another caller
                    delta = self._processor.take(rid)
                    if delta is None:
                        self._step_locked()
                        delta = self._processor.take(rid)
                if delta is not None:
                    yield delta
                    if delta.finished:
                        return
        finally:
            with self._lock:
                if rid in self._processor and not self._processor.finished(rid):
                    self.engine.abort([rid])
                self._processor.release(rid)
