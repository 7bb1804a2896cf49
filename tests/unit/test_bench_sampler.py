"""bench.sampler's transformers baseline does the step it claims to time."""

from __future__ import annotations

import torch

from bench.sampler import CASES, transformers_step, zipf_logits


def test_the_baseline_step_keeps_to_each_cases_filters() -> None:
    logits = zipf_logits(8, 3000)
    ids = torch.zeros(8, 4, dtype=torch.long)
    assert torch.equal(transformers_step(CASES["greedy"])(ids, logits.clone()), logits.argmax(dim=-1))
    top = logits.topk(50, dim=-1).indices
    for _ in range(5):
        tokens = transformers_step(CASES["top-k 50"])(ids, logits.clone())
        assert bool((top == tokens.unsqueeze(1)).any(dim=1).all())
    assert transformers_step(CASES["temperature 0.8, seeded"]) is None  # no per-request seeds there
    assert transformers_step(CASES["greedy + penalties"]) is None  # nor OpenAI's penalties
