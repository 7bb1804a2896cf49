"""Speculative decoding by prompt lookup through the whole engine: a greedy
request's tokens are the ones plain decoding gives, in one step or in chunks
under preemption, beside requests that sample, and the drafts are used."""

from __future__ import annotations

import pytest

from kiln import SamplingParams
from tests.conftest import load_eager, random_prompts

SPEC = {"num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def _prompts(vocab: int) -> list[list[int]]:
    """Random prompts, some repeating a phrase (which a lookup finds at once)."""
    phrases = random_prompts(3, [6, 9, 5], vocab, seed=7)
    return [phrases[0] * 3, phrases[1] * 2 + phrases[1][:4], phrases[2], *random_prompts(2, [11, 17], vocab, seed=8)]


def test_greedy_tokens_equal_plain_decoding_and_drafts_are_kept(llama_checkpoint) -> None:
    path, model = llama_checkpoint
    prompts = _prompts(model.config.vocab_size)
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = [o.token_ids for o in load_eager(path).generate(prompts, greedy)]
    for kwargs in ({}, {"max_num_batched_tokens": 8, "num_kv_blocks": 20, "block_size": 4}):
        rt = load_eager(path, speculative_config=SPEC, **kwargs)
        assert [o.token_ids for o in rt.generate(prompts, greedy)] == plain
        stats = rt.stats()
        assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    # one at a time, each request's steps are fewer than its tokens
    rt = load_eager(path, speculative_config=SPEC)
    before = rt.stats().steps
    out = rt.generate(prompts[0], greedy)[0]
    assert out.token_ids == plain[0] and rt.stats().steps - before < len(out.token_ids)


def test_requests_that_sample_beside_speculating_ones_keep_their_tokens(llama_checkpoint) -> None:
    path, model = llama_checkpoint
    prompts = _prompts(model.config.vocab_size)
    seeded = SamplingParams(max_tokens=20, temperature=0.9, top_k=40, seed=5, ignore_eos=True)
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    logprobs = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2)
    params = [greedy, seeded, logprobs, greedy, seeded]
    expected = load_eager(path).generate(prompts, params)
    got = load_eager(path, speculative_config=SPEC).generate(prompts, params)
    for e, g in zip(expected, got):
        assert g.token_ids == e.token_ids
    for g, e in zip(got[2].logprobs, expected[2].logprobs):  # the batch's shapes differ: values to rounding
        assert [t for t, _ in g.top] == [t for t, _ in e.top]
        assert [v for _, v in g.top] == pytest.approx([v for _, v in e.top], abs=1e-4)
