"""From engine outputs (token ids, finish reasons) to what users read: text,
stop strings, and one output collector per request.

The token that ends a request (EOS, or one of its stop token ids) stays in its
token ids but not in its text, unless ``include_stop_str_in_output``, as in
vLLM.

Each request's collector merges what arrived since its consumer last looked, so
any number of consumers can interleave, or pause, and each still gets all of its
own text and tokens exactly once (``take``). A stop string found in the text
finishes the request with reason ``stop``; ``process`` returns those request ids
for the caller to abort in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.engine.detokenizer import IncrementalDetokenizer
from kiln.engine.outputs import EngineOutputs, RequestOutput, StreamDelta, TokenLogprobs
from kiln.engine.request import RequestId, SamplingParams

__all__ = ["OutputProcessor", "ProcessedOutputs"]


@dataclass
class _RequestState:
    prompt: str | None
    prompt_token_ids: list[int]
    detok: IncrementalDetokenizer
    wants_logprobs: bool
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    # not yet taken by the request's consumer
    pending_text: str = ""
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprobs] = field(default_factory=list)
    pending_finish: bool = False
    # SamplingParams.prompt_logprobs: the prompt's, from the request's first token on
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    pending_prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class ProcessedOutputs:
    deltas: list[StreamDelta]  # what this step added, per request that moved
    to_abort: list[RequestId]  # finished here by a stop string: abort them in the engine


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._states: dict[RequestId, _RequestState] = {}

    def add_request(self, request_id: RequestId, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop_strings, params.min_tokens,
                                       params.include_stop_str_in_output, params.skip_special_tokens)
        self._states[request_id] = _RequestState(prompt, list(prompt_token_ids), detok, params.logprobs is not None)

    def __contains__(self, request_id: RequestId) -> bool:
        return request_id in self._states

    def process(self, outputs: EngineOutputs) -> ProcessedOutputs:
        deltas, to_abort = [], []
        for out in outputs.outputs:
            state = self._states.get(out.request_id)
            if state is None or state.finish_reason is not None:
                continue  # released, or already finished by a stop string
            finish = out.finish_reason
            text_ids = out.new_token_ids
            if finish == "stop" and text_ids and not state.detok.include_stop:
                # the engine stops a request at EOS or a stop token id: that token ends the text and is not in it
                # (as vLLM: a special EOS is left out anyway, but not with skip_special_tokens=False)
                text_ids = text_ids[:-1]
            state.detok.add(text_ids, final=finish is not None)
            if state.detok.stopped and finish is None:
                finish = "stop"
                to_abort.append(out.request_id)
            if out.prompt_logprobs is not None:
                state.prompt_logprobs = state.pending_prompt_logprobs = out.prompt_logprobs
            deltas.append(self._record(out.request_id, state, out.new_token_ids, out.logprobs or [], finish,
                                       out.prompt_logprobs))
        return ProcessedOutputs(deltas, to_abort)

    def _record(self, request_id: RequestId, state: _RequestState, new_ids: list[int],
                logprobs: list[TokenLogprobs], finish: str | None,
                prompt_logprobs: list[TokenLogprobs | None] | None = None) -> StreamDelta:
        state.finish_reason = finish
        text = state.detok.take(finished=finish is not None)
        state.token_ids.extend(new_ids)
        state.logprobs.extend(logprobs)
        state.pending_text += text
        state.pending_ids.extend(new_ids)
        state.pending_logprobs.extend(logprobs)
        state.pending_finish = finish is not None
        return StreamDelta(request_id, text, list(new_ids), finish, list(logprobs) if state.wants_logprobs else None,
                           prompt_logprobs)

    def finish(self, request_id: RequestId, reason: str) -> StreamDelta | None:
        """Finish a request the engine ended without a step (an abort)."""
        state = self._states.get(request_id)
        if state is None or state.finish_reason is not None:
            return None
        return self._record(request_id, state, [], [], reason)

    def take(self, request_id: RequestId) -> StreamDelta | None:
        """Everything added to the request since the last ``take``, merged; None
        when nothing was."""
        state = self._states[request_id]
        if not (state.pending_text or state.pending_ids or state.pending_finish):
            return None
        delta = StreamDelta(request_id, state.pending_text, state.pending_ids,
                            state.finish_reason if state.pending_finish else None,
                            state.pending_logprobs if state.wants_logprobs else None, state.pending_prompt_logprobs)
        state.pending_text, state.pending_ids, state.pending_logprobs, state.pending_finish = "", [], [], False
        state.pending_prompt_logprobs = None
        return delta

    def finished(self, request_id: RequestId) -> bool:
        return self._states[request_id].finish_reason is not None

    def get_output(self, request_id: RequestId) -> RequestOutput:
        state = self._states[request_id]
        return RequestOutput(
            request_id=request_id,
            prompt=state.prompt,
            prompt_token_ids=list(state.prompt_token_ids),
            token_ids=list(state.token_ids),
            text=state.detok.text,
            finish_reason=state.finish_reason,
            logprobs=list(state.logprobs) if state.wants_logprobs else None,
            prompt_logprobs=state.prompt_logprobs,
        )

    def release(self, request_id: RequestId) -> None:
        self._states.pop(request_id, None)
