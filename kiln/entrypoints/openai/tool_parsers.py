"""Tool calls out of a chat model's text, as OpenAI's ``tool_calls``.

A model trained for tools writes its calls as text in a format of its family;
the server turns them back into OpenAI's structured calls when a request
offers ``tools`` and the server was started with ``--tool-call-parser``
(vLLM's flag and parser names):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, anywhere in the text (Qwen2.5, Qwen3, Hermes, SmolLM's tool data);
- ``llama3_json``: the whole answer is one or more ``{"name": ...,
  "parameters": {...}}`` objects separated by ``;`` (Llama 3.1-3.3 with JSON
  tools), optionally after ``<|python_tag|>``;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name",
  "arguments"}`` (Mistral 7B v0.3, Mixtral), or ``[TOOL_CALLS]name[ARGS]{...}``
  per call (later Mistral tokenizers); text before it is content.

Both parse a stream: ``ToolCallStream.feed`` takes the text deltas as they come
and returns content to send on, holding back only what could still be the
start of a call, and each call once it is complete. A complete answer is parsed
by the same code fed at once (``parse``), so a streamed and an unstreamed
request give the same calls and content. A block that does not hold a valid
call (malformed JSON, no ``name``) stays in the content as written, so nothing
the model wrote is lost.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["TOOL_PARSERS", "ForcedCalls", "ParsedOutput", "ToolCall", "ToolCallStream", "parse", "partial_suffix",
           "tool_parser"]


_ALNUM = string.ascii_letters + string.digits


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (OpenAI sends a string)."""

    name: str
    arguments: str
    id: str = field(default_factory=_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call_from(obj: Any, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """The call an object of the model's JSON describes, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = {}
    for key in argument_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolCallStream(ABC):
    """Text deltas in; content to send and completed calls out (``str`` or
    ``ToolCall`` items, in the order the model wrote them)."""

    def __init__(self) -> None:
        self.calls = 0

    @abstractmethod
    def feed(self, text: str) -> list[str | ToolCall]:
        """What ``text`` (the next delta) completes."""

    @abstractmethod
    def finish(self) -> list[str | ToolCall]:
        """What is left at the end of the answer: text held back goes out as content."""

    def _emit(self, call: ToolCall) -> ToolCall:
        self.calls += 1
        return call


class _HermesStream(ToolCallStream):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._inside = False
        self._space = ""  # whitespace after a call, sent only when more content follows it

    def feed(self, text: str) -> list[str | ToolCall]:
        self._buf += text
        out: list[str | ToolCall] = []
        while True:
            if self._inside:
                end = self._buf.find(self.END)
                if end < 0:
                    return out
                body, self._buf, self._inside = self._buf[:end], self._buf[end + len(self.END):], False
                self._block(body, out)
                continue
            start = self._buf.find(self.START)
            if start < 0:
                keep = partial_suffix(self._buf, self.START)
                self._content(self._buf[:len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep:]
                return out
            self._content(self._buf[:start], out)
            self._buf, self._inside = self._buf[start + len(self.START):], True

    def finish(self) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        if self._inside:  # an unclosed block at the end (the budget ran out, or the model stopped there)
            self._block(self._buf, out, closed=False)
        else:
            self._content(self._buf, out)
        self._buf, self._inside = "", False
        return out

    def _block(self, body: str, out: list[str | ToolCall], closed: bool = True) -> None:
        try:
            call = _call_from(json.loads(body), ("arguments", "parameters"))
        except json.JSONDecodeError:
            call = None
        if call is None:
            self._content(self.START + body + (self.END if closed else ""), out)
        else:
            self._space = ""
            out.append(self._emit(call))

    def _content(self, text: str, out: list[str | ToolCall]) -> None:
        if self.calls and not (self._space + text).strip():
            self._space += text
            return
        text, self._space = self._space + text, ""
        if text:
            out.append(text)


class _Llama3JsonStream(ToolCallStream):
    """An answer that starts with ``{`` (or ``<|python_tag|>``) is held whole and
    parsed at its end; any other answer is content as it comes."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._mode: str | None = None  # None: undecided, "json": held, "text": passed on

    def feed(self, text: str) -> list[str | ToolCall]:
        if self._mode == "text":
            return [text] if text else []
        self._buf += text
        head = self._buf.lstrip()
        if not head or (self.TAG.startswith(head) and len(head) < len(self.TAG)):
            return []
        self._mode = "json" if head.startswith(("{", self.TAG)) else "text"
        if self._mode == "json":
            return []
        out, self._buf = self._buf, ""
        return [out]

    def finish(self) -> list[str | ToolCall]:
        text, self._buf = self._buf, ""
        if not text:
            return []
        calls = self._calls(text.strip().removeprefix(self.TAG)) if self._mode != "text" else None
        return [self._emit(c) for c in calls] if calls else [text]

    @staticmethod
    def _calls(text: str) -> list[ToolCall] | None:
        decoder, calls, i = json.JSONDecoder(), [], 0
        while True:
            while i < len(text) and (text[i].isspace() or text[i] == ";"):
                i += 1
            if i == len(text):
                return calls or None
            try:
                obj, i = decoder.raw_decode(text, i)
            except json.JSONDecodeError:
                return None
            call = _call_from(obj, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)


class ForcedCalls(ToolCallStream):
    """The answer to a forced call (``tool_choice`` ``required`` or a named
    function), decoded under the calls' JSON Schema: held whole, then read as
    a JSON array of ``{"name", "parameters"}`` calls, or as the named
    function's arguments. An answer that does not read so (the budget ran
    out) is content."""

    def __init__(self, named: str | None = None) -> None:
        super().__init__()
        self.named = named
        self._buf = ""

    def feed(self, text: str) -> list[str | ToolCall]:
        self._buf += text
        return []

    def finish(self) -> list[str | ToolCall]:
        text, self._buf = self._buf, ""
        if not text.strip():
            return [text] if text else []
        if self.named is not None:
            return [self._emit(ToolCall(self.named, text.strip()))]
        try:
            calls = [_call_from(c, ("parameters", "arguments")) for c in json.loads(text)]
        except (json.JSONDecodeError, TypeError):
            return [text]
        if not calls or any(c is None for c in calls):
            return [text]
        return [self._emit(c) for c in calls if c is not None]


class _MistralStream(ToolCallStream):
    """Content until ``[TOOL_CALLS]``; everything after it is held and read at the end."""

    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._calling = False

    def feed(self, text: str) -> list[str | ToolCall]:
        self._buf += text
        if self._calling:
            return []
        start = self._buf.find(self.TAG)
        if start >= 0:
            out, self._buf, self._calling = self._buf[:start], self._buf[start + len(self.TAG):], True
        else:
            keep = partial_suffix(self._buf, self.TAG)
            out, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        return [out] if out else []

    def finish(self) -> list[str | ToolCall]:
        text, self._buf = self._buf, ""
        if not self._calling:
            return [text] if text else []
        calls = self._calls(text)
        return [self._emit(c) for c in calls] if calls else [self.TAG + text]

    def _calls(self, text: str) -> list[ToolCall] | None:
        if text.lstrip().startswith("["):  # a JSON array of calls
            try:
                found = [_call_from(c, ("arguments", "parameters")) for c in json.loads(text)]
            except (json.JSONDecodeError, TypeError):
                return None
        else:  # name[ARGS]{...}, each call after its own [TOOL_CALLS]
            found = []
            for part in text.split(self.TAG):
                name, sep, args = part.partition(self.ARGS)
                try:
                    found.append(_call_from({"name": name.strip(), "arguments": json.loads(args)}, ("arguments",))
                                 if sep else None)
                except json.JSONDecodeError:
                    return None
        if not found or any(c is None for c in found):
            return None
        # Mistral's templates take back only ids of 9 letters and digits
        return [replace(c, id="".join(secrets.choice(_ALNUM) for _ in range(9))) for c in found]  # type: ignore[arg-type]


def partial_suffix(text: str, marker: str) -> int:  # also the reasoning parsers' hold-back
    """The length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


TOOL_PARSERS: dict[str, type[ToolCallStream]] = {"hermes": _HermesStream, "llama3_json": _Llama3JsonStream,
                                                 "mistral": _MistralStream}


def tool_parser(name: str) -> type[ToolCallStream]:
    """The stream class of parser ``name``; ValueError naming the choices."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; kiln has {', '.join(TOOL_PARSERS)}") from None


@dataclass(frozen=True)
class ParsedOutput:
    """A whole answer split into its content (None when only calls and
    whitespace were written) and its calls."""

    content: str | None
    tool_calls: list[ToolCall]


def parse(stream: ToolCallStream, text: str) -> ParsedOutput:
    """``text`` fed to ``stream`` at once."""
    items = stream.feed(text) + stream.finish()
    calls = [i for i in items if isinstance(i, ToolCall)]
    content = "".join(i for i in items if isinstance(i, str))
    return ParsedOutput(content if content.strip() or not calls else None, calls)
