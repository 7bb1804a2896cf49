"""Continuous batching: batches, chunked prefill, preemption, late joiners."""

from __future__ import annotations

import pytest

from kiln import SamplingParams
from tests.conftest import load_eager
from tests.conftest import hf_greedy, random_prompts

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(llama_checkpoint):
    _, model = llama_checkpoint
    return random_prompts(6, [3, 11, 26, 7, 19, 40], model.config.vocab_size, seed=7)


@pytest.fixture(scope="module")
def reference(llama_checkpoint, prompts):
    path, model = llama_checkpoint
    rt = load_eager(path)
    one_by_one = [rt.generate(p, GREEDY)[0].token_ids for p in prompts]
    assert one_by_one[0] == hf_greedy(model, prompts[0], GREEDY.max_tokens)
    return one_by_one


def test_batch_equals_one_by_one(llama_checkpoint, prompts, reference) -> None:
    rt = load_eager(llama_checkpoint[0])
    outs = rt.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference


def test_tight_budget_chunks_and_preempts_without_changing_tokens(llama_checkpoint, prompts, reference) -> None:
    # 8 tokens a step forces 26- and 40-token prompts into chunks; 14 blocks of 4
    # slots (56 tokens) cannot hold six requests at once, so running ones are preempted.
    rt = load_eager(llama_checkpoint[0], max_num_batched_tokens=8, num_kv_blocks=14, block_size=4, max_num_seqs=4)
    outs = rt.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert rt.engine.scheduler.num_preemptions > 0
    assert rt.engine.scheduler.kv.usage == 0.0  # every block came back


def test_requests_join_a_running_batch(llama_checkpoint, prompts, reference) -> None:
    rt = load_eager(llama_checkpoint[0])
    first = rt.add_request(prompts[0], GREEDY)
    for _ in range(4):
        rt.step()
    assert rt.get_output(first).token_ids  # already decoding
    late = [rt.add_request(p, GREEDY) for p in prompts[1:3]]
    saw_mixed_step = False
    while rt.has_unfinished():
        deltas = rt.step()
        ids = {d.request_id for d in deltas}
        saw_mixed_step |= first in ids and bool(ids & set(late))
    assert saw_mixed_step
    assert [rt.release(r).token_ids for r in [first, *late]] == reference[:3]
