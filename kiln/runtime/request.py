"""Requests and the options that steer their sampling."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = ["SamplingParams", "Request", "RequestStatus", "RequestOutput", "StreamDelta"]


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    ``temperature=0`` is greedy. ``top_k=0`` and ``top_p=1.0`` disable those
    filters. ``seed`` makes the request's samples reproducible whatever else is in
    the batch. Generation stops at ``max_tokens`` new tokens, at the model's EOS
    token (unless ``ignore_eos``), at any of ``stop_token_ids``, or when the text
    produced so far contains one of the ``stop`` strings (which is cut from the
    returned text).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    def validate(self, where: str = "SamplingParams") -> None:
        """Raise ValueError naming the first invalid field."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"{where}.max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0 or self.temperature != self.temperature:
            raise ValueError(f"{where}.temperature must be >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"{where}.top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"{where}.top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"{where}.seed must be an integer or None, got {self.seed!r}")
        for s in self.stop_strings:
            if not isinstance(s, str) or not s:
                raise ValueError(f"{where}.stop must hold non-empty strings, got {self.stop!r}")
        for t in self.stop_token_ids or []:
            if isinstance(t, bool) or not isinstance(t, int):
                raise ValueError(f"{where}.stop_token_ids must hold integers, got {self.stop_token_ids!r}")

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """The result of one prompt."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length"; None while running

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StreamDelta:
    """What one step added to a streamed request."""

    request_id: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class Request:
    """A prompt being served: its tokens, its KV blocks and how far it has got.

    ``num_computed_tokens`` counts the tokens whose K/V sit in the cache. After a
    preemption it falls back to 0 and the request recomputes prompt and output so
    far (the output tokens are kept, so the result is unchanged).
    """

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
