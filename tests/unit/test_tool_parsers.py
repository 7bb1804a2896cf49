"""Tool calls parsed out of chat answers (``--tool-call-parser``): each format
whole and streamed in pieces of every size, and what is not a call staying
content as written."""

from __future__ import annotations

import json
import random

import pytest

from kiln.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolCall, parse, tool_parser

HERMES = TOOL_PARSERS["hermes"]
LLAMA = TOOL_PARSERS["llama3_json"]

QWEN_ANSWER = ('I will look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
               '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n'
               '</tool_call>')


def _streamed(cls, text: str, sizes: list[int]) -> tuple[str, list[ToolCall]]:
    """``text`` fed in pieces of the given sizes, then finished: content joined, calls in order."""
    stream, items, i = cls(), [], 0
    for n in sizes:
        items += stream.feed(text[i:i + n])
        i += n
    items += stream.feed(text[i:]) + stream.finish()
    return "".join(x for x in items if isinstance(x, str)), [x for x in items if isinstance(x, ToolCall)]


def _signature(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_blocks_become_calls_and_the_text_before_them_content() -> None:
    out = parse(HERMES(), QWEN_ANSWER)
    assert out.content == "I will look both up.\n"
    assert _signature(out.tool_calls) == [("get_weather", {"city": "Paris", "unit": "celsius"}),
                                          ("get_time", {"tz": "Europe/Paris"})]
    assert len({c.id for c in out.tool_calls}) == 2 and all(c.id.startswith("call_") for c in out.tool_calls)
    assert out.tool_calls[0].to_openai() == {"id": out.tool_calls[0].id, "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}


@pytest.mark.parametrize("seed", range(6))
def test_hermes_streamed_in_any_pieces_gives_what_the_whole_text_gives(seed: int) -> None:
    rng = random.Random(seed)
    sizes = [1] * len(QWEN_ANSWER) if seed == 0 else [rng.randint(1, 12) for _ in range(len(QWEN_ANSWER))]
    content, calls = _streamed(HERMES, QWEN_ANSWER, sizes)
    whole = parse(HERMES(), QWEN_ANSWER)
    assert content == whole.content and _signature(calls) == _signature(whole.tool_calls)


def test_hermes_holds_back_only_what_could_begin_a_call() -> None:
    stream = HERMES()
    assert stream.feed("if a <") == ["if a "]  # "<" may begin "<tool_call>"
    assert stream.feed(" b then <tool") == ["< b then "]
    assert stream.feed("box>") == ["<toolbox>"]
    assert stream.finish() == []


def test_hermes_keeps_what_is_not_a_call_as_written() -> None:
    bad = 'Try <tool_call>{"name": "f", "arguments": {oops}}</tool_call> later'
    assert parse(HERMES(), bad).content == bad and parse(HERMES(), bad).tool_calls == []
    nameless = '<tool_call>{"arguments": {}}</tool_call>'
    assert parse(HERMES(), nameless).content == nameless
    unclosed_bad = 'x <tool_call>{"name": "f", "argu'
    assert parse(HERMES(), unclosed_bad).content == unclosed_bad


def test_hermes_accepts_an_unclosed_last_call_string_arguments_and_parameters() -> None:
    out = parse(HERMES(), '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n')  # the budget ran out
    assert out.content is None and _signature(out.tool_calls) == [("f", {"x": 1})]
    out = parse(HERMES(), '<tool_call>{"name": "g", "parameters": {"y": [1, 2]}}</tool_call>')
    assert _signature(out.tool_calls) == [("g", {"y": [1, 2]})]
    out = parse(HERMES(), '<tool_call>{"name": "h"}</tool_call>')
    assert _signature(out.tool_calls) == [("h", {})]


def test_hermes_whitespace_between_calls_is_no_content_but_text_after_them_is() -> None:
    text = '<tool_call>{"name": "a"}</tool_call>\n\n<tool_call>{"name": "b"}</tool_call>\n'
    out = parse(HERMES(), text)
    assert out.content is None and [c.name for c in out.tool_calls] == ["a", "b"]
    out = parse(HERMES(), '<tool_call>{"name": "a"}</tool_call>\nDone.')
    assert out.content == "\nDone." and [c.name for c in out.tool_calls] == ["a"]


def test_an_answer_without_calls_is_all_content() -> None:
    for cls in (HERMES, LLAMA):
        out = parse(cls(), "The capital of France is Paris.")
        assert out.content == "The capital of France is Paris." and out.tool_calls == []
        assert parse(cls(), "").content == ""


def test_llama3_json_calls_separated_by_semicolons_and_after_the_python_tag() -> None:
    text = '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}'
    out = parse(LLAMA(), text)
    assert out.content is None
    assert _signature(out.tool_calls) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    out = parse(LLAMA(), '<|python_tag|>{"name": "f", "arguments": {"q": "x"}}')
    assert _signature(out.tool_calls) == [("f", {"q": "x"})]
    content, calls = _streamed(LLAMA, text, [1] * len(text))
    assert content == "" and _signature(calls) == _signature(parse(LLAMA(), text).tool_calls)


def test_llama3_json_streams_plain_text_at_once_and_keeps_json_that_is_no_call() -> None:
    stream = LLAMA()
    assert stream.feed("  ") == []  # undecided
    assert stream.feed("Paris") == ["  Paris"]
    assert stream.feed(" is") == [" is"] and stream.finish() == []
    for text in ('{"city": "Paris"}', '{"name": "f", "parameters": {}} and more', '{"name": "f", "par'):
        out = parse(LLAMA(), text)
        assert out.content == text and out.tool_calls == []


def test_an_unknown_parser_is_named_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"'xml'.*hermes, llama3_json, mistral"):
        tool_parser("xml")
    assert tool_parser("hermes") is HERMES


MISTRAL = TOOL_PARSERS["mistral"]


@pytest.mark.parametrize("text", [
    'Let me check.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "get_time", "arguments": {"tz": "CET"}}]',
    'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}',
])
def test_mistral_calls_in_both_of_its_formats(text: str) -> None:
    out = parse(MISTRAL(), text)
    assert out.content == "Let me check."
    assert _signature(out.tool_calls) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    content, calls = _streamed(MISTRAL, text, [1] * len(text))
    assert content == out.content and _signature(calls) == _signature(out.tool_calls)
    assert all(len(c.id) == 9 and c.id.isalnum() for c in out.tool_calls)  # what Mistral's templates take back


def test_mistral_keeps_what_is_not_a_call() -> None:
    for text in ("Plain [TOOL answer", "[TOOL_CALLS] not json", '[TOOL_CALLS]f[ARGS]{"x": ', "[TOOL_CALLS] [1, 2]"):
        out = parse(MISTRAL(), text)
        assert out.content == text and out.tool_calls == []
