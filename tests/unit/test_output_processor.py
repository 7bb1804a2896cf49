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


def test_stop_strings_wait_for_min_tokens() -> None:
    """Before ``min_tokens`` tokens a stop string does not finish the request;
    after, one that ends in the new text does, one wholly before it does not."""
    tok = LetterTokenizer()
    processor = OutputProcessor(tok)
    processor.add_request("a", None, [1], SamplingParams(stop=["cd", "x"], min_tokens=4))
    ids = [2, 3, 4, 6, 7, 8, 23]  # "cde" (a stop string by the 2nd token), "ghi", then "x"
    finished_at = None
    for n, t in enumerate(ids, 1):
        if processor.process(EngineOutputs([EngineOutput("a", [t])])).to_abort:
            finished_at = n
            break
    assert finished_at == 7 and processor.get_output("a").text == "cdeghi"


def test_abort_is_the_last_delta() -> None:
    processor = OutputProcessor(LetterTokenizer())
    processor.add_request(7, None, [1], SamplingParams())
    processor.process(EngineOutputs([EngineOutput(7, [2])]))
    assert processor.finish(7, "abort").finish_reason == "abort"
    assert processor.finish(7, "abort") is None
    delta = processor.take(7)
    assert delta.token_ids == [2] and delta.finish_reason == "abort"


def _fast_tokenizer(clean_up: bool):  # noqa: ANN202
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["Hello world, héllo wörld! It's fine ... isn't it?"] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", clean_up_tokenization_spaces=clean_up)


def test_a_fast_tokenizer_is_decoded_on_its_backend_with_the_wrappers_text() -> None:
    """Where transformers' decode would only pass the ids on, the detokenizer
    calls the Rust tokenizer behind it; the text, special tokens skipped and
    split UTF-8 sequences held back included, is what the wrapper gives. With
    the clean-up of spaces on, or a tokenizer of another kind, the wrapper
    decodes."""
    from kiln.engine.detokenizer import IncrementalDetokenizer, _decoder

    tok = _fast_tokenizer(clean_up=False)
    ids = tok.encode("Hello wörld! It's fine ... isn't it?") + [tok.eos_token_id] + tok.encode(" héllo")
    direct = _decoder(tok)
    assert direct.__name__ == "direct"
    for end in range(len(ids) + 1):
        assert direct(ids[:end]) == tok.decode(ids[:end], skip_special_tokens=True)
    detok = IncrementalDetokenizer(tok, ids[:2], [])
    for t in ids[2:]:
        detok.add([t])
    assert detok.take(finished=True) == tok.decode(ids[2:], skip_special_tokens=True)
    assert _decoder(_fast_tokenizer(clean_up=True)).__name__ == "wrapped"
    letters = LetterTokenizer()
    assert _decoder(letters).__name__ == "wrapped" and _decoder(letters)([1, 5, 2]) == letters.decode([1, 5, 2])


def test_include_stop_str_in_output_and_special_tokens_in_the_text() -> None:
    """vLLM's two output options: the stop string found ends the text instead
    of being cut, and special tokens are written out when asked."""
    from kiln.engine.detokenizer import IncrementalDetokenizer

    processor = OutputProcessor(LetterTokenizer())
    processor.add_request("a", None, [1], SamplingParams(stop=["cd"], include_stop_str_in_output=True))
    for t in [1, 2, 3, 4, 6]:  # "bcde", then "g" the engine made before the abort
        processor.process(EngineOutputs([EngineOutput("a", [t])]))
    out = processor.get_output("a")
    assert out.text == "bcd" and out.finish_reason == "stop"
    tok = _fast_tokenizer(clean_up=False)
    ids = tok.encode("Hello world") + [tok.eos_token_id] + tok.encode(" it")
    for skip, text in ((True, "Hello world it"), (False, "Hello world<eos> it")):
        detok = IncrementalDetokenizer(tok, ids[:1], [], skip_special_tokens=skip)
        for t in ids[1:]:
            detok.add([t])
        assert tok.decode(ids[:1]) + detok.take(finished=True) == text


def test_the_token_that_stops_a_request_is_not_in_its_text() -> None:
    """EOS or a stop token id ends the text: with skip_special_tokens=False
    (the server's default when it parses tool calls) a chat model's
    <|im_end|> would otherwise close every answer's text."""
    tok = LetterTokenizer()
    for params, text in ((SamplingParams(skip_special_tokens=False), "cd"),
                         (SamplingParams(stop_token_ids=[4]), "cd"),
                         (SamplingParams(include_stop_str_in_output=True), "cde")):
        processor = OutputProcessor(tok)
        processor.add_request("a", None, [1], params)
        processor.process(EngineOutputs([EngineOutput("a", [2])]))
        out = processor.process(EngineOutputs([EngineOutput("a", [3, 4], "stop")]))
        assert processor.get_output("a").text == text and processor.get_output("a").token_ids == [2, 3, 4]
        assert out.deltas[-1].token_ids == [3, 4] and out.deltas[-1].finish_reason == "stop"
    processor = OutputProcessor(tok)
    processor.add_request("b", None, [1], SamplingParams())
    processor.process(EngineOutputs([EngineOutput("b", [2, 3], "length")]))
    assert processor.get_output("b").text == "cd"  # a length stop keeps its last token
