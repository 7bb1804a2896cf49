"""Greedy tokens equal transformers' for the four families and their config variants."""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln import Runtime, SamplingParams
from tests.conftest import load_eager
from tests.conftest import build_hf_model, hf_greedy, random_prompts, save_checkpoint

# name -> (family, config overrides, save options)
VARIANTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # GQA, untied, default RoPE written the old way (rope_theta at top level)
    "llama-gqa-legacy-rope": ("llama", {"rope_theta": 5000.0}, {"legacy_rope": True}),
    # MQA, tied embeddings, llama3 RoPE scaling, sharded safetensors with an index
    "llama-mqa-tied-llama3-sharded": (
        "llama",
        {
            "num_key_value_heads": 1,
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
        {"max_shard_size": "40KB"},
    ),
    # linear RoPE scaling in the old spelling; multi-head (no grouping)
    "llama-mha-linear-legacy": (
        "llama",
        {"num_key_value_heads": 4, "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
        {"legacy_rope": True},
    ),
    # head_dim apart from hidden_size / heads, and a sliding window shorter than the prompts
    "mistral-headdim-sliding": ("mistral", {"head_dim": 32, "sliding_window": 8}, {}),
    "mistral-no-window": ("mistral", {"sliding_window": None}, {}),
    # qkv bias, tied embeddings, YaRN as Qwen2.5 long-context checkpoints spell it
    "qwen2-bias-tied-yarn-legacy": (
        "qwen2",
        {
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
        {"legacy_rope": True},
    ),
    # q/k RMSNorm, head_dim apart from hidden_size / heads, MQA
    "qwen3-qknorm-headdim": ("qwen3", {"head_dim": 32, "num_key_value_heads": 1}, {}),
    "qwen3-tied-bias-sharded": (
        "qwen3", {"tie_word_embeddings": True, "attention_bias": True}, {"max_shard_size": "60KB"}
    ),
    # Llama with biases on attention and MLP projections
    "llama-attention-and-mlp-bias": ("llama", {"attention_bias": True, "mlp_bias": True}, {}),
}

PROMPT_LENGTHS = [5, 17, 30]
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    family, overrides, save_opts = VARIANTS[request.param]
    model = build_hf_model(family, seed=zlib.crc32(request.param.encode()) % 1000, **overrides)
    path = save_checkpoint(model, tmp_path_factory.mktemp(request.param), **save_opts)
    return request.param, path, model


def test_greedy_matches_transformers(variant) -> None:
    name, path, model = variant
    prompts = random_prompts(3, PROMPT_LENGTHS, model.config.vocab_size, seed=1)
    expected = [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
    rt = load_eager(path)
    outs = rt.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    for i, (out, ref) in enumerate(zip(outs, expected)):
        assert out.token_ids == ref, f"{name}: prompt {i} diverged"
        assert out.finish_reason == "length"
        assert out.prompt_token_ids == prompts[i]


def test_variant_files_are_what_they_claim(variant) -> None:
    """Guard the fixtures themselves: the spelling and sharding each variant tests."""
    name, path, _ = variant
    cfg = json.loads((path / "config.json").read_text())
    if "legacy" in name:
        assert "rope_theta" in cfg and "rope_parameters" not in cfg
    else:
        assert "rope_parameters" in cfg
    if "sharded" in name:
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1


def _roundtrip_dtype(tmp_path: Path, save_dtype: torch.dtype) -> tuple[Path, torch.nn.Module]:
    model = build_hf_model("qwen2", seed=3)
    path = save_checkpoint(model, tmp_path / str(save_dtype), dtype=save_dtype)
    # the oracle runs the same (rounded) weights in fp32
    model.to(save_dtype).float()
    return path, model


def test_fp16_checkpoint_runs_in_fp32_on_cpu(tmp_path: Path) -> None:
    path, model = _roundtrip_dtype(tmp_path, torch.float16)
    rt = load_eager(path)
    assert rt.startup_report["dtype"] == "float32"
    prompt = random_prompts(1, [9], model.config.vocab_size, seed=4)[0]
    out = rt.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(model, prompt, 8)


def test_bf16_checkpoint_keeps_bf16_and_close_to_fp32(tmp_path: Path) -> None:
    path, model = _roundtrip_dtype(tmp_path, torch.bfloat16)
    rt16 = load_eager(path)
    assert rt16.startup_report["dtype"] == "bfloat16"
    assert rt16.engine.runner.kv_caches[0].dtype == torch.bfloat16
    rt32 = load_eager(path, dtype="float32")
    assert rt32.startup_report["dtype"] == "float32"
    prompt = random_prompts(1, [9], model.config.vocab_size, seed=5)[0]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert rt32.generate(prompt, params)[0].token_ids == hf_greedy(model, prompt, 6)
    # bf16 arithmetic differs from fp32; the first greedy token is robust to it here
    assert rt16.generate(prompt, params)[0].token_ids[0] == rt32.generate(prompt, params)[0].token_ids[0]


def _same_until_a_tie(got, want, margin: float) -> bool:
    """``got``'s tokens equal ``want``'s, or leave them only at a step where
    ``want``'s two best log-probabilities are within ``margin`` of each other
    (in bf16 a summation order decides such a tie) and ``got`` took the other."""
    for step, (g, w) in enumerate(zip(got.token_ids, want.token_ids)):
        if g == w:
            continue
        best = dict(want.logprobs[step].top[:2])
        return {g, w} == set(best) and abs(best[g] - best[w]) <= margin
    return len(got.token_ids) == len(want.token_ids)


def test_bf16_compiled_pieces_give_the_eager_tokens(tmp_path: Path) -> None:
    """bf16 at -O2: the few-token pieces and the LM head call the C linear kernel
    (fp32 sums, one rounding, as the eager bf16 matrix products), at one, two
    and three requests and for prompts of 5 to 14 tokens (the size-1 piece, the
    few-row one, the range). Its sums run in another order than oneDNN's, so a
    step where eager's two best tokens tie within bf16's rounding may go
    either way."""
    path, model = _roundtrip_dtype(tmp_path, torch.bfloat16)
    prompts = random_prompts(3, [9, 5, 14], model.config.vocab_size, seed=6)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    eager = load_eager(path).generate(prompts, params)
    rt = Runtime.load(path, optimization_level=2, compile_sizes=[1, 2], cache_dir=tmp_path / "cache")
    assert rt.startup_report["dtype"] == "bfloat16"
    tie = 0.05  # log-probability: 2**-7 of a logit of about 6
    for got in ([rt.generate([p], params)[0] for p in prompts], rt.generate(prompts[:2], params),
                rt.generate(prompts, params)):
        assert all(_same_until_a_tie(g, w, tie) for g, w in zip(got, eager, strict=False))