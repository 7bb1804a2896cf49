"""Automatic prefix caching end to end: the same greedy (and seeded) tokens with
caching on and off, while blocks are shared, evicted and requests preempted."""

from __future__ import annotations

import pytest

from kiln import Runtime, SamplingParams
from tests.conftest import random_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=0.9, top_k=40, seed=11, ignore_eos=True)


@pytest.fixture(scope="module")
def workload(llama_checkpoint):
    _, model = llama_checkpoint
    vocab = model.config.vocab_size
    shared = random_prompts(1, [37], vocab, seed=40)[0]
    suffixes = random_prompts(5, [3, 6, 2, 9, 5], vocab, seed=41)
    return [shared + s for s in suffixes]


def _load(path, caching: bool, **kwargs) -> Runtime:
    kwargs.setdefault("optimization_level", 0)
    kwargs.setdefault("block_size", 4)
    return Runtime.load(path, enable_prefix_caching=caching, **kwargs)


def _pair(path, prompts, params, **kwargs) -> tuple[list, list, Runtime]:
    on, off = _load(path, True, **kwargs), _load(path, False, **kwargs)
    got_on = [o.token_ids for o in on.generate(prompts, params)]
    got_off = [o.token_ids for o in off.generate(prompts, params)]
    return got_on, got_off, on


@pytest.mark.parametrize("level", [0, 2])
def test_shared_prefix_batch_same_tokens(llama_checkpoint, workload, level) -> None:
    # a 16-token budget admits the requests over several steps: later ones hit
    # the blocks earlier ones filled
    kwargs = {"optimization_level": level, "max_num_batched_tokens": 16}
    if level:
        kwargs["compile_sizes"] = [1, 2, 4]
    on, off, rt = _pair(llama_checkpoint[0], workload, GREEDY, **kwargs)
    assert on == off
    stats = rt.stats()
    assert stats.prefix_cache_hits >= 3 * 32 and stats.prefix_cache_queries > stats.prefix_cache_hits
    assert stats.kv_cache_usage == 0.0


def test_one_after_another_the_second_hits(llama_checkpoint, workload) -> None:
    rt = _load(llama_checkpoint[0], True)
    first = rt.generate(workload[0], GREEDY)[0]
    hits = rt.stats().prefix_cache_hits
    second = rt.generate(workload[1], GREEDY)[0]
    assert rt.stats().prefix_cache_hits - hits == 36  # 9 full blocks of the shared 37 tokens
    off = _load(llama_checkpoint[0], False)
    assert [first.token_ids, second.token_ids] == [o.token_ids for o in off.generate(workload[:2], GREEDY)]
    again = rt.generate(workload[1], GREEDY)[0]  # its own output blocks are cached too
    assert again.token_ids == second.token_ids


def test_a_different_salt_gives_no_hit(llama_checkpoint, workload) -> None:
    rt = _load(llama_checkpoint[0], True)
    rt.generate(workload[0], GREEDY, cache_salt="a")
    hits = rt.stats().prefix_cache_hits
    rt.generate(workload[1], GREEDY, cache_salt="b")
    assert rt.stats().prefix_cache_hits == hits
    rt.generate(workload[1], GREEDY, cache_salt="a")
    assert rt.stats().prefix_cache_hits > hits


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_tight_cache_evicts_and_preempts_without_changing_tokens(llama_checkpoint, workload, params) -> None:
    tight = {"max_num_batched_tokens": 8, "num_kv_blocks": 20, "max_num_seqs": 4}
    on, off, rt = _pair(llama_checkpoint[0], workload * 2, params, **tight)
    assert on == off
    stats = rt.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.kv_cache_usage == 0.0


def test_triton_backend_under_the_interpreter(llama_checkpoint, workload) -> None:
    prompts = [p[:30] for p in workload[:3]]  # the same 30 tokens: 3 blocks of 8 to share
    on, off, rt = _pair(llama_checkpoint[0], prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                        attention_backend="triton", max_num_batched_tokens=16, block_size=8)
    assert on == off and rt.stats().prefix_cache_hits > 0
