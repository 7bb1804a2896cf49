"""Speculative decoding by prompt lookup: the proposer, the acceptance rule,
and the scheduler running drafts and keeping what the model agrees with."""

from __future__ import annotations

import pytest

from kiln.config import EngineConfig, SpeculativeConfig
from kiln.engine.kv_cache_manager import KVCacheManager
from kiln.engine.request import Request, SamplingParams
from kiln.engine.scheduler import Scheduler
from kiln.engine.speculative import NgramProposer, accept, speculates

GREEDY = SamplingParams(max_tokens=16, temperature=0)


def _proposer(k: int = 3, n_max: int = 3, n_min: int = 1) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=n_max, prompt_lookup_min=n_min))


def test_the_proposer_takes_what_followed_the_longest_recent_ngram() -> None:
    p = _proposer()
    req = Request(0, [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 1, 2, 3], GREEDY)
    # [1, 2, 3] (the longest suffix found) stood at 0: then 4, 5, 9
    assert p.propose(req, 10) == [4, 5, 9]
    req.output_token_ids += [4]  # [2, 3, 4] stands at 1 and 6: the more recent, then 6, 1, 2
    assert p.propose(req, 10) == [6, 1, 2]
    assert p.propose(req, 2) == [6, 1]  # no more than asked
    assert p.propose(req, 0) == []
    loop = Request(1, [7, 8] * 6, GREEDY)  # a loop of period 2: a recent occurrence with 3 tokens after it
    assert p.propose(loop, 10) == [7, 8, 7]
    assert _proposer(n_min=3).propose(Request(2, [1, 2, 3, 9, 2, 3], GREEDY), 5) == []  # [2, 3] is too short
    assert p.propose(Request(3, [4], GREEDY), 5) == [] and p.propose(Request(4, [1, 2, 3], GREEDY), 5) == []


def test_accept_keeps_the_drafts_the_model_agrees_with_then_its_own_token() -> None:
    assert accept([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accept([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accept([5, 6, 7], [1, 6, 7, 8]) == [1]
    assert accept([], [3]) == [3]


def test_only_plain_greedy_requests_speculate() -> None:
    assert speculates(Request(0, [1], GREEDY))
    for params in (SamplingParams(temperature=0.8), SamplingParams(temperature=0, logprobs=1),
                   SamplingParams(temperature=0, repetition_penalty=1.1), SamplingParams(temperature=0, logit_bias={1: 2}),
                   SamplingParams(temperature=0, min_tokens=2)):
        assert not speculates(Request(0, [1], params)), params


def test_speculative_config_is_checked_naming_the_field() -> None:
    assert EngineConfig(speculative_config={"num_speculative_tokens": 2}).speculative_config.num_speculative_tokens == 2
    assert EngineConfig(speculative_config='{"method": "ngram"}').speculative_config == SpeculativeConfig()
    for bad, match in (({"method": "eagle"}, "method must be 'ngram'"), ({"num_speculative_tokens": 0},
                       "num_speculative_tokens must be a positive integer"), ({"lookahead": 3}, "unknown field"),
                       ({"prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min=5 exceeds"),
                       ("{oops", "not valid JSON")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(speculative_config=bad)


def _scheduler(budget: int = 16, eos: tuple[int, ...] = (), **kw) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks=16, block_size=4, enable_caching=True), 4, budget, 64,
                     _proposer(**kw))


def test_drafts_run_with_the_next_token_and_refused_ones_leave_no_computed_position() -> None:
    sched = _scheduler()
    req = Request(0, [5, 6, 7, 8, 5, 6], SamplingParams(max_tokens=10, temperature=0))
    sched.add(req)
    [out] = sched.update(sched.schedule(), [7])
    assert out.new_token_ids == [7] and req.draft_token_ids == [8, 5, 6]  # [5, 6, 7] stood at 0
    step = sched.schedule()
    [s] = step.scheduled
    assert (s.start, s.token_ids, s.draft_token_ids, s.num_samples) == (6, [7, 8, 5, 6], (8, 5, 6), 4)
    # the model's token after 7 is 8, after 8 is 5 (both drafts kept), after 5 is 9 (not the draft 6)
    [out] = sched.update(step, [8, 5, 9, 1])
    assert out.new_token_ids == [8, 5, 9] and req.output_token_ids == [7, 8, 5, 9]
    assert req.num_computed_tokens == req.num_tokens - 1 == 9  # position 9 held the refused draft
    assert (sched.num_draft_tokens, sched.num_accepted_tokens) == (3, 2)
    assert req.draft_token_ids == []  # [5, 9] and [9] stand nowhere before
    [s] = sched.schedule().scheduled
    assert (s.start, s.token_ids) == (9, [9])


def test_drafts_stop_at_eos_and_keep_to_the_budget_and_max_tokens() -> None:
    sched = _scheduler()
    req = Request(0, [5, 6, 7, 8, 5, 6], SamplingParams(max_tokens=10, temperature=0), eos_token_ids=(5,))
    sched.add(req)
    sched.update(sched.schedule(), [7])
    [out] = sched.update(sched.schedule(), [8, 5, 6, 1])  # EOS among the kept tokens: nothing after it
    assert out.new_token_ids == [8, 5] and out.finish_reason == "stop" and req.output_token_ids == [7, 8, 5]
    assert 0 not in sched.requests and sched.kv.num_free == 16
    tight = _scheduler(budget=3)
    req = Request(1, [5, 6, 7, 8, 5, 6], SamplingParams(max_tokens=10, temperature=0))
    tight.add(req)
    tight.update(tight.schedule(), [])  # the prompt in two chunks of 3
    tight.update(tight.schedule(), [7])
    [s] = tight.schedule().scheduled
    assert s.draft_token_ids == (8, 5)  # the budget's 3 tokens: the token and two drafts
    short = _scheduler()
    req = Request(2, [5, 6, 7, 8, 5, 6], SamplingParams(max_tokens=3, temperature=0))
    short.add(req)
    short.update(short.schedule(), [7])
    assert req.draft_token_ids == [8]  # 2 tokens left: a draft kept and the model's token after it
    [out] = short.update(short.schedule(), [8, 5])
    assert out.new_token_ids == [8, 5] and out.finish_reason == "length"


def test_a_request_that_samples_gets_no_drafts_and_rows_stay_in_order() -> None:
    sched = _scheduler()
    greedy = Request(0, [5, 6, 7, 8, 5, 6], SamplingParams(max_tokens=10, temperature=0))
    sampled = Request(1, [5, 6, 7, 8, 5, 6], SamplingParams(max_tokens=10, temperature=1.0))
    sched.add(greedy)
    sched.add(sampled)
    sched.update(sched.schedule(), [7, 7])
    assert greedy.draft_token_ids == [8, 5, 6] and sampled.draft_token_ids == []
    step = sched.schedule()
    assert [s.num_samples for s in step.scheduled] == [4, 1]
    outs = sched.update(step, [8, 0, 0, 0, 3])  # the greedy request's 4 rows, then the sampled one's
    assert [o.new_token_ids for o in outs] == [[8, 0], [3]]


def test_no_drafts_while_the_batch_is_larger_than_disable_by_batch_size() -> None:
    config = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1,
                               disable_by_batch_size=1)
    sched = Scheduler(KVCacheManager(num_blocks=16, block_size=4, enable_caching=True), 4, 16, 64,
                      NgramProposer(config))
    first = Request(0, [5, 6, 7, 8, 5, 6], SamplingParams(max_tokens=10, temperature=0))
    sched.add(first)
    sched.update(sched.schedule(), [7])
    sched.add(Request(1, [1, 2, 3], SamplingParams(max_tokens=10, temperature=0)))
    assert [s.draft_token_ids for s in sched.schedule().scheduled] == [(), ()]  # two requests: none
    with pytest.raises(ValueError, match="disable_by_batch_size must be a positive integer"):
        SpeculativeConfig(disable_by_batch_size=0)


def test_drafts_never_preempt_another_request() -> None:
    sched = Scheduler(KVCacheManager(num_blocks=5, block_size=4, enable_caching=False), 4, 16, 20,
                      _proposer())
    a = Request(0, [5, 6, 7, 8, 5, 6, 7], SamplingParams(max_tokens=8, temperature=0))
    b = Request(1, [1, 2, 3, 4, 9, 9, 9, 9], SamplingParams(max_tokens=8, temperature=0))
    sched.add(a)
    sched.add(b)
    sched.update(sched.schedule(), [8, 9])  # 2 blocks each, 1 free
    assert a.draft_token_ids == [5, 6, 7]
    # b's next token takes the free block; a's drafts would need another, and b would have been preempted
    step = sched.schedule()
    assert step.num_preempted == 0 and step.scheduled[0].draft_token_ids == ()
    assert step.scheduled[1].draft_token_ids == (9, 9) and sched.kv.num_free == 0  # b's fit in its new block

