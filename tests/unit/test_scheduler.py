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


def _rows(out) -> list:
    return [(s.request_id, s.prompt_logprobs and (s.prompt_logprobs.first, s.prompt_logprobs.targets))
            for s in out.scheduled]


def test_prompt_logprob_rows_cover_each_prompt_token_once_over_chunks_and_a_preemption() -> None:
    """Row p predicts prompt token p + 1: chunks name their rows, the last
    prompt row (which samples) names none, and after a preemption the
    recomputed rows are not asked for again; the first token carries them all."""
    from kiln.engine.sampler import TokenLogprobs

    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=4, max_model_len=64)
    req = Request(0, [10, 11, 12, 13, 14, 15, 16, 17, 18, 19],
                  SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=1))
    sched.add(req)

    def step(out, sampled=()) -> list:
        got = {s.request_id: [TokenLogprobs(-float(t), [(t, -float(t))]) for t in s.prompt_logprobs.targets]
               for s in out.scheduled if s.prompt_logprobs is not None}
        return sched.update(out, list(sampled), prompt_logprobs=got)

    out = sched.schedule()
    assert _rows(out) == [(0, (0, [11, 12, 13, 14]))]
    step(out)
    out = sched.schedule()
    assert _rows(out) == [(0, (0, [15, 16, 17, 18]))]
    step(out)
    sched._preempt(sched.running.pop())  # as the scheduler preempts it: recomputed from the start
    out = sched.schedule()
    assert out.scheduled[0].start == 0 and _rows(out) == [(0, None)]  # rows 0-3 were computed before
    step(out)
    sched.update(sched.schedule(), [], prompt_logprobs={})  # rows 4-7 were computed too
    out = sched.schedule()
    assert [(s.start, s.num_tokens) for s in out.scheduled] == [(8, 2)] and _rows(out) == [(0, (0, [19]))]
    first = step(out, [7])[0]
    assert first.prompt_logprobs[0] is None
    assert [lp.logprob for lp in first.prompt_logprobs[1:]] == [-float(t) for t in range(11, 20)]
    out = sched.schedule()
    assert _rows(out) == [(0, None)]
    assert step(out, [8])[0].prompt_logprobs is None  # only the first token carries them


def test_a_request_for_prompt_logprobs_does_not_read_the_prefix_cache() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    first = _request(0, 10)
    sched.add(first)
    sched.update(sched.schedule(), [1])
    wants = Request(1, list(first.prompt_token_ids), SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0))
    plain = _request(2, 10)
    sched.add(wants)
    sched.add(plain)
    out = sched.schedule()
    assert [(s.request_id, s.start) for s in out.scheduled] == [(0, 10), (1, 0), (2, 8)]
    assert out.scheduled[1].prompt_logprobs.targets == first.prompt_token_ids[1:]
