"""Tiny seeded checkpoints built with transformers, and transformers itself as the
correctness oracle."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

if TYPE_CHECKING:
    from kiln import Runtime

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Without a GPU the Triton kernels run in Triton's interpreter. It is chosen when
# a kernel is defined, so the variable must be set before kiln's kernels import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Compiled entries of this session live in a private cache: counts of compilations
# asserted here must not depend on what an earlier run left in the user's cache.
_SESSION_CACHE = Path(tempfile.mkdtemp(prefix="kiln-test-cache-"))
os.environ["KILN_CACHE_DIR"] = str(_SESSION_CACHE)

ARCH_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}

BASE = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def load_eager(path: Any, **kwargs: Any) -> "Runtime":
    """Runtime.load at -O0: the runtime tests need no compiler (tests/test_compiler.py has it)."""
    from kiln import Runtime

    kwargs.setdefault("optimization_level", 0)
    return Runtime.load(path, **kwargs)


def build_hf_model(family: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    import transformers

    config_cls, model_cls = (getattr(transformers, n) for n in ARCH_CLASSES[family])
    kwargs = {**BASE, **overrides}
    config = config_cls(**kwargs)
    config.architectures = [model_cls.__name__]
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # transformers initialises biases to zero and norms to one; random values make
    # a loader that drops or swaps them fail the comparison.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def save_checkpoint(
    model: torch.nn.Module,
    path: Path,
    *,
    legacy_rope: bool = False,
    max_shard_size: str | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Save ``model`` as a HF checkpoint; with ``legacy_rope`` the RoPE settings
    are rewritten in the pre-transformers-5 spelling (rope_theta / rope_scaling)."""
    kwargs: dict[str, Any] = {}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(str(path), **kwargs)
    if dtype is not None:
        model.float()
    if legacy_rope:
        cfg_path = path / "config.json"
        cfg = json.loads(cfg_path.read_text())
        params = dict(cfg.pop("rope_parameters"))
        cfg["rope_theta"] = params.pop("rope_theta")
        if params.get("rope_type", "default") != "default":
            params["type"] = params.pop("rope_type")
            cfg["rope_scaling"] = params
        cfg_path.write_text(json.dumps(cfg, indent=2))
    return path


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation by full forward passes: the reference kiln must match."""
    ids = list(prompt)
    out = []
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1]
        tok = int(logits.float().argmax())
        out.append(tok)
        ids.append(tok)
    return out


def random_prompts(n: int, lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """One small Llama shared by the scheduler, sampler and error tests."""
    model = build_hf_model("llama")
    path = save_checkpoint(model, tmp_path_factory.mktemp("llama"))
    return path, model


@pytest.fixture(scope="session")
def demo_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model (built once per session in a private cache dir)."""
    from kiln.demo import ensure_demo_model

    return ensure_demo_model(tmp_path_factory.mktemp("kiln-cache"))
