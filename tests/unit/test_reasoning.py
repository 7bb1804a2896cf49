"""Reasoning split from the answer (``--reasoning-parser``): whole and
streamed in pieces of every size, cut off, absent, and the tags held back."""

from __future__ import annotations

import random

import pytest

from kiln.entrypoints.openai.reasoning import CONTENT, REASONING, reasoning_stream, split_reasoning

QWEN3 = "<think>\nThe user asks for a capital.\n</think>\n\nThe capital of France is Paris."


def _streamed(name: str, text: str, rng: random.Random) -> tuple[str, str]:
    stream, pieces, i = reasoning_stream(name), [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        pieces += stream.feed(text[i:i + n])
        i += n
    pieces += stream.finish()
    return "".join(t for k, t in pieces if k == REASONING), "".join(t for k, t in pieces if k == CONTENT)


def test_qwen3_reasoning_and_answer_are_split() -> None:
    assert split_reasoning(reasoning_stream("qwen3"), QWEN3) == ("\nThe user asks for a capital.\n",
                                                                 "The capital of France is Paris.")
    # thinking off (enable_thinking=false): the answer has no tags, and no reasoning
    assert split_reasoning(reasoning_stream("qwen3"), "Paris.") == (None, "Paris.")
    assert split_reasoning(reasoning_stream("qwen3"), "") == (None, "")
    assert split_reasoning(reasoning_stream("qwen3"), "<thi") == (None, "<thi")  # not a tag after all
    assert split_reasoning(reasoning_stream("qwen3"), "<think>\nstill thinking") == ("\nstill thinking", "")


def test_deepseek_r1_starts_inside_the_reasoning() -> None:
    assert split_reasoning(reasoning_stream("deepseek_r1"), "Hmm.\n</think>\n\nParis.") == ("Hmm.\n", "Paris.")
    assert split_reasoning(reasoning_stream("deepseek_r1"), "<think>Hmm.</think>Paris.") == ("Hmm.", "Paris.")
    assert split_reasoning(reasoning_stream("deepseek_r1"), "cut off") == ("cut off", "")


@pytest.mark.parametrize("seed", range(5))
def test_streamed_in_any_pieces_gives_what_the_whole_text_gives(seed: int) -> None:
    rng = random.Random(seed)
    for name, text in (("qwen3", QWEN3), ("qwen3", "No tags < here </think>"),
                       ("deepseek_r1", "a </thin b</think>  \n c")):
        reasoning, content = split_reasoning(reasoning_stream(name), text)
        assert _streamed(name, text, rng) == (reasoning or "", content)


def test_a_tag_split_across_deltas_is_held_back() -> None:
    stream = reasoning_stream("qwen3")
    assert stream.feed("<th") == [] and stream.feed("ink>ab</th") == [(REASONING, "ab")]
    assert stream.feed("ink>\n") == [] and stream.feed("\nAnswer") == [(CONTENT, "Answer")]


def test_an_unknown_parser_is_named_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"'o1'.*qwen3, deepseek_r1"):
        reasoning_stream("o1")
