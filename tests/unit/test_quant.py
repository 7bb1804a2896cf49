"""Packed weights (kiln.models.quant, GGUF blocks): the packing holds exactly the
integers and scales it was given, the unpacking reduction equals a product with
the dequantized weight, and GGUF's Q8_0/Q4_0/Q4_1 blocks come out as gguf
dequantizes them. No compiler here (tests/test_quantization.py compiles)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kiln.checkpoint import CheckpointError, QuantizedTensor
from kiln.checkpoint.gguf import dequantize as gguf_dequantize
from kiln.checkpoint.gguf import split_blocks
from kiln.models.quant import (
    FORMATS, QuantizedLinear, dequantize, format_for, pack, packed_linear, quantize_int8, reduction,
    round_activations,
)

N, K = 48, 128


def _random(fmt: str, seed: int = 0) -> QuantizedTensor:
    g = torch.Generator().manual_seed(seed)
    if fmt == "int8":
        return quantize_int8(torch.randn(N, K, generator=g))
    scales = (torch.rand(N, K // 32, generator=g) + 0.1).half().float()  # fp16 values, as GGUF's blocks hold
    if fmt == "q8_0":
        values = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
        return QuantizedTensor(values, scales, None, 8, "Q8_0")
    values = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    return QuantizedTensor(values, scales, torch.randn(N, K // 32, generator=g).half().float(), 4, "Q4_1")


def _reference(q: QuantizedTensor) -> torch.Tensor:
    """Element [n, k] = values * scales[n, k // block] (+ offsets), computed plainly."""
    scales = q.scales.repeat_interleave(q.block, dim=1)
    w = q.values.float() * scales
    if q.offsets is not None:
        w = w + q.offsets.repeat_interleave(q.block, dim=1)
    return w


PACKINGS = [name for name, f in FORMATS.items() if not f.round_activations]


@pytest.mark.parametrize("fmt", PACKINGS)
def test_packing_holds_exactly_the_values_and_scales(fmt: str) -> None:
    q = _random(fmt)
    assert format_for(q) is FORMATS[fmt]
    words, scales, offsets = pack(q, FORMATS[fmt])
    assert words.dtype == torch.float32 and words.shape == (N, K // FORMATS[fmt].group, 8)
    assert torch.equal(dequantize(words, scales, offsets, FORMATS[fmt]), _reference(q))
    # GGUF's blocks keep their fp16 scales and offsets; int8's row scale is kiln's own fp32
    assert scales.dtype == (torch.float32 if fmt == "int8" else torch.float16)
    assert offsets is None or offsets.dtype == torch.float16
    packed = sum(t.numel() * t.element_size() for t in (words, scales, offsets) if t is not None)
    assert packed == FORMATS[fmt].nbytes(N, K)
    assert FORMATS[fmt].nbytes(N, K) == {"int8": N * K + 4 * N, "q8_0": N * K * 34 // 32, "q4": N * K * 20 // 32}[fmt]


def test_a_scale_beyond_fp16_is_refused() -> None:
    """Q4_0's offsets are ``-8 * scale``: a scale above 8188 would overflow fp16."""
    q = _random("q4")
    q.offsets[3, 1] = -8 * 10000.0
    with pytest.raises(ValueError, match="Q4_1 offsets: a value is not finite in torch.float16"):
        pack(q, FORMATS["q4"])
    layer = QuantizedLinear(K, [N], False, FORMATS["q4"])
    with pytest.raises(CheckpointError, match=r"^m\.gguf: blk\.0\.ffn_up\.weight: Q4_1 offsets: a value is not finite"):
        layer.load(None, q, "m.gguf: blk.0.ffn_up.weight")


@pytest.mark.parametrize("fmt", PACKINGS)
@pytest.mark.parametrize("rows", [1, 3])
def test_reduction_equals_the_product_with_the_dequantized_weight(fmt: str, rows: int) -> None:
    q = _random(fmt, seed=rows)
    words, scales, offsets = pack(q, FORMATS[fmt])
    x = torch.randn(rows, K)
    expected = x @ _reference(q).T
    got = reduction(x, words, scales, offsets, FORMATS[fmt])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-3)
    bias = torch.randn(N)
    rounded = round_activations(x, K) @ _reference(q).T + bias  # what an -a8 layer computes
    for as_reduction in (True, False):
        out = packed_linear(x, words, scales, offsets, bias, FORMATS[fmt], as_reduction=as_reduction)
        torch.testing.assert_close(out, expected + bias, rtol=1e-4, atol=1e-3)
        out = packed_linear(x, words, scales, offsets, bias, FORMATS[fmt].rounded(), as_reduction=as_reduction)
        torch.testing.assert_close(out, rounded, rtol=1e-4, atol=1e-3)


def test_activations_round_to_int8_per_block_of_32() -> None:
    x = torch.randn(3, 2, 96) * torch.tensor([0.01, 1.0, 300.0]).repeat_interleave(32)  # blocks of unlike range
    x[0, 0, 32:64] = 0.0
    got = round_activations(x, 96)
    assert got.dtype == torch.float32 and got.shape == x.shape
    for row, out in zip(x.reshape(-1, 96), got.reshape(-1, 96)):
        for b in range(3):
            block, rounded = row[32 * b:32 * b + 32], out[32 * b:32 * b + 32]
            scale = float(block.abs().max()) / 127
            if scale == 0:
                assert bool((rounded == 0).all())
                continue
            levels = rounded / scale  # every value is an integer multiple of the block's scale, |q| <= 127
            torch.testing.assert_close(levels, levels.round(), atol=1e-3, rtol=0)
            assert float(levels.abs().max()) == pytest.approx(127, abs=1e-3)
            assert bool(((rounded - block).abs() <= scale / 2 * (1 + 1e-5)).all())  # to the nearest level
    bf16 = round_activations(x.to(torch.bfloat16), 96)  # any dtype in, float32 out
    assert bf16.dtype == torch.float32


def test_int8_rounds_each_row_to_within_half_a_step() -> None:
    w = torch.randn(N, K) * torch.linspace(0.01, 3.0, N)[:, None]  # rows of very different range
    q = quantize_int8(w)
    assert q.values.dtype == torch.int8 and q.scales.shape == (N, 1) and int(q.values.abs().max()) <= 127
    error = (q.values.float() * q.scales - w).abs()
    assert bool((error <= q.scales / 2 + 1e-7).all())


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_unpack_as_gguf_dequantizes_them(type_name: str) -> None:
    qtype = gguf.GGMLQuantizationType[type_name]
    rng = np.random.default_rng(0)
    raw = gguf.quants.quantize(rng.standard_normal((N, K)).astype(np.float32), qtype).reshape(-1).view(np.uint8)
    q = split_blocks(raw, type_name, (K, N))
    assert q.source == type_name and q.block == 32
    expected = gguf_dequantize(raw, type_name, (K, N))
    assert torch.equal(_reference(q), expected)
    fmt = format_for(q)
    assert torch.equal(dequantize(*pack(q, fmt), fmt), expected)


def test_a_row_length_off_the_packing_grid_is_refused() -> None:
    q = QuantizedTensor(torch.zeros(4, 96, dtype=torch.uint8), torch.ones(4, 3), torch.zeros(4, 3), 4, "Q4_1")
    with pytest.raises(ValueError, match="96 is not a multiple of 64"):
        pack(q, FORMATS["q4"])
    with pytest.raises(ValueError, match="in_features 96"):
        QuantizedLinear(96, [4], False, FORMATS["q4"])


def test_layer_load_names_the_tensor_when_shape_or_format_disagree() -> None:
    layer = QuantizedLinear(K, [N, 16], False, FORMATS["q8_0"])
    with pytest.raises(CheckpointError, match=r"f.gguf: tensor 'k' has shape \(48, 128\), expected \(16, 128\)"):
        layer.load(1, _random("q8_0"), "f.gguf: tensor 'k'")
    with pytest.raises(CheckpointError, match="stored as Q4_1, which packs as q4.*planned as q8_0"):
        layer.load(0, _random("q4"), "f.gguf: tensor 'q'")


def test_merged_layer_fills_each_projections_rows() -> None:
    layer = QuantizedLinear(K, [N, 16], True, FORMATS["q8_0"])
    first, second = _random("q8_0", seed=1), QuantizedTensor(*[t[:16] for t in (
        _random("q8_0", seed=2).values, _random("q8_0", seed=2).scales)], None, 8, "Q8_0")
    layer.load(0, first, "a")
    layer.load(1, second, "b")
    with torch.no_grad():
        layer.bias.zero_()
    x = torch.randn(2, K)
    expected = x @ torch.cat([_reference(first), _reference(second)]).T
    torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-3)


def test_a_rounded_layer_packs_the_same_blocks_and_rounds_its_input() -> None:
    q = _random("q8_0", seed=4)
    layer = QuantizedLinear(K, [N], False, FORMATS["q8_0-a8"])
    layer.load(None, q, "t")  # a Q8_0 tensor packs into the rounded layer as into the plain one
    assert FORMATS["q8_0-a8"].packing == "q8_0" and FORMATS["q8_0"].rounded() is FORMATS["q8_0-a8"]
    x = torch.randn(3, K)
    torch.testing.assert_close(layer(x), round_activations(x, K) @ _reference(q).T, rtol=1e-4, atol=1e-3)
