"""A reasoning model's thinking, split from its answer (vLLM's ``reasoning_content``).

Qwen3 and DeepSeek-R1 write their reasoning between ``<think>`` and
``</think>``, then the answer. With ``--reasoning-parser`` (vLLM's flag and
names) the server sends the reasoning as the message's ``reasoning_content``
(``delta.reasoning_content`` when streaming) and only the answer as
``content``, where tool calls are then looked for:

- ``qwen3``: reasoning only where the answer opens with ``<think>`` (Qwen3
  with thinking off, ``chat_template_kwargs: {"enable_thinking": false}``,
  answers directly: all content);
- ``deepseek_r1``: the template opens ``<think>`` in the prompt, so the answer
  starts inside the reasoning (an opening tag written again is dropped).

An answer cut off before ``</think>`` is all reasoning. The whitespace between
``</think>`` and the answer is dropped. Tags split across deltas are held back
until they are known, as the tool call parsers do.
"""

from __future__ import annotations

from kiln.entrypoints.openai.tool_parsers import partial_suffix

__all__ = ["REASONING_PARSERS", "ReasoningStream", "reasoning_stream", "split_reasoning"]

REASONING, CONTENT = "reasoning", "content"


class ReasoningStream:
    """Text deltas in; ``(REASONING | CONTENT, text)`` pieces out, in order."""

    START, END = "<think>", "</think>"

    def __init__(self, starts_inside: bool) -> None:
        self._state = "inside" if starts_inside else "start"  # start -> inside -> after -> answer
        self._buf = ""
        self._opened = starts_inside  # a leading <think> may still be dropped
        self.thought = starts_inside  # the answer has a reasoning part

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        out: list[tuple[str, str]] = []
        while self._buf:
            if self._state == "start":
                head = self._buf.lstrip()
                if self.START.startswith(head):  # perhaps the tag, not yet whole
                    return out
                if head.startswith(self.START):
                    self._buf, self._state, self.thought = head[len(self.START):], "inside", True
                else:
                    self._state = "answer"
            elif self._state == "inside":
                if self._opened and self.START.startswith(self._buf.lstrip()):
                    return out  # deepseek_r1 may write the opening tag again
                if self._opened and self._buf.lstrip().startswith(self.START):
                    self._buf = self._buf.lstrip()[len(self.START):]
                self._opened = False
                end = self._buf.find(self.END)
                if end < 0:
                    keep = partial_suffix(self._buf, self.END)
                    _add(out, REASONING, self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                _add(out, REASONING, self._buf[:end])
                self._buf, self._state = self._buf[end + len(self.END):], "after"
            elif self._state == "after":
                self._buf = self._buf.lstrip()
                if self._buf:
                    self._state = "answer"
            else:
                _add(out, CONTENT, self._buf)
                self._buf = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        """What is held back at the end: a partial tag is text of where it stood."""
        text, self._buf = self._buf, ""
        if self._state == "inside":
            return [(REASONING, text)] if text else []
        return [(CONTENT, text)] if text and self._state != "after" else []


def _add(out: list[tuple[str, str]], kind: str, text: str) -> None:
    if text:
        out.append((kind, text))


REASONING_PARSERS: dict[str, bool] = {"qwen3": False, "deepseek_r1": True}  # name -> the answer starts inside


def reasoning_stream(name: str) -> ReasoningStream:
    """A fresh stream of parser ``name``; ValueError naming the choices."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; kiln has {', '.join(REASONING_PARSERS)}")
    return ReasoningStream(REASONING_PARSERS[name])


def split_reasoning(stream: ReasoningStream, text: str) -> tuple[str | None, str]:
    """A whole answer as (reasoning, or None where there was none; content)."""
    pieces = stream.feed(text) + stream.finish()
    reasoning = "".join(t for k, t in pieces if k == REASONING)
    return reasoning if stream.thought else None, "".join(t for k, t in pieces if k == CONTENT)
