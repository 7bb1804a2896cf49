"""The engine core with a stub model through the real runner: requests in, plain
data out, finish reasons, aborts, preemption and stats."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kiln.attention.torch_backend import TorchAttentionBackend
from kiln.checkpoint import CheckpointReader
from kiln.engine.kv_cache_manager import KVCacheManager
from kiln.engine.core import Engine
from kiln.engine.request import SamplingParams
from kiln.engine.runner import ModelRunner
from kiln.engine.scheduler import Scheduler
from kiln.models import CausalLM

VOCAB = 32


class NextTokenModel(CausalLM):
    """Predicts ``(token + position) % VOCAB`` for each token: outputs depend on
    the positions the runner computes, and a recomputed prefix gives the same."""

    def __init__(self) -> None:
        super().__init__()
        self.eye = torch.nn.Parameter(torch.eye(VOCAB), requires_grad=False)
        self.config = SimpleNamespace(vocab_size=VOCAB)  # what the runner reads of a ModelConfig

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return F.one_hot((input_ids + positions) % VOCAB, VOCAB).float()

    def logits_weight(self) -> torch.Tensor:
        return self.eye

    def load_weights(self, reader: CheckpointReader) -> None:
        """Its one weight, the identity LM head, is built in."""

    def reset_buffers(self) -> None:
        """No buffers to compute."""


def expected(prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append((ids[-1] + len(ids) - 1) % VOCAB)
    return ids[len(prompt):]


def make_engine(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8, budget: int = 32,
                max_model_len: int = 64, eos: tuple[int, ...] = (), caching: bool = True,
                vocab_bytes=None) -> Engine:
    runner = ModelRunner(NextTokenModel(), [], TorchAttentionBackend(), block_size=block_size,
                         max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                         device=torch.device("cpu"))
    scheduler = Scheduler(KVCacheManager(num_blocks, block_size, caching), max_num_seqs, budget, max_model_len)
    return Engine(scheduler, runner, vocab_size=VOCAB, eos_token_ids=eos, vocab_bytes=vocab_bytes)


def run(engine: Engine) -> dict:
    tokens: dict = {}
    reasons: dict = {}
    while engine.has_unfinished():
        for out in engine.step().outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    return {rid: (tokens[rid], reasons[rid]) for rid in tokens}


def test_outputs_are_plain_data_per_request() -> None:
    engine = make_engine()
    prompts = {"a": [1, 2, 3], "b": [5] * 11, "c": [7, 8]}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=6, temperature=0))
    results = run(engine)
    assert results == {rid: (expected(p, 6), "length") for rid, p in prompts.items()}
    stats = engine.stats()
    assert stats.generated_tokens == 18 and stats.num_running == stats.num_waiting == 0
    assert stats.kv_cache_usage == 0.0  # every block came back
    assert stats.scheduled_tokens == 3 + 11 + 2 + 3 * 5


def test_finish_reasons() -> None:
    prompt = [1, 2, 3]
    free = expected(prompt, 8)
    engine = make_engine(eos=(free[2],))
    engine.add_request(0, prompt, SamplingParams(max_tokens=8, temperature=0))
    engine.add_request(1, prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                 stop_token_ids=[free[4]]))
    engine.add_request(2, prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    results = run(engine)
    assert results[0] == (free[:3], "stop")
    assert results[1] == (free[:5], "stop")
    assert results[2] == (free, "length")
    short = make_engine(max_model_len=8)
    short.add_request(0, prompt, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    assert run(short)[0] == (expected(prompt, 5), "length")  # 3 + 5 = max_model_len


def test_abort_frees_blocks_before_the_next_step() -> None:
    engine = make_engine(num_blocks=8)
    engine.add_request("x", [1] * 9, SamplingParams(max_tokens=20, temperature=0))
    engine.add_request("y", [2] * 5, SamplingParams(max_tokens=3, temperature=0))
    engine.step()
    assert engine.stats().kv_cache_usage > 0
    engine.abort(["x", "missing"])  # unknown ids are ignored
    assert engine.stats().num_running == 1
    results = run(engine)
    assert set(results) == {"y"} and engine.stats().kv_cache_usage == 0.0


def test_preemption_under_a_tight_cache_loses_nothing() -> None:
    prompts = {i: [i + 1] * (3 + 2 * i) for i in range(5)}
    roomy = make_engine()
    tight = make_engine(num_blocks=7, block_size=4, budget=8, max_num_seqs=4)
    for engine in (roomy, tight):
        for rid, p in prompts.items():
            engine.add_request(rid, p, SamplingParams(max_tokens=7, temperature=0))
    assert run(tight) == run(roomy)
    assert tight.stats().num_preemptions > 0 and roomy.stats().num_preemptions == 0


def test_bad_requests_are_refused_before_queueing() -> None:
    engine = make_engine(max_model_len=16)
    engine.add_request("dup", [1], SamplingParams())
    with pytest.raises(ValueError, match="request id 'dup' is already in use"):
        engine.add_request("dup", [1], SamplingParams())
    with pytest.raises(ValueError, match=r"prompt: token id 32 is outside the vocabulary \[0, 32\)"):
        engine.add_request("v", [1, 32], SamplingParams())
    with pytest.raises(ValueError, match="prompt has 16 tokens; max_model_len=16"):
        engine.add_request("long", [1] * 16, SamplingParams())
    with pytest.raises(ValueError, match=r"SamplingParams\.top_p"):
        engine.add_request("p", [1], SamplingParams(top_p=0))
    assert engine.stats().num_waiting == 1


def test_the_profiling_run_takes_the_samplers_buffers() -> None:
    """A GPU load sizes its KV cache from the peak memory of a profiling run,
    which takes the sampler's buffers for the largest step's logits too."""
    engine = make_engine(max_num_seqs=8, budget=32)
    runner = engine.runner
    runner.profile_run()
    for index in (0, 1):
        buffer = runner.sampler.workspace._buffers[index]
        assert buffer is not None and buffer.numel() == 8 * VOCAB
