"""The output processor: text per request, stop strings, and per-request
collectors that any number of interleaved or paused consumers read without
losing each other's output."""

from __future__ import annotations

import random

from kiln.engine.output_processor import OutputProcessor
from kiln.engine.outputs import EngineOutput, EngineOutputs
from kiln.engine.request import SamplingParams


class LetterTokenizer:
    """Token i is the letter chr(97 + i % 26), or a space for ids divisible by 5."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(" " if i % 5 == 0 else chr(97 + i % 26) for i in ids)


def test_interleaved_and_paused_consumers_each_get_all_of_their_own_output() -> None:
    tok = LetterTokenizer()
    processor = OutputProcessor(tok)
    streams = {rid: [random.Random(rid).randrange(1, 200) for _ in range(20)] for rid in range(3)}
    for rid in streams:
        processor.add_request(rid, None, [1, 2], SamplingParams())
    order = [rid for _ in range(20) for rid in streams]
    random.Random(0).shuffle(order)
    got: dict[int, list] = {rid: [] for rid in streams}
    sent = {rid: 0 for rid in streams}
    for step, rid in enumerate(order):
        token = streams[rid][sent[rid]]
        sent[rid] += 1
        finish = "length" if sent[rid] == len(streams[rid]) else None
        processor.process(EngineOutputs([EngineOutput(rid, [token], finish)]))
        # consumer 0 reads after every step, consumer 1 every third step, consumer 2 only at the end
        for reader, every in ((0, 1), (1, 3)):
            if step % every == 0 and (delta := processor.take(reader)) is not None:
                got[reader].append(delta)
    for rid in streams:
        while (delta := processor.take(rid)) is not None:
            got[rid].append(delta)
    for rid, deltas in got.items():
        assert sum((d.token_ids for d in deltas), []) == streams[rid]
        assert "".join(d.text for d in deltas) == tok.decode(streams[rid])
        assert deltas[-1].finish_reason == "length"
        assert all(d.finish_reason is None for d in deltas[:-1])
        assert processor.take(rid) is None  # nothing is handed out twice
        assert processor.get_output(rid).text == tok.decode(streams[rid])


def test_stop_string_finishes_the_request_and_never_leaks() -> None:
    tok = LetterTokenizer()
    processor = OutputProcessor(tok)
    processor.add_request("a", None, [1], SamplingParams(stop=["cd"]))
    ids = [1, 2, 3, 4, 6, 7]  # "bcde" then more
    texts, aborted = [], []
    for t in ids[:4]:
        out = processor.process(EngineOutputs([EngineOutput("a", [t])]))
        texts += [d.text for d in out.deltas]
        aborted += out.to_abort
    assert aborted == ["a"]  # the engine must stop it
    assert "".join(texts) == "b" and processor.get_output("a").text == "b"
    assert processor.get_output("a").finish_reason == "stop"
    # an output the engine produced before the abort took effect is ignored
    assert processor.process(EngineOutputs([EngineOutput("a", [6])])).deltas == []
    delta = processor.take("a")
    assert delta.text == "b" and delta.token_ids == [1, 2, 3] and delta.finish_reason == "stop"


def test_abort_is_the_last_delta() -> None:
    processor = OutputProcessor(LetterTokenizer())
    processor.add_request(7, None, [1], SamplingParams())
    processor.process(EngineOutputs([EngineOutput(7, [2])]))
    assert processor.finish(7, "abort").finish_reason == "abort"
    assert processor.finish(7, "abort") is None
    delta = processor.take(7)
    assert delta.token_ids == [2] and delta.finish_reason == "abort"
