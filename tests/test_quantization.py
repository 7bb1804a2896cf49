"""Packed (weight-only quantized) linear layers through the whole runtime:
``quantization="int8"`` against transformers running the same int8-rounded
weights, ``quantization="gguf"`` against kiln's dequantized model of the same
file, compiled against eager, and the options' errors. The ``-a8`` modes also
round the packed layers' inputs to int8 per 32 elements
(``round_activations``): their reference rounds the inputs of the same layers,
so that it computes the same function in plain fp32."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from kiln import Runtime, SamplingParams
from kiln.models.quant import QuantizedLinear, quantize_int8, round_activations
from tests.conftest import build_hf_model, hf_greedy, kiln_cli, load_eager, random_prompts, save_checkpoint
from tests.unit.test_gguf import hf_to_gguf, quantize, write_gguf

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
# GGUF tensor name pattern -> stored type, as llama.cpp's mixed files are: attention in
# Q4_0, the MLP in Q4_1, the output matrix in Q8_0; norms stay F32.
STORED = {"attn_q.": QT.Q4_0, "attn_k.": QT.Q4_0, "attn_v.": QT.Q4_0, "attn_output.": QT.Q4_0,
          "ffn_": QT.Q4_1, "output.weight": QT.Q8_0, "token_embd.": QT.Q8_0}


def _round_inputs(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """A forward pre-hook: the layer's input rounded as a packed layer rounds it."""
    x = args[0]
    return (round_activations(x, x.shape[-1]).to(x.dtype), *args[1:])


def _round_like(dense: Runtime, packed: Runtime) -> Runtime:
    """``dense`` made to round the inputs of every layer ``packed`` keeps
    packed, LM head included: the dequantized model computing what the packed
    one computes."""
    model, packed_model = dense.engine.runner.model, packed.engine.runner.model
    names = [n for n, m in packed_model.named_modules() if isinstance(m, QuantizedLinear) and n != "packed_head"]
    assert names
    for name in names:
        model.get_submodule(name).register_forward_pre_hook(_round_inputs)
    if packed_model.packed_head is not None:
        runner, head = dense.engine.runner, dense.engine.runner.compute_logits
        runner.compute_logits = lambda h: head(_round_inputs(runner, (h,))[0])
    return dense


def _tokens(rt: Runtime, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of each prompt, then of two and of all at once: alone, each
    decode step is one token (compiled: the size-1 piece's unpacking reduction,
    and the C linear kernel as the LM head); in pairs, two (the size-2 piece
    calls the C kernel); together, three (the range piece: dequantize, then
    linear)."""
    alone = [rt.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert [o.token_ids for o in rt.generate(prompts[:2], GREEDY)] == alone[:2]
    together = [o.token_ids for o in rt.generate(prompts, GREEDY)]
    assert together == alone
    return alone


@pytest.fixture(scope="module")
def int8_case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]], list[list[int]]]:
    """A Llama checkpoint, prompts, and transformers' greedy tokens with every
    linear weight replaced by its per-row int8 rounding (what kiln packs)."""
    model = build_hf_model("llama", seed=3)
    path = save_checkpoint(model, tmp_path_factory.mktemp("int8"))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                q = quantize_int8(module.weight)
                module.weight.copy_(q.values.float() * q.scales)
    prompts = random_prompts(3, [5, 9, 17], model.config.vocab_size, seed=3)
    return path, prompts, [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]


@pytest.mark.parametrize("level", [0, 2])
def test_int8_equals_transformers_on_the_int8_rounded_weights(int8_case, level: int, tmp_path: Path) -> None:
    path, prompts, expected = int8_case
    rt = Runtime.load(path, optimization_level=level, quantization="int8", cache_dir=tmp_path,
                      compile_sizes=[1, 2])
    assert _tokens(rt, prompts) == expected
    report = rt.startup_report
    assert report["quantization"] == "int8"
    assert report["packed_layers"] == {"int8": 2 * 4 + 1}  # 4 linears per layer and the LM head
    # its own compile-cache entry: the packed graphs differ from the dense model's
    assert rt.config.cache_factors() != dataclasses.replace(rt.config, quantization=None).cache_factors()


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama GGUF stored as STORED says (its Q/K rows permuted as llama.cpp writes them)."""
    model = build_hf_model("llama", seed=5)
    meta, tensors = hf_to_gguf(model, "llama")
    stored = []
    for name, value, _ in tensors:
        qtype = next((t for key, t in STORED.items() if key in name), QT.F32)
        stored.append((name, *quantize(value, qtype)) if value.ndim == 2 else (name, value, None))
    return write_gguf(tmp_path_factory.mktemp("gguf") / "mixed.gguf", "llama", meta, stored)


def test_gguf_blocks_kept_packed_give_the_dequantized_models_tokens(mixed_gguf: Path, tmp_path: Path) -> None:
    prompts = random_prompts(3, [4, 11, 19], 384, seed=8)
    dense = _tokens(load_eager(mixed_gguf), prompts)
    packed = load_eager(mixed_gguf, quantization="gguf")
    assert packed.startup_report["packed_layers"] == {"q4": 2 * 4, "q8_0": 1}
    assert _tokens(packed, prompts) == dense
    compiled = Runtime.load(mixed_gguf, optimization_level=2, quantization="gguf", cache_dir=tmp_path,
                            compile_sizes=[1, 2])
    assert _tokens(compiled, prompts) == dense


@pytest.mark.parametrize("level", [0, 2])
def test_rounded_activations_give_the_rounded_dequantized_models_tokens(mixed_gguf: Path, level: int,
                                                                        tmp_path: Path) -> None:
    """``quantization="gguf-a8"``: eager and compiled (the C kernel with VNNI
    where the CPU has it, the reductions and ``linear`` elsewhere), alone, in
    pairs and together, give the tokens of the dequantized model whose packed
    layers' inputs are rounded."""
    prompts = random_prompts(3, [4, 11, 19], 384, seed=8)
    rt = Runtime.load(mixed_gguf, optimization_level=level, quantization="gguf-a8", cache_dir=tmp_path,
                      compile_sizes=[1, 2])
    assert rt.startup_report["packed_layers"] == {"q4-a8": 2 * 4, "q8_0-a8": 1}
    assert rt.startup_report["quantization"] == "gguf-a8"
    dense = _tokens(_round_like(load_eager(mixed_gguf), rt), prompts)
    assert _tokens(rt, prompts) == dense


def test_options_are_checked_before_loading(llama_checkpoint) -> None:
    with pytest.raises(ValueError, match=r"quantization must be None or one of \['int8', 'gguf', 'int8-a8', "
                                         r"'gguf-a8'\], got 'int4'"):
        Runtime.load(llama_checkpoint[0], quantization="int4")
    with pytest.raises(ValueError, match="quantization='gguf' keeps a GGUF file's .* is a hf checkpoint"):
        load_eager(llama_checkpoint[0], quantization="gguf")
    with pytest.raises(ValueError, match="quantization='gguf-a8' keeps .* is a hf checkpoint; use 'int8-a8'"):
        load_eager(llama_checkpoint[0], quantization="gguf-a8")


def test_a_bundle_keeps_its_quantization(mixed_gguf: Path, tmp_path: Path) -> None:
    """``kiln compile --quantization gguf``: the bundle loads packed without being told."""
    prompts = random_prompts(2, [4, 11], 384, seed=9)
    dense = _tokens(load_eager(mixed_gguf), prompts)
    out = tmp_path / "bundle"
    proc = kiln_cli(["compile", str(mixed_gguf), "--out", str(out), "-O1", "--quantization", "gguf"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rt = Runtime.load(out, cache_dir=tmp_path / "cache")
    report = rt.startup_report
    assert (report["compile_cache"], report["quantization"]) == ("bundle", "gguf")
    assert report["packed_layers"] == {"q4": 2 * 4, "q8_0": 1}
    assert _tokens(rt, prompts) == dense
