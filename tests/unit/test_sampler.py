"""The sampler alone: filters, greedy rows, the sampled distribution."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.engine.request import SamplingParams
from kiln.engine.sampler import (
    NUCLEUS_CANDIDATES,
    NUCLEUS_STAGES,
    Filters,
    Sampler,
    _sorted_top_k_top_p,
    apply_logit_changes,
    apply_min_p,
    apply_top_k_top_p,
    argmax_rows,
    draw,
    filter_logits,
    nucleus,
)


def test_top_k_and_top_p_masks() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 10.0, 0.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2, 0]), None)
    assert torch.isinf(out[0, [0, 3]]).all() and torch.isfinite(out[0, [1, 2]]).all()
    assert torch.isfinite(out[1]).all()  # top_k=0 keeps everything
    out = apply_top_k_top_p(logits, None, torch.tensor([0.5, 0.5]))
    assert torch.isfinite(out[0]).sum() == 1 and out[0, 1] == 3.0
    assert torch.isfinite(out[1]).sum() == 1 and out[1, 2] == 10.0


def test_sampler_draws_only_allowed_tokens_and_greedy_is_argmax() -> None:
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=2.0, top_k=1),
    ]
    for step in range(20):
        tokens = sampler(logits, params, [step] * 3).tokens
        assert tokens[0] == int(logits[0].argmax())
        assert tokens[1] in logits[1].topk(3).indices.tolist()
        assert tokens[2] == int(logits[2].argmax())


def test_sampling_follows_the_distribution() -> None:
    sampler = Sampler(torch.device("cpu"), seed=0)
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().expand(4000, 3).contiguous()
    tokens = torch.tensor(sampler(logits, [SamplingParams(temperature=1.0)] * 4000, [0] * 4000).tokens)
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_tiny_temperatures_are_greedy() -> None:
    """A temperature far below any useful one divides logits into inf and NaN
    probabilities (token 0 every time); below GREEDY_EPSILON it is greedy."""
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    for t in (1e-45, 1e-9, 1e-6):
        params = [SamplingParams(temperature=t), SamplingParams(temperature=t, seed=3)]
        assert all(p.greedy for p in params)
        assert sampler(logits, params, [0, 0]).tokens == logits.argmax(-1).tolist()
    assert not SamplingParams(temperature=1e-3).greedy


def test_logprobs_on_the_processed_distribution_only_when_asked() -> None:
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.5, 3.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    assert sampler(logits, [SamplingParams(temperature=0)] * 3, [0] * 3).logprobs is None  # no cost unasked
    params = [
        SamplingParams(temperature=0, logprobs=2),  # greedy: the raw distribution
        SamplingParams(temperature=0.5, top_k=2, seed=1, logprobs=0),  # temperature and top-k applied
        SamplingParams(temperature=0),  # did not ask
    ]
    out = sampler(logits, params, [0, 0, 0])
    raw = logits[0].log_softmax(-1)
    assert out.tokens[0] == 0 and out.logprobs[0].logprob == pytest.approx(raw[0].item())
    assert [t for t, _ in out.logprobs[0].top] == [0, 1]
    assert [lp for _, lp in out.logprobs[0].top] == pytest.approx(raw[:2].tolist())
    processed = torch.tensor([0.5, 3.0, float("-inf"), float("-inf")]) / 0.5
    expected = processed.log_softmax(-1)[out.tokens[1]].item()
    assert out.tokens[1] in (0, 1) and out.logprobs[1].logprob == pytest.approx(expected)
    assert out.logprobs[1].top == [] and out.logprobs[2] is None


def test_argmax_rows_is_argmax_with_its_ties_and_nans() -> None:
    x = torch.zeros(5, 100)
    x[0, 5] = x[0, 50] = 1.0  # a tie: the first
    x[1, 7] = x[1, 9] = float("nan")  # NaN counts as the largest
    x[2] = float("-inf")
    x[3, 3] = x[3, 90] = float("inf")
    x[4] = torch.randn(100)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    many = torch.randint(0, 3, (64, 4096)).float()  # ties in every row
    assert torch.equal(argmax_rows(many), many.argmax(dim=-1))
    assert torch.equal(argmax_rows(many.to(torch.bfloat16)), many.argmax(dim=-1))


def test_greedy_rows_of_bf16_logits_take_the_fp32_argmax() -> None:
    """All-greedy steps without logprobs skip the fp32 copy: the same tokens,
    ties (the first index) included."""
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(1)).bfloat16()
    logits[2, 10] = logits[2, 900] = logits[2].max() + 1  # a tie: the first one wins
    out = Sampler(torch.device("cpu"))(logits, [SamplingParams(temperature=0)] * 4, [0] * 4)
    assert out.tokens == logits.float().argmax(dim=-1).tolist() and out.tokens[2] == 10 and out.logprobs is None


def test_greedy_steps_take_the_native_argmax_where_it_takes_the_logits() -> None:
    logits = torch.randn(3, 50)
    greedy = [SamplingParams(temperature=0)] * 3
    seen: list[torch.Tensor] = []

    def native(t: torch.Tensor) -> list[int] | None:
        seen.append(t)
        return [7, 8, 9] if t.dtype == torch.float32 else None

    sampler = Sampler(torch.device("cpu"), native_argmax=native)
    assert sampler(logits, greedy, [0, 0, 0]).tokens == [7, 8, 9]
    bf16 = logits.to(torch.bfloat16)  # refused: torch's argmax
    assert sampler(bf16, greedy, [0, 0, 0]).tokens == bf16.float().argmax(dim=-1).tolist()
    # a row that samples, or asks for logprobs, goes the torch way
    seen.clear()
    mixed = [SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0)]
    assert sampler(logits, mixed, [0, 0, 0]).tokens == logits.argmax(dim=-1).tolist()
    assert not seen


def _reference_changes(row: list[float], p: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    """vLLM's order, one token at a time: the bias, then the repetition,
    frequency and presence penalties."""
    out = list(row)
    for token, bias in (p.logit_bias or {}).items():
        out[token] += bias
    for token in range(len(out)):
        count = output.count(token)
        if (count or token in prompt) and p.repetition_penalty != 1.0:
            out[token] = out[token] / p.repetition_penalty if out[token] > 0 else out[token] * p.repetition_penalty
        out[token] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


def test_logit_bias_and_penalties_follow_the_reference() -> None:
    logits = torch.randn(4, 12, generator=torch.Generator().manual_seed(3))
    params = [
        SamplingParams(logit_bias={3: 5.0, 7: -100.0, 11: 0.5}),
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(),  # untouched in a batch with others
        SamplingParams(repetition_penalty=0.8, presence_penalty=-1.0, logit_bias={2: -3.0}),
    ]
    histories = [None, ([1, 2, 2, 10], [2, 5, 5, 9, 5]), None, ([0, 4], [4, 6])]
    out = apply_logit_changes(logits, params, histories)
    for i, (p, h) in enumerate(zip(params, histories)):
        expected = _reference_changes(logits[i].tolist(), p, *(h or ([], [])))
        assert torch.allclose(out[i], torch.tensor(expected), atol=1e-6), i
    assert torch.equal(out[2], logits[2]) and not torch.equal(out[1], logits[1])
    assert torch.equal(logits, torch.randn(4, 12, generator=torch.Generator().manual_seed(3)))  # input left alone
    with pytest.raises(ValueError, match="sampling row 1 penalizes repeats, but no token history"):
        apply_logit_changes(logits, params, None)


def test_greedy_rows_take_the_argmax_after_bias_and_penalties() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.5, 1.0], [0.0, 3.0, 2.5, 1.0], [0.0, 3.0, 2.5, 1.0]])
    calls: list[torch.Tensor] = []
    sampler = Sampler(torch.device("cpu"), native_argmax=lambda t: calls.append(t) or None)
    params = [SamplingParams(temperature=0, logit_bias={3: 10.0}),
              SamplingParams(temperature=0, presence_penalty=1.0),  # token 1 already produced: 2.5 wins
              SamplingParams(temperature=0, repetition_penalty=2.0)]  # token 1 in the prompt: 3.0 / 2 < 2.5
    assert not Sampler.argmax_only(params)
    out = sampler(logits, params, [0, 1, 0], [None, ([0], [1]), ([1], [])])
    assert out.tokens == [3, 2, 2] and not calls  # not the raw logits' argmax
    plain = [SamplingParams(temperature=0)] * 3
    assert Sampler.argmax_only(plain) and sampler(logits, plain, [0] * 3).tokens == [1, 1, 1]


def test_min_p_keeps_tokens_near_the_most_likely() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]])
    out = apply_min_p(probs.log(), torch.tensor([0.5, 0.0]))
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]  # 0.15 < 0.5 x 0.5
    assert torch.equal(out[1], probs.log()[1])
    sampler = Sampler(torch.device("cpu"), seed=0)
    rows = probs[0].log().expand(2000, 4).contiguous()
    tokens = sampler(rows, [SamplingParams(temperature=1.0, min_p=0.5)] * 2000, [0] * 2000).tokens
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / 2000
    assert freq[2:].sum() == 0 and abs(freq[0] - 0.5 / 0.8) < 0.04  # drawn from what is left, renormalised


def test_suppressed_tokens_are_never_picked() -> None:
    """A request short of its min_tokens may not pick EOS or its stop token
    ids: greedy rows take the next best, sampled rows draw from the rest."""
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0]] * 3)
    sampler = Sampler(torch.device("cpu"), seed=0, native_argmax=lambda t: [1, 1, 1])
    greedy = [SamplingParams(temperature=0)] * 3
    suppressed = [(1, 4, -1), (), (1, 2, 99)]  # ids outside the vocabulary (stop token ids may be) change nothing
    assert not Sampler.argmax_only(greedy, suppressed) and Sampler.argmax_only(greedy, [(), (), ()])
    assert sampler(logits, greedy, [0] * 3, suppressed=suppressed).tokens == [2, 1, 3]
    drawn = sampler(logits[0].expand(500, 4), [SamplingParams(temperature=5.0)] * 500, [0] * 500,
                    suppressed=[(1, 2)] * 500).tokens
    assert set(drawn) == {0, 3}


@pytest.mark.parametrize("scale", [4.0, 1.0, 0.02])  # peaked rows; flat ones, whose nuclei go past the candidates
def test_top_k_top_p_on_candidates_keeps_what_a_whole_sort_keeps(scale) -> None:
    g = torch.Generator().manual_seed(7)
    vocab = 8 * NUCLEUS_CANDIDATES
    logits = torch.randn(24, vocab, generator=g) * scale
    top_k = torch.randint(0, 60, (24,), generator=g)
    top_k[3] = vocab + 5  # past the vocabulary: off
    top_p = torch.rand(24, generator=g) * 0.98 + 0.01
    top_p[::4] = 1.0  # off on some rows
    for k, p in ((top_k, top_p), (None, top_p), (top_k, None)):
        fast = apply_top_k_top_p(logits, k, p)
        whole = _sorted_top_k_top_p(logits, k, p if p is not None else torch.ones(24))
        assert torch.equal(torch.isinf(fast), torch.isinf(whole))
        assert torch.equal(fast[torch.isfinite(fast)], logits[torch.isfinite(fast)])  # kept logits unchanged
    assert apply_top_k_top_p(logits, torch.zeros(24, dtype=torch.long), None) is logits  # nothing to do


def test_inverse_cdf_draws_follow_the_distribution_and_never_a_masked_token() -> None:
    sampler = Sampler(torch.device("cpu"), seed=3)
    probs = torch.tensor([0.5, 0.0, 0.2, 0.0, 0.3])
    logits = probs.log().expand(6000, 5).contiguous()
    tokens = torch.tensor(sampler(logits, [SamplingParams(temperature=1.0)] * 6000, [0] * 6000).tokens)
    freq = torch.bincount(tokens, minlength=5).float() / 6000
    assert freq[1] == 0 and freq[3] == 0 and torch.allclose(freq, probs, atol=0.025)


@pytest.mark.parametrize("vocab", [1000, 768, 5])  # a partial last block, whole blocks, less than a block
def test_draw_inverts_the_cumulative_sum_and_skips_zeros(vocab) -> None:
    g = torch.Generator().manual_seed(vocab)
    probs = (torch.rand(300, vocab, generator=g) ** 4 * 1024).round() / 1024  # block sums exact in fp32
    probs[probs < 0.2] = 0.0  # holes, block edges included
    probs[:, 0] = 0.0
    probs[:, -1] = 0.0
    probs[:, 1] += 0.01  # every row has some mass (a softmax's always has)
    probs[0] = 0.0
    probs[0, vocab // 2] = 3.0  # one token, any scale
    u = torch.rand(300, dtype=torch.float64, generator=g)
    u[1], u[2] = 0.0, 1.0 - 2.0 ** -53  # the ends of [0, 1)
    tokens = draw(probs, u)
    sums = probs.double().cumsum(dim=-1)
    expected = torch.searchsorted(sums, (u * sums[:, -1]).unsqueeze(1), right=True).squeeze(1)
    assert torch.equal(tokens, expected) and tokens[0] == vocab // 2
    assert torch.equal(draw(probs.t().contiguous().t(), u), expected)  # rows not contiguous in memory
    assert bool((probs.gather(1, tokens.unsqueeze(1)) > 0).all())


def test_the_sampler_finds_a_prompts_tokens_once_while_its_request_runs() -> None:
    sampler = Sampler(torch.device("cpu"))
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=0, repetition_penalty=2.0)] * 2
    prompts, outputs = [[3, 7, 7, 30], [1, 2]], [[5], []]
    histories = list(zip(prompts, outputs))
    expected = apply_logit_changes(logits, params, histories).argmax(dim=-1).tolist()
    assert sampler(logits, params, [1, 0], histories).tokens == expected
    cached = {id(p): sampler._prompts[id(p)][2] for p in prompts}
    outputs[1].append(9)  # the next step: the same lists, one output longer
    expected = apply_logit_changes(logits, params, histories).argmax(dim=-1).tolist()
    assert sampler(logits, params, [1, 1], histories).tokens == expected
    assert all(sampler._prompts[id(p)][2] is cached[id(p)] for p in prompts)  # not found again
    prompts[0].append(39)  # a list that changed is read again
    again = [(prompts[0], outputs[0])]
    assert sampler(logits[:1], params[:1], [1], again).tokens == apply_logit_changes(
        logits[:1], params[:1], again).argmax(dim=-1).tolist()
    assert list(sampler._prompts) == [id(prompts[0])] and 39 in sampler._prompts[id(prompts[0])][2].tolist()


def _kept_by_hand(row: list[float], k: int, p: float, m: float) -> set[int]:
    """The tokens min-p, top-k and top-p keep, one filter after the other in fp64."""
    order = sorted(range(len(row)), key=lambda i: -row[i])
    thr = float("-inf")
    if 0 < k < len(row):
        thr = row[order[k - 1]]
    if m > 0:
        thr = max(thr, row[order[0]] + math.log(m))
    kept = [i for i in order if row[i] >= thr]
    if p < 1.0:
        top = row[kept[0]]
        z = top + math.log(sum(math.exp(row[i] - top) for i in kept))
        total, last = 0.0, thr
        for i in kept:  # most likely first: kept while less than p is more likely
            if total >= p:
                break
            last, total = row[i], total + math.exp(row[i] - z)
        kept = [i for i in kept if row[i] >= last]
    return set(kept)


@pytest.mark.parametrize("case", ["peaked", "flat", "ties", "small vocabulary"])
def test_filters_keep_what_each_filter_in_turn_keeps(case) -> None:
    """min-p, top-k and top-p in every mix, rows whose kept tokens lie within
    the first stage's candidates, the last's, or past them (flat rows), exact
    ties at the boundary (all kept), k past the candidates and the vocabulary."""
    g = torch.Generator().manual_seed(11)
    vocab = 20 if case == "small vocabulary" else 3 * NUCLEUS_CANDIDATES
    rows = 48
    logits = torch.randn(rows, vocab, generator=g) * {"peaked": 4.0, "flat": 0.05}.get(case, 1.5)
    if case == "ties":
        logits = (logits * 2).round() / 2
    top_k = torch.randint(0, 2 * NUCLEUS_CANDIDATES, (rows,), generator=g)
    top_k[::3] = 0
    top_k[1] = vocab + 3
    top_k[2] = NUCLEUS_STAGES[0] + 40  # a k past the first stage, with top-p
    top_k[4] = -1  # off, as vLLM takes it
    top_p = torch.rand(rows, generator=g) * 0.98 + 0.01
    top_p[::4] = 1.0
    min_p = torch.where(torch.rand(rows, generator=g) < 0.5, torch.rand(rows, generator=g) * 0.2, torch.zeros(rows))
    filters = Filters(top_k, top_p, min_p)
    out = filter_logits(logits, filters)
    for i in range(rows):
        expected = _kept_by_hand(logits[i].double().tolist(), int(top_k[i]), float(top_p[i]), float(min_p[i]))
        assert set(torch.isfinite(out[i]).nonzero().squeeze(1).tolist()) == expected, f"row {i}"
    kept = out[torch.isfinite(out)]
    assert torch.equal(kept, logits[torch.isfinite(out)])  # kept logits unchanged
    found = nucleus(logits, filters)
    hits = found.kept > 0
    if case == "flat":
        assert not bool(hits[top_p < 0.9].all())  # some rows went past the candidates, to the whole-row path
    else:
        assert bool(hits[filters.on(rows, vocab, logits.device)].any())
    for i in hits.nonzero().squeeze(1).tolist():  # a found row: its kept tokens, most likely first
        ids = found.ids[i, :found.kept[i]]
        assert set(ids.tolist()) == set(torch.isfinite(out[i]).nonzero().squeeze(1).tolist())
        assert bool((found.values[i, :found.kept[i]].diff() <= 0).all())


def test_sampling_among_the_candidates_follows_the_filtered_distribution() -> None:
    """Rows drawn among their nucleus candidates follow the filtered,
    renormalised distribution, like rows drawn from the whole row."""
    sampler = Sampler(torch.device("cpu"), seed=4)
    probs = torch.tensor([0.4, 0.05, 0.25, 0.15, 0.1, 0.05])
    logits = probs.log().expand(6000, 6).contiguous()
    for fields, kept in (({"top_p": 0.75}, [0, 2, 3]), ({"top_k": 2}, [0, 2]), ({"min_p": 0.3}, [0, 2, 3])):
        params = [SamplingParams(temperature=1.0, **fields)] * 6000
        tokens = torch.tensor(sampler(logits, params, [0] * 6000).tokens)
        freq = torch.bincount(tokens, minlength=6).double() / 6000
        expected = torch.zeros(6, dtype=torch.float64)
        expected[kept] = probs[kept].double() / probs[kept].sum()
        assert torch.allclose(freq, expected, atol=0.025), fields


def test_a_seeded_rows_token_and_logprob_do_not_depend_on_its_batch() -> None:
    """A seeded row draws the same token alone and beside rows with other
    filters (a wide top-k, flat rows sorted whole, greedy rows), and its
    logprob is that of the token it drew, on the distribution it drew from."""
    g = torch.Generator().manual_seed(2)
    peaked = torch.randn(4, 4 * NUCLEUS_CANDIDATES, generator=g) * 3
    flat = torch.randn(3, 4 * NUCLEUS_CANDIDATES, generator=g) * 0.01
    mine = [SamplingParams(temperature=0.9, top_p=0.8, seed=s, logprobs=3) for s in range(4)]
    others = [SamplingParams(temperature=1.0, top_k=700, top_p=0.9), SamplingParams(temperature=0.7, top_p=0.5),
              SamplingParams(temperature=0)]
    sampler = Sampler(torch.device("cpu"), seed=0)
    for step in range(5):
        alone = sampler(peaked, mine, [step] * 4)
        mixed = sampler(torch.cat([flat, peaked]), others + mine, [step] * 7)
        assert mixed.tokens[3:] == alone.tokens
        for a, b in zip(alone.logprobs, mixed.logprobs[3:]):
            assert a.logprob == pytest.approx(b.logprob) and a.logprob > float("-inf")
        assert mixed.tokens[2] == int(flat[2].argmax())


def test_the_workspace_leaves_the_callers_logits_and_serves_any_shape() -> None:
    """The sampler writes its whole-row temporaries into buffers it keeps:
    the logits handed to it stay as they were, and a smaller step after a
    larger one (or a wider vocabulary after a narrower one) gets the same
    tokens as a fresh sampler."""
    g = torch.Generator().manual_seed(9)
    cases = [
        (torch.randn(6, 700, generator=g), [SamplingParams(temperature=0.8, top_p=0.9, seed=1, logprobs=2)] * 6),
        (torch.randn(3, 300, generator=g), [SamplingParams(temperature=0, repetition_penalty=1.3, logprobs=1)] * 3),
        (torch.randn(2, 900, generator=g), [SamplingParams(temperature=1.2, seed=2), SamplingParams(temperature=0)]),
    ]
    kept = Sampler(torch.device("cpu"))
    for logits, params in cases:
        before = logits.clone()
        histories = [([1, 2], [3])] * len(params)
        out = kept(logits, params, [0] * len(params), histories)
        assert torch.equal(logits, before)
        fresh = Sampler(torch.device("cpu"))(logits, params, [0] * len(params), histories)
        assert out.tokens == fresh.tokens and out.logprobs == fresh.logprobs
