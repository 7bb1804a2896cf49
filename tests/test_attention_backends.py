"""Choosing the attention backend, and whole generations through the Triton one.

On a CPU-only machine the Triton kernels run in Triton's interpreter (conftest
sets TRITON_INTERPRET=1), which is slow: the models here are tiny and the
generations short. The kernels themselves are tested against a dense reference in
tests/test_triton_kernels.py.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from kiln import SamplingParams
from kiln.config import CUDAGraphSupport
from kiln.attention.backend import create_attention_backend, resolve_attention_backend
from kiln.attention.torch_backend import TorchAttentionBackend
from kiln.attention.triton_backend import TritonAttentionBackend
from tests.conftest import build_hf_model, hf_greedy, load_eager, random_prompts, save_checkpoint

CPU = torch.device("cpu")
CUDA = torch.device("cuda")

# family -> config overrides: GQA, MQA with a split head_dim, a sliding window
# shorter than the prompts, and q/k norm, one per family
FAMILIES = {
    "llama": {},
    "mistral": {"head_dim": 32, "sliding_window": 8},
    "qwen2": {"num_key_value_heads": 1},
    "qwen3": {"head_dim": 32},
}


def test_auto_is_torch_on_cpu_and_triton_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KILN_ATTENTION_BACKEND", raising=False)
    assert resolve_attention_backend(None, CPU) == "torch"
    assert resolve_attention_backend("auto", CPU) == "torch"
    assert resolve_attention_backend("auto", CUDA) == "triton"
    assert resolve_attention_backend("torch", CUDA) == "torch"


def test_environment_variable_and_explicit_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    # Triton runs on a GPU, or on CPU under the interpreter (conftest sets it there)
    device = CUDA if torch.cuda.is_available() else CPU
    monkeypatch.setenv("KILN_ATTENTION_BACKEND", "Triton")
    assert resolve_attention_backend(None, device) == "triton"
    assert resolve_attention_backend("torch", device) == "torch"  # the argument wins
    monkeypatch.setenv("KILN_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match="KILN_ATTENTION_BACKEND='flash'"):
        resolve_attention_backend(None, CPU)
    with pytest.raises(ValueError, match="attention_backend='cudnn'"):
        resolve_attention_backend("cudnn", CPU)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_attention_backend("triton", CPU)


def test_backends_declare_cuda_graph_support() -> None:
    assert TorchAttentionBackend.cudagraph_support is CUDAGraphSupport.NEVER
    assert TritonAttentionBackend.cudagraph_support is CUDAGraphSupport.ALWAYS
    assert create_attention_backend("torch").name == "torch"
    with pytest.raises(ValueError, match="no attention backend 'auto'"):
        create_attention_backend("auto")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_triton_backend_generates_what_transformers_does(family: str, tmp_path) -> None:
    model = build_hf_model(family, seed=zlib.crc32(family.encode()) % 1000, **FAMILIES[family])
    path = save_checkpoint(model, tmp_path / family)
    prompts = random_prompts(3, [5, 19, 11], model.config.vocab_size, seed=2)
    expected = [hf_greedy(model, p, 5) for p in prompts]
    # a token budget below the longest prompt: chunked prefill over a cached prefix,
    # mixed in one batch with other requests' decodes
    rt = load_eager(path, attention_backend="triton", max_num_batched_tokens=16, block_size=8)
    assert rt.startup_report["attention_backend"] == "triton"
    outs = rt.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    assert rt.engine.scheduler.num_preemptions == 0


def test_startup_report_names_the_torch_backend(llama_checkpoint) -> None:
    path, _ = llama_checkpoint
    rt = load_eager(path, attention_backend="torch")
    assert rt.startup_report["attention_backend"] == "torch"
    assert isinstance(rt.engine.runner.attention_backend, TorchAttentionBackend)
