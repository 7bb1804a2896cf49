"""Sampling and stop conditions."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch

from kiln import Runtime, SamplingParams
from tests.conftest import load_eager
from tests.conftest import random_prompts


def test_seeded_sampling_is_independent_of_the_batch(llama_checkpoint) -> None:
    path, model = llama_checkpoint
    prompts = random_prompts(4, [6, 13, 21, 9], model.config.vocab_size, seed=11)
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_k=50, top_p=0.95, seed=1234, ignore_eos=True)
    rt = load_eager(path)
    alone = rt.generate(prompts[0], seeded)[0].token_ids
    assert rt.generate(prompts[0], seeded)[0].token_ids == alone  # reproducible
    others = [
        SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.7, seed=99, ignore_eos=True),
    ]
    batch = rt.generate([prompts[1], prompts[0], prompts[2], prompts[3]], [others[0], seeded, others[1], others[2]])
    assert batch[1].token_ids == alone
    # and under a budget that chunks and preempts
    tight = load_eager(path, max_num_batched_tokens=8, num_kv_blocks=12, block_size=4)
    batch = tight.generate([prompts[1], prompts[2], prompts[0]], [others[0], others[1], seeded])
    assert batch[2].token_ids == alone
    different_seed = SamplingParams(**{**seeded.__dict__, "seed": 4321})
    assert rt.generate(prompts[0], different_seed)[0].token_ids != alone


def _greedy(rt: Runtime, prompt: list[int], n: int) -> list[int]:
    return rt.generate(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].token_ids


def test_stop_on_eos_and_stop_token_ids(llama_checkpoint, tmp_path) -> None:
    path, model = llama_checkpoint
    rt = load_eager(path)
    prompt = random_prompts(1, [8], model.config.vocab_size, seed=21)[0]
    free = _greedy(rt, prompt, 10)
    target = free[4]
    cut = free.index(target) + 1
    out = rt.generate(prompt, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[target]))[0]
    assert out.token_ids == free[:cut] and out.finish_reason == "stop"
    # the checkpoint's generation config declares the EOS token
    declared = tmp_path / "ckpt"
    shutil.copytree(path, declared)
    (declared / "generation_config.json").write_text(json.dumps({"eos_token_id": [target]}))
    rt = load_eager(declared)
    assert rt.config.eos_token_ids == (target,)
    out = rt.generate(prompt, SamplingParams(max_tokens=10, temperature=0))[0]
    assert out.token_ids == free[:cut] and out.finish_reason == "stop"
    out = rt.generate(prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == free and out.finish_reason == "length"


def test_min_tokens_holds_off_eos_and_stop_token_ids(llama_checkpoint, tmp_path) -> None:
    path, model = llama_checkpoint
    prompt = random_prompts(1, [8], model.config.vocab_size, seed=21)[0]
    free = _greedy(load_eager(path), prompt, 10)
    target = free[1]
    declared = tmp_path / "ckpt"
    shutil.copytree(path, declared)
    (declared / "generation_config.json").write_text(json.dumps({"eos_token_id": [target]}))
    for rt, stop in ((load_eager(path), [target]), (load_eager(declared), None)):
        plain = rt.generate(prompt, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=stop))[0]
        assert plain.token_ids == free[:2] and plain.finish_reason == "stop"
        held = rt.generate(prompt, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=stop, min_tokens=4))[0]
        assert len(held.token_ids) >= 4 and target not in held.token_ids[:4]
        assert held.token_ids[0] == free[0]
        assert held.finish_reason == ("stop" if held.token_ids[-1] == target else "length")
    with pytest.raises(ValueError, match=r"params\[0\]\.min_tokens must be an integer in \[0, max_tokens=3\]"):
        load_eager(path).generate(prompt, SamplingParams(max_tokens=3, min_tokens=5))


def test_stop_on_max_model_len(llama_checkpoint) -> None:
    path, model = llama_checkpoint
    rt = load_eager(path, max_model_len=20)
    prompt = random_prompts(1, [15], model.config.vocab_size, seed=22)[0]
    out = rt.generate(prompt, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_stop_strings_cut_text_and_stream_never_leaks_them(demo_tokenizer_dir) -> None:
    rt = load_eager(demo_tokenizer_dir)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    free = rt.generate("The quick brown fox", params)[0]
    assert len(free.text) > 12
    stop = free.text[8:11]
    stopped = rt.generate("The quick brown fox", SamplingParams(**{**params.__dict__, "stop": [stop]}))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index(stop)]
    assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)]
    assert len(stopped.token_ids) < len(free.token_ids)
    deltas = list(rt.stream("The quick brown fox", SamplingParams(**{**params.__dict__, "stop": stop})))
    assert "".join(d.text for d in deltas) == stopped.text
    assert deltas[-1].finish_reason == "stop"
    assert sum((d.token_ids for d in deltas), []) == stopped.token_ids


def test_stream_deltas_add_up_to_generate(demo_tokenizer_dir) -> None:
    rt = load_eager(demo_tokenizer_dir)
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=5)
    full = rt.generate("Hello world", params)[0]
    deltas = list(rt.stream("Hello world", params))
    assert "".join(d.text for d in deltas) == full.text
    assert sum((d.token_ids for d in deltas), []) == full.token_ids
    assert deltas[-1].finish_reason == full.finish_reason
    assert all(d.finish_reason is None for d in deltas[:-1])


def _penalized_reference(model, prompt: list[int], n: int, rep: float, freq: float, pres: float) -> list[int]:
    """Greedy tokens of the transformers model with the penalties applied to
    its logits by hand (vLLM's order: repetition over prompt and output, then
    frequency and presence over the output)."""
    tokens = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([tokens])).logits[0, -1].double()
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).double()
            seen = counts > 0
            seen[torch.tensor(prompt)] = True
            logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
            logits = logits - freq * counts - pres * (counts > 0).double()
            out.append(int(logits.argmax()))
            tokens.append(out[-1])
    return out


def test_penalties_and_logit_bias_steer_greedy_tokens(llama_checkpoint) -> None:
    """The engine hands each sampling row its prompt and output so far, also
    when the prompt is prefilled in chunks and requests are preempted."""
    path, model = llama_checkpoint
    prompts = random_prompts(3, [9, 14, 6], model.config.vocab_size, seed=1)
    penalized = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.8,
                               frequency_penalty=0.9, presence_penalty=0.6)
    expected = [_penalized_reference(model, p, 12, 1.8, 0.9, 0.6) for p in prompts]
    free = [_greedy(load_eager(path), p, 12) for p in prompts]
    assert all(e != f for e, f in zip(expected, free))  # the penalties change every request's tokens
    for rt in (load_eager(path), load_eager(path, max_num_batched_tokens=8, num_kv_blocks=12, block_size=4)):
        plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        outs = rt.generate(prompts + [prompts[0]], [penalized] * 3 + [plain])
        assert [o.token_ids for o in outs[:3]] == expected
        assert outs[3].token_ids == free[0]  # a greedy row beside them is left alone
    biased = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={17: 100.0})
    assert load_eager(path).generate(prompts[1], biased)[0].token_ids == [17] * 6
    vocab = model.config.vocab_size
    with pytest.raises(ValueError, match=rf"params\[0\]\.logit_bias: token id {vocab} is outside the vocabulary"):
        load_eager(path).generate(prompts[1], SamplingParams(logit_bias={vocab: 1.0}))


def test_token_bytes_join_into_the_characters_tokens_split(demo_tokenizer_dir) -> None:
    """A byte-level token that is part of a UTF-8 character decodes alone to
    U+FFFD; ``token_bytes`` gives its own bytes (OpenAI's logprobs ``bytes``),
    so a character's tokens join into it. SentencePiece's byte-fallback
    pieces (``<0xF0>``) give their byte."""
    from kiln.engine.detokenizer import token_bytes

    tok = load_eager(demo_tokenizer_dir).tokenizer
    for text in ("😀😀 你好", "－－ café", "plain words"):
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(token_bytes(tok, i) for i in ids) == text.encode("utf-8")
    assert any("\ufffd" in tok.decode([i]) for i in tok.encode("😀", add_special_tokens=False))

    class PieceTokenizer:  # a SentencePiece vocabulary with byte fallback, as Llama 2's and Mistral's
        pieces = ["<0xF0>", "<0x9F>", "\u2581caf\u00e9"]

        def decode(self, ids: list[int]) -> str:
            return "\ufffd" if ids[0] < 2 else " café"

        def convert_ids_to_tokens(self, token_id: int) -> str:
            return self.pieces[token_id]

    assert [token_bytes(PieceTokenizer(), i) for i in range(3)] == [b"\xf0", b"\x9f", " café".encode()]


def test_prompt_logprobs_equal_transformers_over_chunks_preemption_and_the_prefix_cache(llama_checkpoint) -> None:
    """Each prompt token's logprob given the tokens before it, its rank and the
    most likely tokens there, as transformers' log-softmax of the same logits
    gives them: in one step, in chunks of 8 tokens with preemptions, and with a
    prefix cache that holds the prompt (a request for prompt logprobs computes
    it anyway)."""
    path, model = llama_checkpoint
    prompts = random_prompts(3, [9, 17, 30], model.config.vocab_size, seed=3)

    def reference(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)

    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2, ignore_eos=True)
    for kwargs in ({}, {"max_num_batched_tokens": 8, "num_kv_blocks": 12, "block_size": 4},
                   {"enable_prefix_caching": True}):
        rt = load_eager(path, **kwargs)
        for _ in range(2):  # the second round finds the prompts in the prefix cache
            for out, prompt in zip(rt.generate(prompts, params), prompts):
                ref = reference(prompt)
                assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
                for i, lp in enumerate(out.prompt_logprobs[1:]):
                    row, target = ref[i], prompt[i + 1]
                    assert lp.logprob == pytest.approx(row[target].item(), abs=1e-5)
                    assert lp.rank == int((row > row[target]).sum()) + 1
                    assert [t for t, _ in lp.top] == row.topk(2).indices.tolist()
                assert out.token_ids == rt.generate(prompt, replace(params, prompt_logprobs=None))[0].token_ids
    assert rt.generate(prompts[0][:1], params)[0].prompt_logprobs == [None]  # nothing predicts a first token
