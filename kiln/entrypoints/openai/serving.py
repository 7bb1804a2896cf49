"""The completion and chat handlers: requests in, OpenAI-shaped responses or
Server-Sent Events out.

Each choice (a prompt times ``n``) is one engine request. Non-streamed, the
choices are gathered; streamed, one task per choice feeds a queue and the SSE
generator turns what arrives into chunks in OpenAI's order: (chat) a role chunk
per choice, content deltas, a chunk with the finish reason, a usage chunk with
``choices: []`` when ``stream_options.include_usage`` is set, then
``data: [DONE]`` always, after an error too. A client that goes away cancels the
tasks, which aborts their requests.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from kiln.engine.outputs import StreamDelta, TokenLogprobs
from kiln.engine.request import SamplingParams
from kiln.engine.structured import structured_shape
from kiln.entrypoints.async_engine import AsyncEngine, RequestTimes
from kiln.entrypoints.chat import render_chat
from kiln.entrypoints.openai.logprobs import LogprobFormatter
from kiln.entrypoints.openai.metrics import ServerMetrics
from kiln.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ToolUse,
    chat_logprobs,
    sampling_params,
    tool_use,
)
from kiln.entrypoints.openai.reasoning import CONTENT, REASONING, ReasoningStream, reasoning_stream, split_reasoning
from kiln.entrypoints.openai.tool_parsers import ForcedCalls, ToolCall, ToolCallStream, parse, tool_parser

__all__ = ["Choice", "OpenAIServing"]


@dataclass
class Choice:
    """One engine request of an API request, and what it produced."""

    index: int
    prompt_ids: list[int]
    prompt_text: str | None
    params: SamplingParams
    cache_salt: str | None = None
    # completions' echo with max_tokens=0: the prompt alone; the one token generated is not shown
    echo_only: bool = False
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # SamplingParams.prompt_logprobs
    finish_reason: str | None = None

    def add(self, delta: StreamDelta) -> StreamDelta:
        """Record ``delta``; return what of it the client sees."""
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if self.echo_only:
            delta = replace(delta, text="", token_ids=[], logprobs=[] if delta.logprobs is not None else None)
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        self.finish_reason = delta.finish_reason or self.finish_reason
        return delta


def _usage(choices: list[Choice]) -> dict[str, int]:
    prompts = {id(c.prompt_ids): len(c.prompt_ids) for c in choices}  # n choices share their prompt
    prompt, completion = sum(prompts.values()), sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class OpenAIServing:
    """The handlers over one engine. ``chat_template`` replaces the tokenizer's
    (``--chat-template``); ``tool_call_parser`` (``--tool-call-parser``) names
    the format whose calls chat answers are parsed for when a request offers
    tools (``tool_parsers.TOOL_PARSERS``); ``reasoning_parser``
    (``--reasoning-parser``) how a chat answer's reasoning is split off
    (``reasoning.REASONING_PARSERS``)."""

    def __init__(self, engine: AsyncEngine, model_name: str, metrics: ServerMetrics, *,
                 chat_template: str | None = None, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.chat_template = chat_template
        self.tool_call_parser = tool_call_parser
        self._tool_parser_class = tool_parser(tool_call_parser) if tool_call_parser else None
        self.reasoning_parser = reasoning_parser
        if reasoning_parser is not None:
            reasoning_stream(reasoning_parser)  # an unknown name fails here, not at the first request
        self.max_model_len = engine.config.max_model_len
        self.logprobs = LogprobFormatter(engine.tokenizer)
        self.defaults = SamplingParams(**{k: v for k, (v, _) in engine.config.sampling_defaults.items()})

    # ------------------------------------------------------------------ shared
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                           status=404, param="model")

    def _fits(self, prompt_ids: list[int], max_tokens: int | None) -> int:
        """The max_tokens to use (None: the rest of the context); 400 when the
        prompt and the output cannot fit."""
        room = self.max_model_len - len(prompt_ids)
        wanted = room if max_tokens is None else max_tokens
        if room < 1 or wanted > room:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{wanted} output tokens and your prompt contains {len(prompt_ids)} input tokens, for a total of "
                f"{wanted + len(prompt_ids)} tokens. Please reduce the length of the input prompt or the number "
                "of requested output tokens.", param="input_tokens")
        return wanted

    def _choices(self, prompts: list[tuple[list[int], str | None]], params: SamplingParams, n: int,
                 cache_salt: str | None) -> list[Choice]:
        choices = []
        for ids, text in prompts:
            for j in range(n):
                seed = params.seed + j if params.seed is not None and n > 1 else params.seed
                choices.append(Choice(len(choices), ids, text, replace(params, seed=seed), cache_salt))
        for c in choices:
            try:
                self.engine.check_request(c.prompt_ids, c.params)
            except ValueError as e:  # the prompt, or a logit_bias token outside the vocabulary
                message = str(e).removeprefix("SamplingParams.")
                raise APIError(message, param="logit_bias" if message.startswith("logit_bias") else "prompt") from None
        return choices

    async def _run(self, choice: Choice, queue: asyncio.Queue | None = None) -> Choice:
        """Generate one choice (feeding ``queue`` when streaming) and record its metrics."""
        times = RequestTimes(time.monotonic())
        try:
            async for delta in self.engine.generate(choice.prompt_ids, choice.params, prompt=choice.prompt_text,
                                                    times=times, cache_salt=choice.cache_salt):
                seen = choice.add(delta)
                if queue is not None:
                    queue.put_nowait((choice, seen))
        finally:  # a client that went away counts as an abort
            self.metrics.record_request(times, len(choice.prompt_ids), len(choice.token_ids),
                                        choice.finish_reason or "abort")
        return choice

    async def _gather(self, choices: list[Choice]) -> list[Choice]:
        tasks = [asyncio.ensure_future(self._run(c)) for c in choices]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()

    async def _stream(self, choices: list[Choice]) -> AsyncIterator[tuple[Choice, StreamDelta]]:
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.ensure_future(self._run(c, queue)) for c in choices]
        done = asyncio.ensure_future(asyncio.gather(*tasks))
        try:
            while not (done.done() and queue.empty()):
                getter = asyncio.ensure_future(queue.get())
                await asyncio.wait([getter, done], return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield getter.result()
                else:
                    getter.cancel()
            done.result()  # raises what a choice raised
        finally:
            for t in tasks:
                t.cancel()
            done.cancel()

    # ------------------------------------------------------------------ completions
    def _completion_prompts(self, req: CompletionRequest) -> list[tuple[list[int], str | None]]:
        prompt = req.prompt
        items: list[Any] = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
        if not items:
            raise APIError("prompt must not be empty", param="prompt")
        out = []
        for item in items:
            if isinstance(item, str):
                if not item:
                    raise APIError("prompt must not be empty", param="prompt")
                if self.engine.tokenizer is None:
                    raise APIError("this model has no tokenizer: send token ids", param="prompt")
                out.append((list(self.engine.tokenizer.encode(item)), item))
            else:
                out.append((list(item), None))
        return out

    def completion_choices(self, req: CompletionRequest) -> list[Choice]:
        """One choice per prompt times ``n``. With ``echo`` and ``logprobs`` the
        prompt's logprobs are computed too (``prompt_logprobs``, as vLLM does);
        ``echo`` with ``max_tokens=0`` returns the prompt alone (one token is
        generated and not shown)."""
        self.check_model(req.model)
        echo_only = req.echo and req.max_tokens == 0
        prompts = self._completion_prompts(req)
        max_tokens = max(self._fits(ids, 1 if echo_only else req.max_tokens) for ids, _ in prompts)
        prompt_k = req.prompt_logprobs if req.prompt_logprobs is not None else req.logprobs if req.echo else None
        params = sampling_params(req, self.defaults, max_tokens, req.logprobs, prompt_k)
        choices = self._choices(prompts, params, req.n, req.cache_salt)
        return [replace(c, echo_only=True) for c in choices] if echo_only else choices

    def _echo(self, choice: Choice, echo: bool) -> str:
        if not echo:
            return ""
        return choice.prompt_text if choice.prompt_text is not None else self.engine.tokenizer.decode(choice.prompt_ids)

    def _echo_logprobs(self, choice: Choice) -> dict[str, list[Any]]:
        """Completions' logprobs of an echoed prompt: its first token has none."""
        lps = choice.prompt_logprobs or [None] * len(choice.prompt_ids)
        return self.logprobs.completion(lps, choice.prompt_ids, 0, [])

    def _completion_choice(self, c: Choice, echo: bool) -> dict[str, Any]:
        echoed = self._echo(c, echo)
        out: dict[str, Any] = {"index": c.index, "text": echoed + c.text, "finish_reason": c.finish_reason,
                               "logprobs": None}
        if c.params.logprobs is not None:
            lps = self.logprobs.completion(c.logprobs, c.token_ids, len(echoed), c.prompt_ids)
            out["logprobs"] = self.logprobs.joined(self._echo_logprobs(c), lps) if echo else lps
        if c.prompt_logprobs is not None:  # vLLM's field
            out["prompt_logprobs"] = self.logprobs.prompt(c.prompt_logprobs, c.prompt_ids)
        return out

    async def completions(self, req: CompletionRequest) -> dict[str, Any]:
        created = int(time.time())  # when the request came, as OpenAI and vLLM stamp it, not when it finished
        choices = await self._gather(self.completion_choices(req))
        return {
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": created,
            "model": self.model_name, "usage": _usage(choices),
            "choices": [self._completion_choice(c, req.echo) for c in choices],
        }

    async def completion_stream(self, req: CompletionRequest, choices: list[Choice]) -> AsyncIterator[str]:
        """An echoed prompt goes out when its choice's first tokens come (with
        its logprobs, which come with them), then each step's text."""
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name}
        sent = {c.index: len(self._echo(c, req.echo)) for c in choices}
        tokens_sent = {c.index: 0 for c in choices}
        to_echo = {c.index for c in choices} if req.echo else set()
        async for choice, delta in self._stream(choices):
            if choice.index in to_echo:
                to_echo.discard(choice.index)
                lps = self._echo_logprobs(choice) if choice.params.logprobs is not None else None
                yield sse({**head, "choices": [{"index": choice.index, "text": self._echo(choice, True),
                                                "logprobs": lps, "finish_reason": None}]})
            before = tokens_sent[choice.index]
            lps = (self.logprobs.completion(delta.logprobs or [], delta.token_ids, sent[choice.index],
                                            choice.prompt_ids + choice.token_ids[:before])
                   if choice.params.logprobs is not None else None)
            sent[choice.index] += len(delta.text)
            tokens_sent[choice.index] += len(delta.token_ids)
            if delta.text or delta.token_ids:
                yield sse({**head, "choices": [{"index": choice.index, "text": delta.text, "logprobs": lps,
                                                "finish_reason": None}]})
            if delta.finished:
                yield sse({**head, "choices": [{"index": choice.index, "text": "", "logprobs": None,
                                                "finish_reason": delta.finish_reason}]})
        if req.stream_options is not None and req.stream_options.include_usage:
            yield sse({**head, "choices": [], "usage": _usage(choices)})

    # ------------------------------------------------------------------ chat
    def _tool_use(self, req: ChatCompletionRequest) -> ToolUse:
        return tool_use(req, self.tool_call_parser)

    def _tool_parser(self, use: ToolUse) -> ToolCallStream | None:
        if use.forced:
            return ForcedCalls(use.named)
        return self._tool_parser_class() if use.parse and self._tool_parser_class is not None else None

    def chat_choices(self, req: ChatCompletionRequest) -> list[Choice]:
        self.check_model(req.model)
        use = self._tool_use(req)
        try:
            ids = render_chat(self.engine.tokenizer, req.messages, req.chat_template_kwargs, tools=use.tools,
                              chat_template=self.chat_template, add_generation_prompt=req.add_generation_prompt,
                              continue_final_message=req.continue_final_message)
        except ValueError as e:
            param = next((p for p in ("chat_template_kwargs", "continue_final_message") if p in str(e)), "messages")
            raise APIError(str(e), param=param) from None
        max_tokens = self._fits(ids, req.max_completion_tokens if req.max_completion_tokens is not None
                                else req.max_tokens)
        params = sampling_params(req, self.defaults, max_tokens, chat_logprobs(req), req.prompt_logprobs)
        if use.forced:
            params = self._forced(params, use)
        if use.parse and req.skip_special_tokens is None:
            # as vLLM does: some vocabularies make <tool_call> or [TOOL_CALLS] special tokens, which the text
            # would leave out
            params = replace(params, skip_special_tokens=False)
        return self._choices([(ids, None)], params, req.n, req.cache_salt)

    @staticmethod
    def _forced(params: SamplingParams, use: ToolUse) -> SamplingParams:
        """A forced call's answer is decoded under the calls' schema."""
        if params.structured is not None:
            raise APIError("tool_choice 'required' or a named function already constrains the answer; drop "
                           "response_format", param="response_format")
        try:
            structured_shape(use.schema)  # type: ignore[arg-type]
        except ValueError as e:
            raise APIError(f"tools: a function's parameters: {e}", param="tools") from None
        return replace(params, structured=use.schema)

    def _chat_message(self, choice: Choice, use: ToolUse) -> tuple[dict[str, Any], str | None]:
        """A finished choice's message and finish reason: its reasoning split
        off (``reasoning_content``) with a reasoning parser, and tool calls
        parsed out of the rest when the request asked (finish reason ``tool_calls``)."""
        message: dict[str, Any] = {"role": "assistant"}
        text = choice.text
        if self.reasoning_parser is not None:
            message["reasoning_content"], text = split_reasoning(reasoning_stream(self.reasoning_parser), text)
        parser = self._tool_parser(use)
        if parser is None:
            return {**message, "content": text}, choice.finish_reason
        parsed = parse(parser, text)
        calls = parsed.tool_calls if use.parallel else parsed.tool_calls[:1]
        if not calls:
            return {**message, "content": parsed.content}, choice.finish_reason
        # OpenAI's: a named function's call finishes with "stop"
        reason = "tool_calls" if choice.finish_reason == "stop" and use.named is None else choice.finish_reason
        return {**message, "content": parsed.content, "tool_calls": [c.to_openai() for c in calls]}, reason

    async def chat(self, req: ChatCompletionRequest) -> dict[str, Any]:
        created = int(time.time())  # when the request came, not when it finished
        use = self._tool_use(req)
        choices = await self._gather(self.chat_choices(req))
        out = []
        for c in choices:
            message, reason = self._chat_message(c, use)
            out.append({"index": c.index, "message": message, "finish_reason": reason,
                        "logprobs": self.logprobs.chat(c.logprobs, c.token_ids, c.prompt_ids)
                        if c.params.logprobs is not None else None})
        response = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": created,
                    "model": self.model_name, "usage": _usage(choices), "choices": out}
        if choices[0].prompt_logprobs is not None:  # vLLM's field: the choices share the prompt
            response["prompt_logprobs"] = self.logprobs.prompt(choices[0].prompt_logprobs, choices[0].prompt_ids)
        return response

    async def chat_stream(self, req: ChatCompletionRequest, choices: list[Choice]) -> AsyncIterator[str]:
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model_name}
        use = self._tool_use(req)
        streams = {c.index: _ChatStream(self._tool_parser(use), use.parallel,
                                        reasoning_stream(self.reasoning_parser) if self.reasoning_parser else None)
                   for c in choices}
        tokens_sent = {c.index: 0 for c in choices}
        for c in choices:
            yield sse({**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
        async for choice, delta in self._stream(choices):
            before = tokens_sent[choice.index]
            lps = (self.logprobs.chat(delta.logprobs or [], delta.token_ids,
                                       choice.prompt_ids + choice.token_ids[:before])
                   if choice.params.logprobs is not None else None)
            tokens_sent[choice.index] += len(delta.token_ids)
            stream = streams[choice.index]
            for body in stream.deltas(delta, keep_empty=lps is not None):
                yield sse({**head, "choices": [{"index": choice.index, "delta": body, "logprobs": lps,
                                                "finish_reason": None}]})
                lps = None  # a step's logprobs go with its first chunk
            if delta.finished:
                reason = ("tool_calls" if stream.calls and delta.finish_reason == "stop" and use.named is None
                          else delta.finish_reason)
                yield sse({**head, "choices": [{"index": choice.index, "delta": {}, "logprobs": None,
                                                "finish_reason": reason}]})
        if req.stream_options is not None and req.stream_options.include_usage:
            yield sse({**head, "choices": [], "usage": _usage(choices)})


class _ChatStream:
    """One streamed choice's deltas: the reasoning split off first (a
    reasoning parser), then the content through a tool call parser when the
    request parses calls. Text that could begin a tag or a call is held back;
    each call goes out whole, as one ``tool_calls`` delta with its index."""

    def __init__(self, parser: ToolCallStream | None, parallel: bool, reasoning: ReasoningStream | None) -> None:
        self.parser = parser
        self.parallel = parallel
        self.reasoning = reasoning
        self.calls = 0

    def deltas(self, delta: StreamDelta, keep_empty: bool) -> list[dict[str, Any]]:
        """The delta bodies ``delta`` gives; with ``keep_empty`` (logprobs asked
        for) an empty content delta for tokens the parsers hold back, to carry
        their logprobs."""
        if self.parser is None and self.reasoning is None:
            return [{"content": delta.text}] if delta.text or delta.token_ids else []
        pieces = [(CONTENT, delta.text)] if self.reasoning is None else (
            self.reasoning.feed(delta.text) + (self.reasoning.finish() if delta.finished else []))
        out: list[dict[str, Any]] = []
        for kind, text in pieces:
            if kind == REASONING:
                out.append({"reasoning_content": text})
            else:
                out += self._content(self.parser.feed(text) if self.parser is not None else [text])
        if delta.finished and self.parser is not None:
            out += self._content(self.parser.finish())
        if not out and keep_empty and delta.token_ids:
            out.append({"content": ""})
        return out

    def _content(self, items: list[str | ToolCall]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for item in items:
            if isinstance(item, str):
                if item:
                    out.append({"content": item})
            elif self.parallel or not self.calls:  # parallel_tool_calls=false: the first call only
                out.append({"tool_calls": [{"index": self.calls, **item.to_openai()}]})
                self.calls += 1
        return out
