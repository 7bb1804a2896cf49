"""The scheduler and the block pool alone: budgets, chunking, preemption."""

from __future__ import annotations

from kiln.engine.block_pool import BlockPool
from kiln.engine.request import Request, SamplingParams
from kiln.engine.scheduler import Scheduler


def _request(rid: int, n: int, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, temperature=0))


def test_scheduler_respects_token_budget_and_seq_cap() -> None:
    pool = BlockPool(num_blocks=64, block_size=4)
    sched = Scheduler(pool, max_num_seqs=2, max_num_batched_tokens=10, max_model_len=64)
    for i, n in enumerate([7, 7, 7]):
        sched.add(_request(i, n))
    out = sched.schedule()
    assert [(s.request_id, s.start, s.num_tokens, s.sampling is not None) for s in out.scheduled] == [
        (0, 0, 7, True),
        (1, 0, 3, False),  # chunked: the budget ran out
    ]
    sched.update(out, [5])
    out = sched.schedule()
    # request 0 decodes one token, request 1 finishes its prompt, request 2 waits (cap of 2)
    assert [(s.request_id, s.start, s.num_tokens) for s in out.scheduled] == [(0, 7, 1), (1, 3, 4)]


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
    assert [s.request_id for s in out.scheduled] == [0]
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
