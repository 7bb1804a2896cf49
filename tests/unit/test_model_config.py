"""config.json parsing: both RoPE spellings, RoPE math against transformers,
per-architecture rules, and errors that name the file and the field."""

from __future__ import annotations

import pytest
import torch

from kiln.checkpoint import CheckpointError
from kiln.models import config_from_dict

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
    old = config_from_dict(
        {**BASE, "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", "factor": 8.0,
         "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}}
    )
    new = config_from_dict(
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
    mine = config_from_dict({**BASE, "rope_parameters": dict(params)})
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
        config_from_dict({**BASE, "rope_scaling": {"type": "dynamic", "factor": 2.0}})


def test_missing_required_field() -> None:
    cfg = dict(BASE)
    del cfg["hidden_size"]
    with pytest.raises(CheckpointError, match="hidden_size"):
        config_from_dict(cfg)


def test_qwen_sliding_window_only_when_enabled() -> None:
    qwen = {**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32, "max_window_layers": 1}
    assert config_from_dict(qwen).sliding_windows == (0, 0)
    assert config_from_dict({**qwen, "use_sliding_window": True}).sliding_windows == (0, 32)
    mistral = {**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    assert config_from_dict(mistral).sliding_windows == (4096, 4096)


def test_architecture_rules() -> None:
    llama = config_from_dict({**BASE, "attention_bias": True, "mlp_bias": True})
    assert (llama.qkv_bias, llama.o_proj_bias, llama.mlp_bias, llama.qk_norm) == (True, True, True, False)
    qwen2 = config_from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    assert (qwen2.qkv_bias, qwen2.o_proj_bias, qwen2.mlp_bias) == (True, False, False)
    qwen3 = config_from_dict({**BASE, "architectures": ["Qwen3ForCausalLM"]})
    assert qwen3.qk_norm and not qwen3.qkv_bias
    mistral = config_from_dict({**BASE, "architectures": ["MistralForCausalLM"], "attention_bias": True})
    assert not mistral.qkv_bias and not mistral.o_proj_bias


def test_model_type_names_the_architecture_when_architectures_is_missing() -> None:
    cfg = {k: v for k, v in BASE.items() if k != "architectures"}
    assert config_from_dict({**cfg, "model_type": "qwen3"}).architecture == "Qwen3ForCausalLM"
    with pytest.raises(CheckpointError, match="'gpt2'.*not supported"):
        config_from_dict({**cfg, "model_type": "gpt2"})


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("hidden_size", "64", r"field 'hidden_size' must be an integer >= 1, got '64'"),
        ("num_attention_heads", 4.5, r"field 'num_attention_heads' must be an integer"),
        ("num_hidden_layers", True, r"field 'num_hidden_layers' must be an integer"),
        ("rms_norm_eps", "tiny", r"field 'rms_norm_eps' must be a number, got 'tiny'"),
        ("tie_word_embeddings", "yes", r"field 'tie_word_embeddings' must be true or false"),
        ("vocab_size", -3, r"field 'vocab_size' must be an integer >= 1, got -3"),
        ("rope_theta", [1], r"field 'rope_theta' must be a number"),
        ("sliding_window", "x", r"field 'sliding_window' must be an integer"),
        ("eos_token_id", "2", r"field 'eos_token_id' must be a token id"),
        ("torch_dtype", "int8", r"torch_dtype.*not supported"),
        ("architectures", "LlamaForCausalLM", r"field 'architectures' must be a list"),
        ("rope_scaling", 3, r"must be an object"),
    ],
)
def test_wrong_types_name_the_file_and_the_field(field, value, expected) -> None:
    with pytest.raises(CheckpointError, match=r"ckpt/config\.json.*" + expected):
        config_from_dict({**BASE, field: value}, "ckpt/config.json")
