"""The fp32 head's greedy screen (kiln.compiler.greedy_head): the argmax of the
logits the head's kernel makes, bit for bit, from a bf16 product and a bound."""

from __future__ import annotations

import pytest
import torch

from kiln.compiler import cpu_linear, onednn
from kiln.compiler.greedy_head import GreedyHead
from kiln.engine.request import SamplingParams
from kiln.engine.sampler import Sampler
from tests.conftest import cpu_flags

AMX = {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"} <= cpu_flags()


@pytest.fixture(scope="module")
def f32_kernel(f32_kernel_library) -> cpu_linear.CpuLinearKernel:
    """The library as an fp32 model's entry builds it (fp32 alone)."""
    return cpu_linear.CpuLinearKernel(f32_kernel_library)


@pytest.fixture(scope="module")
def screening_kernel(f32_kernel: cpu_linear.CpuLinearKernel) -> cpu_linear.CpuLinearKernel:
    if not AMX:
        pytest.skip("the CPU has no AMX tiles, on which the screen computes its bf16 product")
    return f32_kernel


def test_an_fp32_library_screens_where_the_cpu_has_amx(f32_kernel) -> None:
    assert f32_kernel.greedy_screens == (AMX and f32_kernel.amx)
    assert not f32_kernel.policy.to_tiles("bf16")  # its tiles are the screen's, not bf16 linears'
    if f32_kernel.amx:
        assert onednn.kernel_weight(torch.randn(32, 64).bfloat16(), f32_kernel) is None


def _reference(kernel: cpu_linear.CpuLinearKernel, x: torch.Tensor, w: torch.Tensor) -> tuple[list[int], bool]:
    """The argmax of the logits the kernel computes for ``x``'s rows: its dense
    rows up to 8, its panels beyond (as the compiled head sends them)."""
    if x.shape[0] <= kernel.policy.most_rows("f32"):
        return kernel(x, w, None, None, None, "f32").max(dim=-1).indices.tolist(), False
    return kernel.panels_linear(x, kernel.f32_panels(w), w.shape[0], None).max(dim=-1).indices.tolist(), True


@pytest.mark.parametrize("n,k", [(4096, 576), (1024, 64), (512, 1536), (160, 96)])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 64])
def test_tokens_equal_the_argmax_of_the_kernels_logits(screening_kernel, n: int, k: int, rows: int) -> None:
    g = torch.Generator().manual_seed(n + k + rows)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    x = torch.randn(rows, k, generator=g) * 3
    head = GreedyHead.build(screening_kernel, w)
    assert head is not None and head.tiles.dtype == torch.bfloat16
    expected, panels = _reference(screening_kernel, x, w)
    assert head(x, panels) == expected


@pytest.mark.parametrize("rows", [2, 12])
def test_near_ties_the_bf16_product_cannot_part_are_settled_in_fp32(screening_kernel, rows: int) -> None:
    """Columns that differ by less than bf16 resolves: the screen leaves them
    all in doubt and the fp32 sums decide, the first of equal ones winning."""
    g = torch.Generator().manual_seed(3)
    k, n = 256, 512
    w = torch.randn(n, k, generator=g) / 16
    x = torch.randn(rows, k, generator=g)
    best = (x @ w.T).argmax(dim=-1)
    for r in range(rows):
        base = w[best[r]].clone()
        for j, nudge in ((7 + r, 1e-6), (300 - r, -1e-6), (450, 0.0)):  # a hair above, below, a copy
            w[j] = base * (1 + nudge)
    head = GreedyHead.build(screening_kernel, w)
    expected, panels = _reference(screening_kernel, x, w)
    assert head(x, panels) == expected


def test_rows_of_zeros_nan_and_huge_values_follow_argmax(screening_kernel) -> None:
    """All logits equal (index 0), a NaN (the first NaN's index), values near
    fp32's range (computed whole): as ``max(dim=-1)`` picks."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(256, 64, generator=g)
    x = torch.randn(5, 64, generator=g)
    x[0] = 0.0
    x[1, 3] = float("nan")
    x[2] *= 1e30
    x[3, 0] = float("inf")
    expected, panels = _reference(screening_kernel, x, w)
    assert head_of(screening_kernel, w)(x, panels) == expected
    assert expected[0] == 0 and expected[1] == 0


def head_of(kernel: cpu_linear.CpuLinearKernel, w: torch.Tensor) -> GreedyHead:
    head = GreedyHead.build(kernel, w)
    assert head is not None
    return head


def test_heads_the_tiles_do_not_take_have_no_screen(screening_kernel) -> None:
    assert GreedyHead.build(screening_kernel, torch.randn(100, 64)) is None  # N not a multiple of 16
    assert GreedyHead.build(screening_kernel, torch.randn(128, 48)) is None  # K not a multiple of 32
    assert GreedyHead.build(screening_kernel, torch.randn(128, 64).bfloat16()) is None  # not fp32
    assert GreedyHead.build(None, torch.randn(128, 64)) is None
    head = head_of(screening_kernel, torch.randn(128, 64))
    assert head(torch.randn(0, 64), panels=False) is None
    assert head(torch.randn(3, 64).bfloat16(), panels=False) is None


def test_the_dense_rows_refuse_more_than_a_call_takes(screening_kernel) -> None:
    head = head_of(screening_kernel, torch.randn(128, 64))
    assert head(torch.randn(9, 64), panels=False) is None  # kiln_greedy_screen: -1


def test_only_greedy_rows_without_logprobs_are_argmax_only() -> None:
    greedy = SamplingParams(temperature=0)
    assert Sampler.argmax_only([greedy, greedy])
    assert not Sampler.argmax_only([greedy, SamplingParams(temperature=0.7)])
    assert not Sampler.argmax_only([SamplingParams(temperature=0, logprobs=2)])
