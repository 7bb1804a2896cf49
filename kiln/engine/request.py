"""Requests and the options that steer their sampling."""

from __future__ import annotations

import enum
import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Hashable

if TYPE_CHECKING:
    from kiln.engine.sampler import TokenLogprobs
    from kiln.engine.structured import TokenConstraint

__all__ = ["GREEDY_EPSILON", "RequestId", "SamplingParams", "Request", "RequestStatus"]

RequestId = Hashable

# Temperatures below this are greedy, as in vLLM: dividing logits by a smaller
# one overflows to inf and gives NaN probabilities.
GREEDY_EPSILON = 1e-5
MAX_LOGPROBS = 20


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value == value


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    ``temperature=0`` (or below ``GREEDY_EPSILON``) is greedy. ``top_k=0`` (or
    -1, as vLLM also takes it) and ``top_p=1.0`` disable those filters;
    ``min_p`` drops the tokens less likely than that fraction of the most
    likely one's probability (0 disables it).
    ``seed`` makes the request's samples reproducible whatever else is in the
    batch.

    The logits first take ``logit_bias`` (token id -> a value added to its
    logit, in [-100, 100]), then the penalties, as vLLM applies them: a
    ``repetition_penalty`` other than 1 divides the positive logits of the
    tokens in the prompt or the output so far by it and multiplies the
    negative ones; ``frequency_penalty`` is subtracted once for each time a
    token appears in the output so far, ``presence_penalty`` once if it
    appears at all (both in [-2, 2], as in the OpenAI API). Greedy requests
    take the argmax of the logits after these; temperature, ``min_p``,
    ``top_k`` and ``top_p`` follow, in that order. Generation stops at
    ``max_tokens`` new tokens, at the model's EOS token (unless ``ignore_eos``),
    at any of ``stop_token_ids``, or when the text produced so far contains one of
    the ``stop`` strings (which is cut from the returned text, unless
    ``include_stop_str_in_output``); before
    ``min_tokens`` new tokens none of these stop it (EOS and the stop token ids
    are not sampled, stop strings not looked for), as in vLLM. ``logprobs=k``
    returns each new token's log-probability and the ``k`` most likely ones.
    ``prompt_logprobs=k`` returns, for each prompt token after the first, its
    log-probability given the tokens before it and the ``k`` most likely
    tokens there, on the model's raw distribution (no penalty, temperature or
    filter), as vLLM's; such a request computes its whole prompt (the prefix
    cache is not read for it).
    The text leaves special tokens out unless ``skip_special_tokens`` is False.
    ``structured="json_object"`` keeps the output to a JSON object, a dict
    (a JSON Schema) to a value of its shape (``kiln.engine.structured``; the
    model needs a tokenizer).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # return the chosen token's logprob and this many top ones (<= 20)
    min_p: float = 0.0
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured: str | dict[str, Any] | None = None  # "json_object", or a JSON Schema: the output is kept to it
    prompt_logprobs: int | None = None  # each prompt token's logprob and this many top ones there (<= 20)

    def validate(self, where: str = "SamplingParams") -> None:
        """Raise ValueError naming the first invalid field."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"{where}.max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"{where}.temperature must be a number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"{where}.top_k must be an integer >= -1 (0 or -1 disables it), got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"{where}.top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"{where}.seed must be an integer or None, got {self.seed!r}")
        for flag in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{where}.{flag} must be true or false, got {getattr(self, flag)!r}")
        stop = self.stop
        if stop is not None and not isinstance(stop, str) and (
            not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop)
        ):
            raise ValueError(f"{where}.stop must be a string or a list of non-empty strings, got {stop!r}")
        if stop == "":
            raise ValueError(f"{where}.stop must not be empty")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{where}.{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {value!r}")
        ids = self.stop_token_ids
        if ids is not None and (not isinstance(ids, (list, tuple)) or not all(_is_int(t) for t in ids)):
            raise ValueError(f"{where}.stop_token_ids must be a list of integers, got {ids!r}")
        if self.structured is not None:
            from kiln.engine.structured import structured_shape

            try:
                structured_shape(self.structured)
            except ValueError as e:
                raise ValueError(f"{where}.structured: {e}") from None
        self._validate_sampler_options(where)

    def _validate_sampler_options(self, where: str) -> None:
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"{where}.min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"{where}.min_p must be in [0, 1] (0 disables it), got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{where}.{name} must be in [-2, 2] (0 disables it), got {value!r}")
        rep = self.repetition_penalty
        if not _is_number(rep) or not 0.0 < rep < float("inf"):
            raise ValueError(f"{where}.repetition_penalty must be a finite number > 0 (1 disables it), got {rep!r}")
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise ValueError(f"{where}.logit_bias must map token ids to numbers, got {bias!r}")
        for token, value in bias.items():
            if not _is_int(token) or token < 0:
                raise ValueError(f"{where}.logit_bias: key {token!r} is not a token id (an integer >= 0)")
            if not _is_number(value) or not -100.0 <= value <= 100.0:
                raise ValueError(f"{where}.logit_bias[{token}] must be a number in [-100, 100], got {value!r}")

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def penalized(self) -> bool:
        """Whether a penalty needs the tokens so far (the sampler's ``history``)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def changes_logits(self) -> bool:
        """Whether the logits change before the argmax: a greedy token is then
        not the raw logits' argmax."""
        return self.penalized or bool(self.logit_bias)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """A prompt being served: its tokens, its KV blocks and how far it has got.

    ``num_computed_tokens`` counts the tokens whose K/V sit in the cache. After a
    preemption it falls back to 0 and the request recomputes prompt and output so
    far (the output tokens are kept, so the result is unchanged), starting from
    whatever prefix of its blocks is still cached. The scheduler and the KV cache
    manager own every field but the ids, params and salt.
    """

    request_id: RequestId
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None  # requests with different salts never share cached blocks
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks, chained (prefix caching)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    # the automaton of a structured request (kiln.engine.structured.TokenConstraint): advanced with each token
    constraint: TokenConstraint | None = None
    # prompt_logprobs: those of prompt tokens 1, 2, ... computed so far (kept over a preemption)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # speculative decoding: tokens proposed to follow its tokens, run with its next step (kiln.engine.speculative)
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether some prompt tokens' logprobs are still to compute (the prefix
        cache must then not skip their positions)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
