"""Bad input fails early, with an error naming the file, tensor, prompt or field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln import Runtime, SamplingParams
from tests.conftest import load_eager
from kiln.checkpoint import CheckpointError


@pytest.fixture()
def broken_copy(llama_checkpoint, tmp_path: Path) -> Path:
    dest = tmp_path / "ckpt"
    shutil.copytree(llama_checkpoint[0], dest)
    return dest


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does-not-exist.*does not exist"):
        load_eager(tmp_path / "does-not-exist")


def test_missing_config(broken_copy: Path) -> None:
    (broken_copy / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json is missing"):
        load_eager(broken_copy)


def test_unsupported_architecture_lists_supported(broken_copy: Path) -> None:
    cfg = json.loads((broken_copy / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (broken_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel.*LlamaForCausalLM.*MistralForCausalLM.*Qwen2ForCausalLM.*Qwen3ForCausalLM"):
        load_eager(broken_copy)


def test_missing_tensor_names_file_and_tensor(broken_copy: Path) -> None:
    f = broken_copy / "model.safetensors"
    tensors = load_file(f)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*missing.*model\.safetensors"):
        load_eager(broken_copy)


def test_misshaped_tensor_names_file_and_tensor(broken_copy: Path) -> None:
    f = broken_copy / "model.safetensors"
    tensors = load_file(f)
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(3, 5)
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*model\.layers\.0\.mlp\.down_proj\.weight.*\(3, 5\)"):
        load_eager(broken_copy)


def test_unexpected_tensor_is_an_error(broken_copy: Path) -> None:
    f = broken_copy / "model.safetensors"
    tensors = load_file(f)
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"o_proj\.bias.*config"):
        load_eager(broken_copy)


def test_no_weights(broken_copy: Path) -> None:
    (broken_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no safetensors weights"):
        load_eager(broken_copy)


def test_corrupt_weights_file(broken_copy: Path) -> None:
    (broken_copy / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_eager(broken_copy)


def test_unknown_optimization_level(llama_checkpoint) -> None:
    with pytest.raises(ValueError, match="optimization_level=7"):
        load_eager(llama_checkpoint[0], optimization_level=7)


def test_unknown_option(llama_checkpoint) -> None:
    with pytest.raises(TypeError, match="not_an_option"):
        load_eager(llama_checkpoint[0], not_an_option=1)


@pytest.fixture(scope="module")
def rt(llama_checkpoint) -> Runtime:
    return load_eager(llama_checkpoint[0], max_model_len=32)


@pytest.mark.parametrize(
    "prompts, params, match",
    [
        ([[1, 2], list(range(40))], None, r"prompt 1 has 40 tokens; max_model_len=32"),
        ([[1, 2], []], None, "prompt 1 is empty"),
        ([[1, 2], "", [3]], None, "prompt 1 is empty"),
        ([[1, 2], [3, 384]], None, r"prompt 1: token id 384 is outside the vocabulary \[0, 384\)"),
        ([[1, 2], [-1]], None, r"prompt 1: token id -1"),
        ([[1, 2], [1.5]], None, "prompt 1 must be a string or a list of token ids"),
        ([[1, 2]], SamplingParams(temperature=-0.5), r"params\[0\]\.temperature"),
        ([[1, 2]], SamplingParams(top_p=0.0), r"params\[0\]\.top_p"),
        ([[1, 2]], SamplingParams(top_p=1.5), r"params\[0\]\.top_p"),
        ([[1, 2]], SamplingParams(max_tokens=0), r"params\[0\]\.max_tokens"),
        ([[1, 2]], SamplingParams(top_k=-2), r"params\[0\]\.top_k"),
        ([[1, 2], [3]], [SamplingParams(), SamplingParams(max_tokens=-3)], r"params\[1\]\.max_tokens"),
        ([[1, 2], [3]], [SamplingParams()], "got 1 SamplingParams for 2 prompts"),
    ],
)
def test_generate_validates_everything_before_scheduling(rt: Runtime, prompts, params, match) -> None:
    with pytest.raises(ValueError, match=match):
        rt.generate(prompts, params)
    assert not rt.has_unfinished()  # nothing was queued
    assert rt.engine.scheduler.kv.usage == 0.0


def test_text_prompt_without_tokenizer(rt: Runtime) -> None:
    with pytest.raises(ValueError, match="no tokenizer"):
        rt.generate("hello")


def test_max_model_len_larger_than_the_cache(llama_checkpoint) -> None:
    with pytest.raises(ValueError, match="max_model_len=200"):
        load_eager(llama_checkpoint[0], max_model_len=200, num_kv_blocks=4, block_size=16)
