"""The engine core: requests in, one step at a time, plain data out.

``Engine.step`` is the whole loop body: the scheduler picks which requests
advance and by how many tokens, the runner runs them through the model and
samples, the scheduler appends the tokens and finishes what stopped. No text, no
threads, no loops: the front-ends (``kiln.entrypoints``) detokenize, stream and
decide who steps the engine when.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from kiln.engine.background_compile import BackgroundCompile
from kiln.engine.outputs import EngineOutputs, EngineStats
from kiln.engine.request import Request, RequestId, SamplingParams
from kiln.engine.runner import ModelRunner
from kiln.engine.scheduler import Scheduler
from kiln.engine.structured import TokenConstraint, structured_shape

__all__ = ["Engine", "RequestNotFoundError"]


class RequestNotFoundError(KeyError):
    """A request id the engine does not know (finished and released, or never added)."""

    def __str__(self) -> str:  # KeyError's own str() shows the repr of its argument
        return str(self.args[0]) if self.args else "unknown request"


class Engine:
    """Owns the scheduler and the runner. Not thread-safe: one thread at a time
    calls it (the front-ends hold a lock or run one engine thread)."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, *, vocab_size: int,
                 eos_token_ids: tuple[int, ...], background: BackgroundCompile | None = None,
                 vocab_bytes: Callable[[], Sequence[bytes | None]] | None = None) -> None:
        """``vocab_bytes`` gives each token id's bytes (``detokenizer.vocab_bytes``),
        called once, when the first structured request comes; None: the model
        has no tokenizer, and structured requests are refused."""
        self.scheduler = scheduler
        self.runner = runner
        # a build of the compiled pieces still running; they are swapped in between two steps
        self.background = background
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_model_len = scheduler.max_model_len
        self._generated_tokens = 0
        self._vocab_bytes = vocab_bytes
        self._vocab: Sequence[bytes | None] | None = None

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams, index: int | None = None) -> None:
        """Raise ValueError naming the prompt (``prompt {index}``) or the field
        (``params[{index}].top_p``) for a request the engine would refuse."""
        where = "prompt" if index is None else f"prompt {index}"
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params for {where} must be a SamplingParams, got {type(params).__name__}")
        params.validate("SamplingParams" if index is None else f"params[{index}]")
        if not prompt_token_ids:
            raise ValueError(f"{where} is empty")
        bad = next((t for t in prompt_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"{where}: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        bad = next((t for t in params.logit_bias or () if t >= self.vocab_size), None)
        if bad is not None:
            field = "SamplingParams" if index is None else f"params[{index}]"
            raise ValueError(f"{field}.logit_bias: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if params.structured is not None and self._vocab_bytes is None:
            field = "SamplingParams" if index is None else f"params[{index}]"
            raise ValueError(f"{field}.structured={params.structured!r} needs the model's tokenizer, and it has none")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"{where} has {len(prompt_token_ids)} tokens; max_model_len={self.max_model_len} "
                "leaves no room to generate"
            )

    def add_request(self, request_id: RequestId, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None) -> None:
        """Queue a request; it joins the running batch at the next ``step``.
        Requests with different ``cache_salt`` never share cached KV blocks."""
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {cache_salt!r}")
        self.check_request(prompt_token_ids, params)
        self.scheduler.add(Request(request_id, list(prompt_token_ids), params, eos_token_ids=self.eos_token_ids,
                                   cache_salt=cache_salt, constraint=self._constraint(params)))

    def _constraint(self, params: SamplingParams) -> TokenConstraint | None:
        if params.structured is None or self._vocab_bytes is None:
            return None
        if self._vocab is None:
            self._vocab = self._vocab_bytes()
        ends = (*(() if params.ignore_eos else self.eos_token_ids), *(params.stop_token_ids or ()))
        return TokenConstraint(self._vocab, ends, structured_shape(params.structured))

    def abort(self, request_ids: Iterable[RequestId]) -> None:
        """Finish these requests now (unknown or finished ones are ignored); their
        KV blocks are free before the next step."""
        for rid in request_ids:
            self.scheduler.finish(rid, "abort")

    def swap_if_ready(self) -> bool:
        """Swap a background build's compiled pieces in if they are ready: at the
        start of every step, and by a front-end whose engine is idle."""
        if self.background is None or not self.background.ready():
            return False
        self.background.install(self.runner)
        return True

    def background_pending(self) -> bool:
        """Whether a background build may still swap compiled pieces in."""
        return self.background is not None and self.background.pending

    def step(self) -> EngineOutputs:
        if self.background is not None:
            threads = self.background.engine_threads()
            if torch.get_num_threads() != threads:  # per thread: set on the thread that steps
                torch.set_num_threads(threads)
            self.swap_if_ready()
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler could not place any request in the KV cache")
            return EngineOutputs()
        sampled = self.runner.execute(sched)
        outputs = self.scheduler.update(sched, sampled.tokens, sampled.logprobs, sampled.prompt_logprobs)
        self._generated_tokens += sum(len(o.new_token_ids) for o in outputs)
        if self.background is not None:
            self.background.stepped()
        return EngineOutputs(outputs, sched.total_tokens, sched.num_preempted, sched.first_scheduled)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        kv, run = self.scheduler.kv, self.runner.stats
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_blocks=kv.num_blocks,
            kv_cache_usage=kv.usage,
            num_preemptions=self.scheduler.num_preemptions,
            steps=run.steps,
            scheduled_tokens=run.tokens,
            generated_tokens=self._generated_tokens,
            prefix_cache_queries=kv.stats.queries,
            prefix_cache_hits=kv.stats.hits,
            num_draft_tokens=self.scheduler.num_draft_tokens,
            num_accepted_tokens=self.scheduler.num_accepted_tokens,
            prepare_seconds=run.prepare_seconds,
            model_seconds=run.model_seconds,
            sample_seconds=run.sample_seconds,
            execution="compiled" if self.runner.compiled is not None else "eager",
            background_compile=self.background.state if self.background is not None else "off",
        )
