"""config.json parsing: both RoPE spellings, RoPE math against transformers."""

from __future__ import annotations

import pytest
import torch

from kiln.runtime.model_config import CheckpointError, ModelConfig

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}


def test_both_rope_spellings_give_the_same_config() -> None:
    old = ModelConfig.from_dict(
        {**BASE, "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", "factor": 8.0,
         "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}}
    )
    new = ModelConfig.from_dict(
        {**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
         "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}}
    )
    assert old == new
    assert new.rope.rope_type == "llama3" and new.rope.theta == 500000.0


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
        {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 1024},
    ],
)
def test_inv_freq_matches_transformers(params) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = LlamaConfig(**{k: v for k, v in BASE.items() if k != "architectures"}, rope_parameters=dict(params))
    mine = ModelConfig.from_dict({**BASE, "rope_parameters": dict(params)})
    inv, scale = mine.rope.inv_freq_and_scale(mine.head_dim, mine.max_position_embeddings)
    if params["rope_type"] == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        ref, ref_scale = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_cfg)
    else:
        ref, ref_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_cfg, "cpu")
    torch.testing.assert_close(inv, ref, rtol=0, atol=0)
    assert scale == pytest.approx(ref_scale)


def test_unsupported_rope_type() -> None:
    with pytest.raises(CheckpointError, match="dynamic.*not supported"):
        ModelConfig.from_dict({**BASE, "rope_scaling": {"type": "dynamic", "factor": 2.0}})


def test_missing_required_field() -> None:
    cfg = dict(BASE)
    del cfg["hidden_size"]
    with pytest.raises(CheckpointError, match="hidden_size"):
        ModelConfig.from_dict(cfg)


def test_qwen_sliding_window_only_when_enabled() -> None:
    qwen = {**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32, "max_window_layers": 1}
    assert ModelConfig.from_dict(qwen).sliding_windows == (0, 0)
    assert ModelConfig.from_dict({**qwen, "use_sliding_window": True}).sliding_windows == (0, 32)
    mistral = {**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    assert ModelConfig.from_dict(mistral).sliding_windows == (4096, 4096)
