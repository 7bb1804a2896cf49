"""Turning logits into tokens: logit bias and repeat penalties, then greedy, or
temperature, min-p, top-k and top-p and a draw, all in fp32.

A row is sampled by inverting its cumulative probabilities at one uniform
number, which lets every row take its randomness from its own generator. A
request with a seed draws the number of its n-th token from a generator seeded by
``(seed, n)``: its tokens do not depend on what else is in the batch, nor on
preemption.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kiln.engine.request import SamplingParams

__all__ = ["NUCLEUS_CANDIDATES", "History", "Sampler", "SamplerOutput", "TokenLogprobs", "apply_logit_changes",
           "apply_min_p", "apply_top_k_top_p", "argmax_rows", "draw", "prompt_tokens"]

# A sampling row's tokens so far: (prompt, output), which its penalties read
History = tuple[Sequence[int], Sequence[int]]

_MIX = 0x9E3779B97F4A7C15


def argmax_rows(t: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value (the first of equal ones, NaN
    counted largest), as ``argmax(dim=-1)``. torch's CPU ``max`` over the last
    dim is faster: [64, 49152] fp32 logits 0.94 against 2.40 ms (2 threads)."""
    return t.max(dim=-1).indices


def _step_seed(seed: int, step: int) -> int:
    return (seed * _MIX + step * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


# A filtered row's nucleus is looked for among its this many most likely tokens
# first; a row whose nucleus goes past them is sorted whole.
NUCLEUS_CANDIDATES = 256


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask (to -inf) what lies outside each row's top-k and nucleus top-p.

    ``top_k`` [R] int (0 = off), ``top_p`` [R] float (1.0 = off). A token is
    kept when its logit is at least the k-th largest, and when the tokens more
    likely than it (under the top-k-filtered row) hold less than ``top_p`` of
    the probability; tokens tied with the last one kept stay too. Found among
    each row's ``NUCLEUS_CANDIDATES`` most likely tokens (or its k, when
    larger), not by sorting the row; rows whose nucleus is not among them
    are sorted. A sampler step of 64 Zipf-like rows of 49152 logits, 2
    cores: top-p 0.95 17.8-21.0 ms against 167.6-187.1, top-k 50 11.5-17.0
    against 165.0-173.0, with ``draw`` against sorting and the exponential
    race (``python -m bench.sampler``: bench/results/sampler-cpu-20261207-181108.json
    and -181207, against -181039 and -181139 for the commit before)."""
    vocab = logits.shape[-1]
    k = None if top_k is None else _effective_top_k(top_k, vocab)
    limited = None if k is None else k < vocab
    if top_p is None and (limited is None or not bool(limited.any())):
        return logits
    most_k = int(k[limited].max()) if limited is not None and bool(limited.any()) else 0
    count = min(vocab, most_k if top_p is None else max(NUCLEUS_CANDIDATES, most_k))
    values, order = logits.topk(count, dim=-1)  # each row's most likely, in descending order
    filtered = logits
    if most_k:
        kth = values.gather(1, (k.clamp(max=count) - 1).unsqueeze(1))  # type: ignore[union-attr]
        kth = kth.masked_fill(~limited.unsqueeze(1), float("-inf"))  # type: ignore[union-attr]
        filtered = logits.masked_fill(logits < kth, float("-inf"))
        values = values.masked_fill(values < kth, float("-inf"))
    if top_p is None:
        return filtered
    probs = filtered.softmax(dim=-1).gather(1, order)  # one fused pass; logsumexp made five
    keep = probs.cumsum(dim=-1) - probs < top_p.unsqueeze(1)  # less than top_p more likely than it
    cutoff = values.masked_fill(~keep, float("inf")).amin(dim=-1, keepdim=True)
    off = top_p >= 1.0
    cutoff = cutoff.masked_fill(off.unsqueeze(1), float("-inf"))
    out = filtered.masked_fill(filtered < cutoff, float("-inf"))
    uncovered = ~(off | (probs.sum(dim=-1) >= top_p)) if count < vocab else torch.zeros_like(off)
    if bool(uncovered.any()):
        rows = uncovered.nonzero().squeeze(1)
        out[rows] = _sorted_top_k_top_p(logits[rows], None if top_k is None else top_k[rows], top_p[rows])
    return out


def _effective_top_k(top_k: torch.Tensor, vocab: int) -> torch.Tensor:
    """Each row's k as a count of tokens kept: 0 (off) and more than the vocabulary become the vocabulary."""
    return torch.where(top_k <= 0, torch.full_like(top_k, vocab), top_k.clamp(max=vocab))


def _sorted_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """``apply_top_k_top_p`` by sorting each row whole."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - _effective_top_k(top_k, vocab)).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - top_p).unsqueeze(1)
    drop[:, -1] = False  # the most likely token always stays
    sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_logit_changes(logits: torch.Tensor, params: list[SamplingParams],
                        histories: Sequence[History | None] | None,
                        suppressed: Sequence[Sequence[int]] | None = None,
                        prompt_set: Callable[[Sequence[int]], torch.Tensor] | None = None) -> torch.Tensor:
    """A copy of ``logits`` ([R, V]) with each row's ``suppressed`` tokens at
    -inf (a request short of its ``min_tokens``: EOS and its stop token ids),
    its ``logit_bias`` added, then its penalties applied (``SamplingParams``;
    vLLM's order), from its tokens so far (``histories[i]``, needed where
    ``params[i].penalized``). ``prompt_set``: a prompt's distinct token ids,
    sorted (default ``prompt_tokens``; the sampler keeps them from step to
    step). Rows that change nothing are copied as they are."""
    out = logits.clone(memory_format=torch.contiguous_format)
    vocab = out.shape[1]
    for i, banned in enumerate(suppressed or ()):
        inside = [t for t in banned if 0 <= t < vocab]  # a stop token id past the vocabulary is never sampled
        if inside:
            out[i, inside] = float("-inf")
    for i, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=out.device)
            values = torch.tensor(list(p.logit_bias.values()), dtype=out.dtype, device=out.device)
            out[i].index_add_(0, ids, values)
    rows = [i for i, p in enumerate(params) if p.penalized]
    if rows:
        missing = next((i for i in rows if histories is None or histories[i] is None), None)
        if missing is not None:
            raise ValueError(f"sampling row {missing} penalizes repeats, but no token history came with it")
        found = [histories[i] for i in rows]  # type: ignore[index]
        unique = prompt_set or prompt_tokens
        _penalize(out, rows, params, [unique(h[0]) for h in found], [h[1] for h in found])  # type: ignore[index]
    return out


def prompt_tokens(prompt: Sequence[int]) -> torch.Tensor:
    """The distinct token ids of ``prompt``, sorted (int64, CPU)."""
    return torch.unique(torch.tensor(list(prompt), dtype=torch.long))


def _penalize(logits: torch.Tensor, rows: list[int], params: list[SamplingParams], prompts: list[torch.Tensor],
              outputs: list[Sequence[int]]) -> None:
    """``logits`` ([R, V], in place) after the repetition, frequency and
    presence penalties of ``rows`` (``prompts``: each one's distinct prompt
    tokens, sorted; ``outputs``: its output so far), all rows at once and
    only where their tokens lie: for 64 rows of 49152 logits, each with 100
    prompt and 100 output tokens, 2.8 ms a step on 2 cores against 26.5 for
    the same arithmetic over whole rows (scratch timings, 2026-12-07)."""
    vocab = logits.shape[1]
    device = logits.device
    flat = logits.view(-1)
    column = {"dtype": logits.dtype, "device": device}
    # the prompts' tokens as positions in ``flat``: sorted, rows being in order
    in_prompt = torch.cat([p.to(device) + r * vocab for r, p in zip(rows, prompts)])
    owner = torch.repeat_interleave(torch.tensor(rows, device=device),
                                    torch.tensor([len(o) for o in outputs], device=device))
    produced = owner * vocab + torch.tensor([t for o in outputs for t in o], dtype=torch.long, device=device)
    produced, counts = produced.unique(return_counts=True)
    if len(in_prompt):
        at = torch.searchsorted(in_prompt, produced).clamp_(max=len(in_prompt) - 1)
        seen = torch.cat([in_prompt, produced[in_prompt[at] != produced]])  # each position once
    else:
        seen = produced
    rep = torch.tensor([p.repetition_penalty for p in params], **column)[seen // vocab]
    values = flat[seen]
    flat[seen] = torch.where(values > 0, values / rep, values * rep)
    owner = produced // vocab
    freq = torch.tensor([p.frequency_penalty for p in params], **column)[owner]
    pres = torch.tensor([p.presence_penalty for p in params], **column)[owner]
    flat[produced] -= freq * counts.to(logits.dtype) + pres


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) each row's tokens whose probability is below ``min_p``
    ([R] float, 0 = off) times that of its most likely token."""
    probs = logits.softmax(dim=-1)
    floor = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < floor, float("-inf"))


_DRAW_BLOCK = 256  # tokens a block of ``draw``'s first search


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Each row's token where its cumulative probability first exceeds
    ``u`` [R] (fp64, in [0, 1)) times the row's total: a draw from ``probs``
    ([R, V], >= 0, any scale), with one number a row where the exponential
    race (``argmax(p / E)``, ``E ~ Exp(1)``) drew one a token: a sampler step
    at temperature 0.8 alone, 64 rows of 49152, took 9.3-10.7 ms against
    64.3-69.2 (bench/results/sampler-cpu-20261207-181108.json and -181207
    against -181039 and -181139). The
    sums run in fp64 in two levels, blocks of ``_DRAW_BLOCK`` tokens and
    then the tokens of the block found, so that no [R, V] fp64 copy is
    made; a token of probability 0 is never drawn (the target is kept
    inside the block's sum, and the search finds the first sum above it)."""
    rows, vocab = probs.shape
    blocks = -(-vocab // _DRAW_BLOCK)
    padded = torch.nn.functional.pad(probs, (0, blocks * _DRAW_BLOCK - vocab)) if vocab % _DRAW_BLOCK else probs
    per_block = padded.view(rows, blocks, _DRAW_BLOCK)
    sums = per_block.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)  # [R, blocks]
    target = u * sums[:, -1]
    block = torch.searchsorted(sums, target.unsqueeze(1), right=True).squeeze(1).clamp_(max=blocks - 1)
    before = torch.where(block > 0, sums.gather(1, (block - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
    inner = per_block[torch.arange(rows, device=probs.device), block].cumsum(dim=-1, dtype=torch.float64)
    last = inner[:, -1]
    within = torch.minimum((target - before).clamp(min=0.0), torch.nextafter(last, torch.zeros_like(last)))
    token = torch.searchsorted(inner, within.unsqueeze(1), right=True).squeeze(1).clamp_(max=_DRAW_BLOCK - 1)
    return (block * _DRAW_BLOCK + token).clamp_(max=vocab - 1)


@dataclass(frozen=True)
class TokenLogprobs:
    """The chosen token's log-probability and the ``k`` most likely tokens', on
    the processed distribution: after logit bias and penalties, temperature
    (greedy rows: none), min-p, top-k and top-p, as vLLM's
    ``processed_logprobs``. Tokens the filters removed have ``-inf``."""

    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass(frozen=True)
class SamplerOutput:
    tokens: list[int]
    logprobs: list[TokenLogprobs | None] | None = None  # per row; None when no row asked


class Sampler:
    """``native_argmax``: a kernel's ``argmax_rows`` (``kiln.compiler.
    cpu_linear``), which greedy steps use where it takes the logits: each
    row's argmax as a list, or None where it does not take them."""

    def __init__(self, device: torch.device, seed: int = 0,
                 native_argmax: Callable[[torch.Tensor], list[int] | None] | None = None) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.native_argmax = native_argmax
        # id(prompt list) -> (the list, its length, prompt_tokens of it): the prompts of the last
        # penalized step, whose lists the scheduler hands over again each step
        self._prompts: dict[int, tuple[Sequence[int], int, torch.Tensor]] = {}

    @staticmethod
    def argmax_only(params: list[SamplingParams], suppressed: Sequence[Sequence[int]] | None = None) -> bool:
        """Whether these rows' tokens are each row's argmax of the raw logits
        and nothing else: all greedy, none asking for logprobs, none with a
        logit bias, a penalty or tokens it may not pick yet."""
        return (all(p.greedy and p.logprobs is None and not p.changes_logits for p in params)
                and not any(suppressed or ()))

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], steps: list[int],
                 histories: Sequence[History | None] | None = None,
                 suppressed: Sequence[Sequence[int]] | None = None) -> SamplerOutput:
        """One token per row of ``logits`` ([R, V], any float dtype). ``steps[i]``
        is how many tokens row i's request has produced so far, ``histories[i]``
        its prompt and output tokens (needed where its penalties read them),
        ``suppressed[i]`` the tokens it may not pick this step. Log-probabilities
        cost nothing unless a row asks for them."""
        if self.argmax_only(params, suppressed):
            # the largest of bf16 values is the largest of their fp32 copies, which
            # a batch-1 bf16 decode step of the demo model made in 0.08 ms
            tokens = self.native_argmax(logits) if self.native_argmax is not None else None
            return SamplerOutput(tokens if tokens is not None else argmax_rows(logits).tolist())
        logits = logits.float()
        if any(p.changes_logits for p in params) or any(suppressed or ()):
            logits = self._change_logits(logits, params, histories, suppressed)
        greedy = [p.greedy for p in params]
        if all(greedy):
            tokens, processed = argmax_rows(logits), logits
        else:
            processed = self._process(logits, params)
            tokens = self._sample(processed.softmax(dim=-1), params, steps)
            if any(greedy):
                tokens = torch.where(torch.tensor(greedy, device=logits.device), argmax_rows(logits), tokens)
        if all(p.logprobs is None for p in params):
            return SamplerOutput(tokens.tolist())
        return SamplerOutput(tokens.tolist(), _logprobs(processed, tokens, params))

    def _change_logits(self, logits: torch.Tensor, params: list[SamplingParams],
                       histories: Sequence[History | None] | None,
                       suppressed: Sequence[Sequence[int]] | None) -> torch.Tensor:
        """``apply_logit_changes``, each prompt's distinct tokens found once
        while its request runs: 64 greedy rows with a repetition penalty,
        8000-token prompts, a 151936-token vocabulary: the sampler's step 24.9
        ms, where the logit changes alone took 81.0 with the prompts' tokens
        found every step (scratch timings, 2026-12-07)."""
        kept: dict[int, tuple[Sequence[int], int, torch.Tensor]] = {}

        def prompt_set(prompt: Sequence[int]) -> torch.Tensor:
            hit = self._prompts.get(id(prompt))
            if hit is None or hit[0] is not prompt or hit[1] != len(prompt):
                hit = (prompt, len(prompt), prompt_tokens(prompt))
            kept[id(prompt)] = hit
            return hit[2]

        changed = apply_logit_changes(logits, params, histories, suppressed, prompt_set)
        self._prompts = kept  # only this step's: finished requests' prompts are let go
        return changed

    @staticmethod
    def _process(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=logits.device)
        logits = logits / temps.unsqueeze(1)
        if any(p.min_p > 0.0 for p in params):
            logits = apply_min_p(logits, torch.tensor([p.min_p for p in params], device=logits.device))
        top_k = top_p = None
        if any(p.top_k > 0 for p in params):
            top_k = torch.tensor([p.top_k for p in params], device=logits.device)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=logits.device)
        if top_k is not None or top_p is not None:
            logits = apply_top_k_top_p(logits, top_k, top_p)
        return logits

    def _sample(self, probs: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> torch.Tensor:
        """A token per row drawn from ``probs`` (``draw``) at one uniform number
        in [0, 1) a row: from the sampler's generator, or for a seeded request
        from a generator of its own seeded by ``(seed, step)``."""
        device = probs.device
        u = torch.zeros(probs.shape[0], dtype=torch.float64, device=device)
        unseeded = [i for i, p in enumerate(params) if p.seed is None and not p.greedy]
        if unseeded:
            u[torch.tensor(unseeded, device=device)] = torch.rand(
                len(unseeded), dtype=torch.float64, device=device, generator=self.generator)
        for i, p in enumerate(params):
            if p.seed is not None and not p.greedy:
                g = torch.Generator(device=device)
                g.manual_seed(_step_seed(p.seed, steps[i]))
                u[i] = torch.rand(1, dtype=torch.float64, device=device, generator=g)[0]
        return draw(probs, u)


def _logprobs(processed: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]
              ) -> list[TokenLogprobs | None]:
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    logp = processed[rows].log_softmax(dim=-1)
    chosen = logp.gather(1, tokens[rows].unsqueeze(1)).squeeze(1).tolist()
    k = max(params[i].logprobs or 0 for i in rows)
    top_values, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    out: list[TokenLogprobs | None] = [None] * len(params)
    for j, i in enumerate(rows):
        n = params[i].logprobs or 0
        out[i] = TokenLogprobs(chosen[j], list(zip(top_ids[j, :n].tolist(), top_values[j, :n].tolist())))
    return out
