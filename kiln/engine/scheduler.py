"""Continuous batching over a paged KV cache.

Each step the scheduler spends a token budget: first on requests already running
(a decode token each, or the next chunk of a long prefill), then on waiting
requests, which join the running batch at any step. A waiting request starts
after the longest prefix of its tokens whose KV blocks are cached (prefix
caching): the budget pays only for the tokens after it. When the KV cache runs
short, the most recently admitted running request is preempted: its blocks go
back to the cache (still findable) and it waits to recompute its prompt and
output so far, losing nothing.

What it hands the runner is plain data (``ScheduledRequest``): token ids,
positions, block ids and sampling options, never a ``Request``; a structured
request's automaton goes with them, for the sampler to read. A request that
asks for its prompt's logprobs names the rows of its chunk whose logits give
them (``PromptLogprobRows``); they are kept on the request and go out with its
first token. With speculative decoding (a ``proposer``), a decoding request
runs the drafts proposed after its last step with its next token
(``draft_token_ids``), out of the budget and the blocks the step leaves;
``update`` keeps those the model agrees with.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

from kiln.engine.kv_cache_manager import KVCacheManager
from kiln.engine.outputs import EngineOutput
from kiln.engine.request import Request, RequestId, RequestStatus, SamplingParams
from kiln.engine.sampler import TokenLogprobs
from kiln.engine.speculative import NgramProposer, accept, speculates
from kiln.engine.structured import TokenConstraint

__all__ = ["PromptLogprobRows", "ScheduledRequest", "SchedulerOutput", "Scheduler"]


@dataclass(frozen=True)
class PromptLogprobRows:
    """Rows of a chunk whose logits give prompt tokens' logprobs: rows
    ``first, first + 1, ...`` of the chunk's tokens predict ``targets`` (the
    prompt tokens after them), with the ``k`` most likely tokens at each."""

    first: int
    targets: list[int]
    k: int


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step."""

    request_id: RequestId
    token_ids: list[int]  # the tokens computed this step
    start: int  # position of token_ids[0]
    block_ids: list[int]  # the request's KV blocks (its block-table row); read only
    # Set when this step reaches the end of the known tokens, so the logits of its
    # last token pick the next one.
    sampling: SamplingParams | None
    num_output_tokens: int  # tokens the request produced before this step (seeds per token)
    # (prompt, output so far) where the sampling options penalize repeats (SamplingParams.penalized); read only
    history: tuple[list[int], list[int]] | None = None
    # token ids the sampler must not pick: EOS and the stop token ids, before the request's min_tokens
    suppressed: tuple[int, ...] = ()
    # what the sampler may pick of a structured request (Request.constraint); read only
    constraint: TokenConstraint | None = None
    # the chunk's rows whose logits give prompt tokens' logprobs (SamplingParams.prompt_logprobs)
    prompt_logprobs: PromptLogprobRows | None = None
    # speculative decoding: the last tokens of token_ids are drafts, each of their rows sampled too
    draft_token_ids: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_samples(self) -> int:
        """Rows whose tokens are picked: the last token's, and each draft's."""
        return 0 if self.sampling is None else 1 + len(self.draft_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_preempted: int = 0
    first_scheduled: list[RequestId] = field(default_factory=list)  # running for the first time

    @property
    def total_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


def _schedule(req: Request, n: int) -> ScheduledRequest:
    start = req.num_computed_tokens
    samples = start + n == req.num_tokens
    p = req.params
    history = (req.prompt_token_ids, req.output_token_ids) if samples and p.penalized else None
    suppressed: tuple[int, ...] = ()
    if samples and len(req.output_token_ids) < p.min_tokens:
        suppressed = (*(() if p.ignore_eos else req.eos_token_ids), *(p.stop_token_ids or ()))
    return ScheduledRequest(req.request_id, req.tokens(start, start + n), start, req.block_ids,
                            p if samples else None, len(req.output_token_ids), history, suppressed,
                            req.constraint if samples else None, _prompt_rows(req, start, n))


def _prompt_rows(req: Request, start: int, n: int) -> PromptLogprobRows | None:
    """The rows of ``req``'s chunk ``[start, start + n)`` that predict prompt
    tokens whose logprobs are not computed yet (row ``p`` predicts token ``p + 1``)."""
    if not req.wants_prompt_logprobs:
        return None
    first = max(start, len(req.prompt_logprobs))  # rows before it were computed before a preemption
    end = min(start + n, len(req.prompt_token_ids) - 1)
    if first >= end:
        return None
    return PromptLogprobRows(first - start, req.prompt_token_ids[first + 1:end + 1], req.params.prompt_logprobs)


class Scheduler:
    def __init__(
        self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
        proposer: NgramProposer | None = None,
    ) -> None:
        self.kv = kv
        self.proposer = proposer  # speculative decoding's drafts; None: one token a step
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[RequestId, Request] = {}  # every unfinished request
        self.num_preemptions = 0
        self.num_draft_tokens = 0  # drafts run (speculative decoding)
        self.num_accepted_tokens = 0  # of which the model agreed with

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._reserve(req, n, out):
                break  # the request itself was preempted: nothing after it is running
            out.scheduled.append(_schedule(req, n))
            budget -= n
            i += 1
        # A step that had to preempt admits nobody: the cache is already too tight.
        while not out.num_preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            # a prompt's logprobs need its positions computed, cached or not
            prefix = [] if req.wants_prompt_logprobs else self.kv.cached_prefix(req)
            n = min(req.num_tokens - len(prefix) * self.kv.block_size, budget)
            if not self.kv.allocate(req, prefix, len(prefix) * self.kv.block_size + n):
                break
            req.num_computed_tokens = len(prefix) * self.kv.block_size
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.num_preemptions == 0:  # a request only waits again after a preemption
                out.first_scheduled.append(req.request_id)
            out.scheduled.append(_schedule(req, n))
            budget -= n
        if self.proposer is not None:
            self._add_drafts(out, budget)
        return out

    def _add_drafts(self, out: SchedulerOutput, budget: int) -> None:
        """Decoding requests' drafts, with the budget and the free blocks the
        step left: a draft never delays a prompt or preempts a request. None
        while the batch is larger than ``SpeculativeConfig.disable_by_batch_size``."""
        limit = self.proposer.max_batch  # type: ignore[union-attr]
        if limit is not None and len(self.running) + len(self.waiting) > limit:
            return
        for i, s in enumerate(out.scheduled):
            if budget <= 0:
                break
            req = self.requests[s.request_id]
            if not req.draft_token_ids or s.num_tokens != 1 or s.sampling is None:
                continue
            drafts = req.draft_token_ids[:budget]
            if self.kv.grow(req, s.start + 1 + len(drafts)):
                out.scheduled[i] = replace(s, token_ids=s.token_ids + drafts, draft_token_ids=tuple(drafts))
                budget -= len(drafts)

    def _reserve(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Grow ``req``'s blocks to hold ``n`` more tokens, preempting from the back
        of the running list until it fits. False when ``req`` was the victim."""
        while not self.kv.grow(req, req.num_computed_tokens + n):
            victim = self.running.pop()
            self._preempt(victim)
            out.num_preempted += 1
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, out: SchedulerOutput, sampled: list[int], logprobs: list[TokenLogprobs | None] | None = None,
               prompt_logprobs: dict[RequestId, list[TokenLogprobs]] | None = None) -> list[EngineOutput]:
        """Advance every scheduled request; append the sampled tokens (one per
        sampled row, in schedule order: a request's drafts' rows after its
        token's) and finish requests that hit a stop condition known from token
        ids alone. ``logprobs`` are the rows' (None: no row asked);
        ``prompt_logprobs`` those of the rows each ``PromptLogprobRows`` named,
        and a request's first token carries all of its prompt's. Returns what
        each sampling request gained."""
        outputs = []
        row = 0  # the first of this request's sampled rows
        for s in out.scheduled:
            req = self.requests[s.request_id]
            if s.prompt_logprobs is not None:
                req.prompt_logprobs.extend((prompt_logprobs or {})[s.request_id])
            if s.sampling is None:
                req.num_computed_tokens += s.num_tokens
                self.kv.cache_full_blocks(req)
                continue
            end = row + s.num_samples
            tokens = accept(s.draft_token_ids, sampled[row:end])
            # positions whose keys and values hold: the chunk up to the last draft kept (a refused draft's are
            # overwritten later)
            req.num_computed_tokens += s.num_tokens - len(s.draft_token_ids) + len(tokens) - 1
            self.kv.cache_full_blocks(req)
            self.num_draft_tokens += len(s.draft_token_ids)
            self.num_accepted_tokens += len(tokens) - 1
            outputs.append(self._append(req, tokens, logprobs[row:end] if logprobs else None))
            row = end
        return outputs

    def _append(self, req: Request, tokens: list[int], logprobs: list[TokenLogprobs | None] | None) -> EngineOutput:
        """Append ``tokens`` to ``req`` up to the first that stops it; then its
        next drafts, while it runs."""
        first = not req.output_token_ids and req.params.prompt_logprobs is not None
        kept, reason = [], None
        for token in tokens:
            req.output_token_ids.append(token)
            kept.append(token)
            if req.constraint is not None:
                req.constraint.advance(token)
            reason = self._stop_reason(req, token)
            if reason is not None:
                self.finish(req.request_id, reason)
                break
        if reason is None and self.proposer is not None:
            req.draft_token_ids = self._drafts(req)
        kept_logprobs = None if logprobs is None or logprobs[0] is None else logprobs[:len(kept)]
        return EngineOutput(req.request_id, kept, reason, kept_logprobs,
                            prompt_logprobs=[None, *req.prompt_logprobs] if first else None)

    def _drafts(self, req: Request) -> list[int]:
        """Drafts for ``req``'s next step: none past its budget or the context
        (a draft kept is a token appended), none for a request that does not
        speculate."""
        if not speculates(req):
            return []
        room = min(req.params.max_tokens - len(req.output_token_ids), self.max_model_len - req.num_tokens) - 1
        return self.proposer.propose(req, room)  # type: ignore[union-attr]

    def _stop_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if len(req.output_token_ids) > p.min_tokens:  # before, the sampler offered neither EOS nor a stop token id
            if not p.ignore_eos and token in req.eos_token_ids:
                return "stop"
            if p.stop_token_ids and token in p.stop_token_ids:
                return "stop"
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def finish(self, request_id: RequestId, reason: str) -> Request | None:
        """End a request now (also for stop strings and aborts) and free its
        blocks; the request, or None when it is unknown or already finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.draft_token_ids = []
        if self.proposer is not None:
            self.proposer.forget(request_id)
        return req
