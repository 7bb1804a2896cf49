"""Checkpoint readers: safetensors (single and sharded) and the weight loader's
errors, which name the file and the tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kiln.checkpoint import CheckpointError, open_checkpoint
from kiln.checkpoint.safetensors import SafetensorsReader, safetensors_files
from kiln.models import build_model, parse_model_config

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 16, "hidden_size": 8, "intermediate_size": 12,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32,
    "tie_word_embeddings": True,
}


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "model.embed_tokens.weight": (16, 8), "model.norm.weight": (8,),
        "model.layers.0.input_layernorm.weight": (8,), "model.layers.0.post_attention_layernorm.weight": (8,),
        "model.layers.0.self_attn.q_proj.weight": (8, 8), "model.layers.0.self_attn.k_proj.weight": (4, 8),
        "model.layers.0.self_attn.v_proj.weight": (4, 8), "model.layers.0.self_attn.o_proj.weight": (8, 8),
        "model.layers.0.mlp.gate_proj.weight": (12, 8), "model.layers.0.mlp.up_proj.weight": (12, 8),
        "model.layers.0.mlp.down_proj.weight": (8, 12),
    }
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def _checkpoint(path: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(CONFIG))
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, path / "model.safetensors")
        return path
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, path / fname)
        weight_map.update({n: fname for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def _load(path: Path) -> torch.nn.Module:
    ckpt = open_checkpoint(path)
    return build_model(parse_model_config(ckpt), ckpt, torch.float32, torch.device("cpu"), 32)


@pytest.mark.parametrize("shards", [1, 3])
def test_reader_lists_lazily_and_loads_every_tensor(tmp_path: Path, shards: int) -> None:
    tensors = _tensors()
    path = _checkpoint(tmp_path / "c", tensors, shards)
    files = safetensors_files(path)
    assert len(files) == shards
    with SafetensorsReader(files) as reader:
        infos = {i.name: i for i in reader.tensors()}
        assert {n: i.shape for n, i in infos.items()} == {n: tuple(t.shape) for n, t in tensors.items()}
        assert all(i.dtype == "F32" and i.file in files for i in infos.values())
        assert torch.equal(reader.get("model.norm.weight"), tensors["model.norm.weight"])
    model = _load(path)
    qkv = model.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(qkv[8:12], tensors["model.layers.0.self_attn.k_proj.weight"])  # merged in order
    assert torch.equal(model.layers[0].mlp.gate_up_proj.weight[12:], tensors["model.layers.0.mlp.up_proj.weight"])


def test_missing_misshaped_and_unexpected_tensors(tmp_path: Path) -> None:
    missing = _tensors()
    del missing["model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*missing.*model\.safetensors"):
        _load(_checkpoint(tmp_path / "missing", missing))
    misshaped = _tensors()
    misshaped["model.layers.0.mlp.down_proj.weight"] = torch.zeros(3, 5)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.down_proj\.weight' has shape \(3, 5\), expected \(8, 12\)"):
        _load(_checkpoint(tmp_path / "misshaped", misshaped))
    unexpected = {**_tensors(), "model.layers.0.self_attn.o_proj.bias": torch.zeros(8)}
    with pytest.raises(CheckpointError, match=r"o_proj\.bias.*config"):
        _load(_checkpoint(tmp_path / "unexpected", unexpected))


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        open_checkpoint(tmp_path / "nope")
    path = _checkpoint(tmp_path / "c", _tensors(), shards=2)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-lost.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="names shard model-lost.safetensors, which is missing"):
        safetensors_files(path)
    (path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json is not a valid safetensors index"):
        safetensors_files(path)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match=r"bad/model\.safetensors is not a readable safetensors file"):
        SafetensorsReader([bad / "model.safetensors"])
    (bad / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"config\.json must hold a JSON object"):
        open_checkpoint(bad).config()
