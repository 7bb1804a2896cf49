"""What a token stands for in text: each token's bytes for constraints that
read text as bytes (``vocab_bytes``), and the text logprobs name a token by
(``token_texts_after``), on a byte-level and a SentencePiece vocabulary built
in-test (milliseconds, no download)."""

from __future__ import annotations


def _sentencepiece_tokenizer():
    """A Llama 2-style vocabulary: U+2581 for spaces, byte-fallback pieces, a leading space the decoder strips."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)],
              "\u2581{", '"', "a", "\u2581a", ":", "\u25811", "}", "\u2581\"", "\u2581", "é", "{", "1"]
    merges = [("\u2581", "{"), ("\u2581", "a"), ("\u2581", "1"), ("\u2581", '"')]
    bpe = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=merges, byte_fallback=True,
                               unk_token="<unk>"))
    bpe.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    bpe.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _byte_level_tokenizer():
    """A GPT-2-style vocabulary, trained in milliseconds on a few JSON lines."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(['{"città": [1, 2.5], "name": "x"}', '{"emoji": "😀", "città": "Roma"}\n'] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|end|>")


def test_vocab_bytes_of_byte_level_and_sentencepiece_vocabularies() -> None:
    from kiln.engine.detokenizer import vocab_bytes

    byte_level = _byte_level_tokenizer()
    table = vocab_bytes(byte_level, len(byte_level) + 3)
    text = '{"città": [1, 2.5], "emoji": "😀"}\n'
    ids = byte_level.encode(text, add_special_tokens=False)
    assert len(ids) < len(text.encode("utf-8"))  # pieces of several bytes
    assert b"".join(table[i] for i in ids) == text.encode("utf-8")
    assert table[byte_level.eos_token_id] is None and table[-3:] == [None] * 3  # special, and past the tokenizer
    spm = _sentencepiece_tokenizer()
    table = vocab_bytes(spm, len(spm))
    ids = spm.encode('{"a": 1}\n', add_special_tokens=False)
    assert b"".join(table[i] for i in ids) == b' {"a": 1}\n'  # the leading space the model sees, a byte piece
    assert spm.decode(ids) == '{"a": 1}\n'
    assert table[spm.convert_tokens_to_ids("<0xC3>")] == b"\xc3" and table[spm.eos_token_id] is None


def test_logprob_tokens_keep_their_leading_space_in_context() -> None:
    """Logprobs name a token by the text it adds after the tokens before it: a
    SentencePiece word start decoded alone would lose its space, and a
    completion's tokens would no longer add up to its text."""
    from kiln.engine.detokenizer import token_texts_after
    from kiln.entrypoints.openai.logprobs import LogprobFormatter

    spm = _sentencepiece_tokenizer()
    ids = spm.encode('{"a": 1}', add_special_tokens=False)
    assert spm.decode([ids[-2]]) == "1"  # "\u25811" alone
    contexts = LogprobFormatter.contexts([], ids)
    texts = [token_texts_after(spm, ctx, [t])[0] for ctx, t in zip(contexts, ids)]
    assert texts[-2] == " 1" and "".join(texts) == spm.decode(ids)
    assert LogprobFormatter.contexts([7, 8], [1, 2]) == [[7, 8], [7, 8, 1]]
    byte_level = _byte_level_tokenizer()
    ids = byte_level.encode("😀 ok", add_special_tokens=False)
    contexts = LogprobFormatter.contexts([], ids)
    assert [token_texts_after(byte_level, ctx, [t])[0] for ctx, t in zip(contexts, ids)][-1] == (
        byte_level.decode(ids[-1:]))
    # a position's token and its alternatives share the context: " 1" and "}" after the same tokens
    ids = spm.encode('{"a": 1}', add_special_tokens=False)
    assert token_texts_after(spm, ids[:-2], [ids[-2], ids[-1]]) == [" 1", "}"]
