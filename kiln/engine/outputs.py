"""What the engine hands back: plain data, no tensors, no text (``EngineOutput``,
``EngineStats``), and what the front-ends hand to users (``RequestOutput``,
``StreamDelta``), which the output processor builds."""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.engine.request import RequestId
from kiln.engine.sampler import TokenLogprobs

__all__ = ["EngineOutput", "EngineOutputs", "EngineStats", "RequestOutput", "StreamDelta", "TokenLogprobs"]


@dataclass(frozen=True)
class EngineOutput:
    """What one step did to one request."""

    request_id: RequestId
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked
    # with a request's first token, when it asked: one per prompt token, None for the first (nothing predicts it)
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineOutputs:
    """What one engine step produced."""

    outputs: list[EngineOutput] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    num_preempted: int = 0
    first_scheduled: list[RequestId] = field(default_factory=list)  # left the waiting queue (queue time)


@dataclass(frozen=True)
class EngineStats:
    """The engine's state and counters since it started."""

    num_running: int
    num_waiting: int
    num_kv_blocks: int
    kv_cache_usage: float  # fraction of KV blocks in use, 0..1
    num_preemptions: int
    steps: int
    scheduled_tokens: int  # prompt and output tokens run through the model (recomputes too)
    generated_tokens: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of which were found cached (not computed)
    num_draft_tokens: int  # speculative decoding: drafts run
    num_accepted_tokens: int  # of which the model agreed with (each saved a step)
    prepare_seconds: float  # host work to build the step's inputs
    model_seconds: float  # forward and LM head
    sample_seconds: float
    execution: str = "eager"  # "eager" or "compiled": what the steps run now
    # "off", or a background build's state: building, loading, ready, swapped, failed
    background_compile: str = "off"


@dataclass
class RequestOutput:
    """The result of one prompt."""

    request_id: RequestId
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort"; None while running
    logprobs: list[TokenLogprobs] | None = None  # one per token of token_ids, when asked
    # one per prompt token when asked (SamplingParams.prompt_logprobs), None for the first
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StreamDelta:
    """What was added to a request since its consumer last looked."""

    request_id: RequestId
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per token of token_ids, when asked
    # the prompt's logprobs (as RequestOutput's), in the delta that brings the first token
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
