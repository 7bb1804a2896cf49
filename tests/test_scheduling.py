"""Continuous batching: batches, chunked prefill, preemption, late joiners."""

from __future__ import annotations

import pytest

from kiln import SamplingParams
from tests.conftest import load_eager
from kiln.runtime.block_pool import BlockPool
from kiln.runtime.request import Request
from kiln.runtime.scheduler import Scheduler
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
    assert rt.scheduler.num_preemptions > 0
    assert rt.pool.num_free == rt.pool.num_blocks  # every block came back


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


def _request(rid: int, n: int, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, temperature=0))


def test_scheduler_respects_token_budget_and_seq_cap() -> None:
    pool = BlockPool(num_blocks=64, block_size=4)
    sched = Scheduler(pool, max_num_seqs=2, max_num_batched_tokens=10, max_model_len=64)
    for i, n in enumerate([7, 7, 7]):
        sched.add(_request(i, n))
    out = sched.schedule()
    assert [(s.request.request_id, s.start, s.num_tokens, s.samples) for s in out.scheduled] == [
        (0, 0, 7, True),
        (1, 0, 3, False),  # chunked: the budget ran out
    ]
    sched.update(out, [5])
    out = sched.schedule()
    # request 0 decodes one token, request 1 finishes its prompt, request 2 waits (cap of 2)
    assert [(s.request.request_id, s.start, s.num_tokens) for s in out.scheduled] == [(0, 7, 1), (1, 3, 4)]


def test_scheduler_preempts_latest_and_frees_its_blocks() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=16)
    a, b = _request(0, 8, max_tokens=8), _request(1, 8, max_tokens=8)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert pool.num_free == 0 and len(out.scheduled) == 2
    sched.update(out, [9, 9])
    out = sched.schedule()  # a's 9th token needs a third block: b is preempted
    assert [s.request.request_id for s in out.scheduled] == [0]
    assert out.num_preempted == 1
    assert b.num_computed_tokens == 0 and b.block_ids == [] and b.output_token_ids == [9]
    assert list(sched.waiting) == [b]
    assert pool.num_free == 1


def test_block_pool_grow_is_all_or_nothing() -> None:
    pool = BlockPool(num_blocks=3, block_size=4)
    blocks: list[int] = []
    assert pool.grow(blocks, 9) and len(blocks) == 3
    more = list(blocks)
    assert not pool.grow(more, 13) and more == blocks
    pool.free(blocks)
    assert pool.num_free == 3
