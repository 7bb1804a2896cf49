"""Resolving the configuration: levels, engine sizes, and options checked before
anything loads."""

from __future__ import annotations

import logging

import pytest
import torch

from kiln import CompilationConfig, CUDAGraphMode
from kiln.config import EngineConfig
from kiln.engine.config import kv_bytes_per_block, resolve_engine_sizes
from kiln.engine.loader import parse_options
from kiln.models import config_from_dict

CPU = torch.device("cpu")
MODEL = config_from_dict({
    "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
})


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_explicit_settings_survive_every_level(level) -> None:
    cfg = CompilationConfig(level=level, compile_sizes=[3, 5], cudagraph_mode="PIECEWISE",
                            inductor_options={"max_autotune": False}, cudagraph_capture_sizes=[1, 2])
    resolved = cfg.resolve(device_type="cuda", max_num_seqs=8, max_num_batched_tokens=64)
    assert resolved.compile_sizes == (3, 5)
    assert resolved.cudagraph_mode is CUDAGraphMode.PIECEWISE
    assert resolved.cudagraph_capture_sizes == (1, 2)
    assert resolved.inductor_options == {"max_autotune": False}
    defaults = CompilationConfig(level=level).resolve(device_type="cuda", max_num_seqs=8, max_num_batched_tokens=64)
    assert defaults.compile_sizes == {0: (), 1: (), 2: (1, 2, 4, 8), 3: (1, 2, 4, 8)}[level]
    assert defaults.cudagraph_capture_sizes == (1, 2, 4, 8, 16)
    assert defaults.inductor_options.get("max_autotune", False) == (level == 3)
    on_cpu = cfg.resolve(device_type="cpu", max_num_seqs=8, max_num_batched_tokens=64)
    assert on_cpu.cudagraph_mode is CUDAGraphMode.NONE and on_cpu.compile_sizes == (3, 5)
    # on CPU the level's exact sizes stop where small-batch linears stop being reductions
    cpu_defaults = CompilationConfig(level=level).resolve(device_type="cpu", max_num_seqs=8, max_num_batched_tokens=64)
    assert cpu_defaults.compile_sizes == {0: (), 1: (), 2: (1, 2, 4), 3: (1, 2, 4)}[level]


def test_frozen_configs_cannot_change_after_resolution() -> None:
    resolved = CompilationConfig(level=2).resolve(device_type="cpu", max_num_seqs=8, max_num_batched_tokens=64)
    with pytest.raises(AttributeError):
        resolved.compile_sizes = (1,)  # type: ignore[misc]
    with pytest.raises(AttributeError):
        EngineConfig().seed = 3  # type: ignore[misc]


def test_a_small_kv_cache_caps_max_model_len_with_a_warning(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="kiln.engine.config"):
        sizes = resolve_engine_sizes(EngineConfig(num_kv_blocks=1, block_size=16), MODEL, torch.float32, CPU)
    assert sizes.max_model_len == 16 and sizes.num_kv_blocks == 1
    assert "max_model_len capped at 16 tokens (the checkpoint allows 1024)" in caplog.text
    with pytest.raises(ValueError, match="max_model_len=64 needs 4 KV blocks of 16 tokens, the cache holds 1"):
        resolve_engine_sizes(EngineConfig(num_kv_blocks=1, block_size=16, max_model_len=64), MODEL, torch.float32, CPU)


def test_memory_budget_sizes_the_cache() -> None:
    per_block = kv_bytes_per_block(MODEL, 16, torch.float32)
    assert per_block == 2 * 2 * 16 * 2 * 16 * 4
    sizes = resolve_engine_sizes(EngineConfig(kv_cache_memory_bytes=10 * per_block + 5), MODEL, torch.float32, CPU)
    assert sizes.num_kv_blocks == 10 and sizes.max_model_len == 160
    # never more than every sequence at full length needs
    sizes = resolve_engine_sizes(EngineConfig(max_num_seqs=2, max_model_len=64), MODEL, torch.float32, CPU)
    assert sizes.num_kv_blocks == 2 * 4
    with pytest.raises(ValueError, match="holds no block"):
        resolve_engine_sizes(EngineConfig(kv_cache_memory_bytes=per_block - 1), MODEL, torch.float32, CPU)


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"seed": "abc"}, ValueError, "seed must be an integer, got 'abc'"),
        ({"max_num_seqs": 0}, ValueError, "max_num_seqs must be a positive integer, got 0"),
        ({"max_model_len": 12.5}, ValueError, "max_model_len must be a positive integer"),
        ({"gpu_memory_utilization": 1.5}, ValueError, "gpu_memory_utilization must be in"),
        ({"optimization_level": 5}, ValueError, "optimization_level=5"),
        ({"dtype": "int4"}, ValueError, "dtype 'int4' is not supported"),
        ({"device": "tpu"}, ValueError, "device='tpu' is not a device"),
        ({"device": "meta"}, ValueError, "device='meta' is not supported"),
        ({"compile_sizes": "1,2"}, ValueError, "compile_sizes must be a list of positive token counts"),
        ({"cudagraph_mode": "SOMETIMES"}, ValueError, "cudagraph_mode='SOMETIMES' is not one of"),
        ({"on_mismatch": "ignore"}, ValueError, "on_mismatch must be 'error' or 'recompile'"),
        ({"attention_backend": "flash"}, ValueError, "attention_backend='flash'"),
        ({"not_an_option": 1}, TypeError, "not_an_option"),
    ],
)
def test_options_are_checked_before_anything_loads(options, error, match, tmp_path) -> None:
    # the path does not exist: an option error must come first
    with pytest.raises(error, match=match):
        parse_options(tmp_path / "no-model", **options)
