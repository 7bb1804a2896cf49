"""Request bodies of the OpenAI API as kiln accepts them, and their translation
into kiln's requests.

Unknown fields are accepted and ignored, as OpenAI clients expect, and named
in a warning in the log, as vLLM does. Every
validation failure is an ``APIError`` with HTTP 400 that names the field in
``param``; a request that fails never reaches the scheduler.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from kiln.engine.request import MAX_LOGPROBS, SamplingParams

__all__ = ["APIError", "ChatCompletionRequest", "CompletionRequest", "StreamOptions", "ToolUse", "sampling_params",
           "tool_use"]

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error the server answers with OpenAI's envelope
    ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type_: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type_ or {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                              503: "ServiceUnavailableError"}.get(status, "InternalServerError")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None  # vLLM's: no EOS, stop token id or stop string before this many tokens
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None  # token id (as a string, as JSON keys are) -> bias in [-100, 100]
    include_stop_str_in_output: bool | None = None  # vLLM's: the stop string found ends the text
    skip_special_tokens: bool | None = None  # vLLM's: False puts special tokens in the text
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None  # requests with different salts never share cached KV blocks
    response_format: dict[str, Any] | None = None  # {"type": "text" | "json_object"}
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and this many top ones there


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # 0 only with echo: the prompt alone
    logprobs: int | None = None
    echo: bool = False


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None  # vLLM's; default: true unless continue_final_message
    continue_final_message: bool = False  # vLLM's: the answer continues the last message (no new turn)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


# the request fields that are SamplingParams fields of the same name and meaning
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "min_tokens", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "seed", "stop", "stop_token_ids", "include_stop_str_in_output",
                    "skip_special_tokens")


def _check_common(req: _SamplingFields) -> None:
    if req.n < 1 or req.n > 16:
        raise APIError(f"n must be between 1 and 16, got {req.n}", param="n")
    if req.stream_options is not None and not req.stream:
        raise APIError("stream_options is only allowed with stream=true", param="stream_options")


def sampling_params(req: CompletionRequest | ChatCompletionRequest, defaults: SamplingParams, max_tokens: int,
                    logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
    """kiln's SamplingParams for ``req``: the request's fields over the model's
    generation defaults. Raises APIError (400) naming the bad field."""
    _check_common(req)
    if req.model_extra:  # as vLLM does: served, and said
        logger.warning("request fields ignored (kiln does not implement them): %s", ", ".join(sorted(req.model_extra)))
    given = {k: getattr(req, k) for k in _SAMPLING_FIELDS if getattr(req, k) is not None}
    if req.logit_bias:
        given["logit_bias"] = _logit_bias(req.logit_bias)
    if req.response_format is not None:
        given["structured"] = _structured(req.response_format)
    params = SamplingParams(**{**vars(defaults), **given, "max_tokens": max_tokens, "ignore_eos": req.ignore_eos,
                               "logprobs": logprobs, "prompt_logprobs": prompt_logprobs})
    try:
        params.validate("request")
    except ValueError as e:
        named = re.match(r"request\.(\w+)", str(e))
        param = named.group(1) if named else None
        if param == "structured":  # a schema kiln cannot keep
            raise APIError(str(e).replace("request.structured: schema", "response_format.json_schema.schema", 1),
                           param="response_format") from None
        raise APIError(str(e).replace("request.", "", 1), param=param) from None
    return params


def _structured(response_format: dict[str, Any]) -> str | dict[str, Any] | None:
    """OpenAI's ``response_format`` as ``SamplingParams.structured``: ``text``
    is none, ``json_object`` keeps the output to a JSON object, ``json_schema``
    to its ``json_schema.schema`` (what of a schema is kept:
    ``kiln.engine.json_schema``; a schema kiln cannot keep is a 400 naming the
    keyword, never an answer that ignores it)."""
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object"
    if kind != "json_schema":
        raise APIError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                       param="response_format")
    spec = response_format.get("json_schema")
    schema = spec.get("schema", {}) if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise APIError("response_format.json_schema must be {'name': ..., 'schema': {...}}", param="response_format")
    return schema


def _logit_bias(bias: dict[str, Any]) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as strings) as SamplingParams takes it."""
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise APIError(f"logit_bias[{key!r}] must be a number, got {value!r}", param="logit_bias")
        out[token] = float(value)
    return out


def chat_logprobs(req: ChatCompletionRequest) -> int | None:
    """Chat asks for logprobs with a flag and a count."""
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise APIError(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {req.top_logprobs}",
                       param="top_logprobs")
    if req.top_logprobs and not req.logprobs:
        raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


@dataclass(frozen=True)
class ToolUse:
    """What a chat request's ``tools`` and ``tool_choice`` ask of the server:
    the definitions to render into the prompt (None: none), whether to parse
    calls out of the answer with the server's parser (``auto``), and whether
    to keep more than the first call. A forced call (``required``, or a named
    function: ``named``) is decoded under ``schema`` instead: a JSON array of
    ``{"name", "parameters"}`` calls, or the named function's arguments."""

    tools: list[dict[str, Any]] | None = None
    parse: bool = False
    parallel: bool = True
    schema: dict[str, Any] | None = None
    named: str | None = None

    @property
    def forced(self) -> bool:
        return self.schema is not None


_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def tool_use(req: ChatCompletionRequest, parser: str | None) -> ToolUse:
    """OpenAI's ``tool_choice`` semantics over ``req.tools``, with the server's
    tool call parser (``--tool-call-parser``; None: the server parses no
    calls). ``none`` leaves the tools out of the prompt; ``auto`` (the default
    when tools are given) offers them and parses the answer, and needs a
    parser. ``required`` and a named function (``{"type": "function",
    "function": {"name": ...}}``) need none: the answer is decoded under a
    JSON Schema of the calls (``kiln.engine.structured``), as vLLM does."""
    tools = _check_tools(req.tools) if req.tools is not None else []
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if choice == "none":
        return ToolUse()
    if not tools:
        raise APIError(f"tool_choice {choice!r:.80} needs tools", param="tool_choice")
    parallel = req.parallel_tool_calls is not False
    if choice == "required":
        return ToolUse(tools, parallel=parallel, schema=_calls_schema(tools, parallel))
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        by_name = {t["function"]["name"]: t["function"] for t in tools}
        if choice.get("type", "function") != "function" or name not in by_name:
            raise APIError(f"tool_choice must name one of the tools ({', '.join(by_name)}) as "
                           f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r:.80}",
                           param="tool_choice")
        return ToolUse(tools, parallel=False, schema=_parameters(by_name[name]), named=name)
    if choice != "auto":
        raise APIError(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r:.80}",
                       param="tool_choice")
    if parser is None:
        raise APIError("tool_choice 'auto' (the default when tools are given) needs the server started with "
                       "--tool-call-parser (hermes, llama3_json or mistral); send tool_choice 'none' to answer "
                       "without tools", param="tool_choice")
    return ToolUse(tools, parse=True, parallel=req.parallel_tool_calls is not False)


def _parameters(fn: dict[str, Any]) -> dict[str, Any]:
    return fn.get("parameters") or {"type": "object"}


def _calls_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A JSON array of calls to the tools: ``[{"name": ..., "parameters": {...}}, ...]``, one at least
    (one at most without parallel calls)."""
    calls = [{"type": "object", "required": ["name", "parameters"],
              "properties": {"name": {"const": t["function"]["name"]}, "parameters": _parameters(t["function"])}}
             for t in tools]
    return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": calls}}


def _check_tools(tools: list[Any]) -> list[dict[str, Any]]:
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise APIError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}, got {tool!r:.80}",
                           param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise APIError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}",
                           param="tools")
        if not isinstance(fn.get("parameters", {}), dict):
            raise APIError(f"tools[{i}].function.parameters must be a JSON Schema object", param="tools")
    return tools


FinishReason = Literal["stop", "length", "abort", "tool_calls"]
