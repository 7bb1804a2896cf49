"""The scheduler and the block pool alone: budgets, chunking, preemption."""

from __future__ import annotations

from kiln.engine.kv_cache_manager import KVCacheManager
from kiln.engine.request import Request, SamplingParams
from kiln.engine.scheduler import Scheduler


def _request(rid: int, n: int, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, temperature=0))


def test_scheduler_respects_token_budget_and_seq_cap() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_caching=False)
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=10, max_model_len=64)
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
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=False)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=16)
    a, b = _request(0, 8, max_tokens=8), _request(1, 8, max_tokens=8)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert kv.num_free == 0 and len(out.scheduled) == 2
    sched.update(out, [9, 9])
    out = sched.schedule()  # a's 9th token needs a third block: b is preempted
    assert [s.request_id for s in out.scheduled] == [0]
    assert out.num_preempted == 1
    assert b.num_computed_tokens == 0 and b.block_ids == [] and b.output_token_ids == [9]
    assert list(sched.waiting) == [b]
    assert kv.num_free == 1


def test_grow_is_all_or_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_caching=False)
    req = _request(0, 9)
    assert kv.allocate(req, [], 9) and len(req.block_ids) == 3
    before = list(req.block_ids)
    assert not kv.grow(req, 13) and req.block_ids == before
    kv.free(req)
    assert kv.num_free == 3 and req.block_ids == []


def test_a_cached_prefix_is_not_computed_again() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    first = _request(0, 10)
    sched.add(first)
    out = sched.schedule()
    sched.update(out, [7])  # 10 prompt tokens computed: two full blocks cached
    second = Request(1, list(range(1, 10)) + [42], SamplingParams(max_tokens=4, temperature=0))
    sched.add(second)
    out = sched.schedule()
    starts = {s.request_id: (s.start, s.num_tokens) for s in out.scheduled}
    assert starts[1] == (8, 2)  # two blocks hit: only the tail is computed, and the budget pays for it alone
    assert second.block_ids[:2] == first.block_ids[:2]
    assert kv.stats.queries == 10 + 10 and kv.stats.hits == 8
