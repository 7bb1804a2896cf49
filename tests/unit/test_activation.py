"""The gated MLP's activation as one op on CPU (kiln/compiler/activation.py):
the op against torch, its fake, and the rewrite that puts it into the pieces.
The C loop itself is tested across builds in test_cpu_linear.py."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from kiln.compiler import activation, cpu_linear, onednn


@pytest.fixture(scope="module")
def loaded(f32_kernel_library) -> cpu_linear.CpuLinearKernel:
    """The C kernel's library for this machine (fp32 kinds alone: a quicker
    build; the loop is in every build), loaded as the ops' implementation."""
    return cpu_linear.load(f32_kernel_library)


def _reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_op_is_silu_times_up(loaded, dtype: torch.dtype) -> None:
    x = (torch.randn(2, 5, 96, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    got = activation.silu_mul(x)
    assert got.dtype == dtype and got.shape == (2, 5, 48)
    assert torch.equal(got, loaded.silu_mul(x))  # the loaded kernel's loop
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2 ** -7, "atol": 1e-3}
    torch.testing.assert_close(got.double(), _reference(x.double()), **tol)


def test_without_a_loaded_kernel_the_op_is_torchs(loaded, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_linear, "_LOADED", [])
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(activation.implementation(x), _reference(x))
    h = x.half()  # and for a dtype the loop does not take, with a kernel
    monkeypatch.setattr(cpu_linear, "_LOADED", [loaded])
    assert torch.equal(activation.implementation(h), _reference(h))


def test_the_fake_has_the_output_shape() -> None:
    with FakeTensorMode():
        out = activation.silu_mul(torch.empty(7, 3, 96, dtype=torch.bfloat16))
    assert out.shape == (7, 3, 48) and out.dtype == torch.bfloat16


def _mlp_graph(dtype: torch.dtype = torch.float32, *, linear: object = onednn.onednn_linear, swap: bool = False,
               reuse_silu: bool = False) -> fx.GraphModule:
    """``(x, w) -> silu(gate) * up`` of ``linear(x, w)`` split by ``chunk``,
    with example values, as Dynamo records the model's MLP
    (kiln.models.decoder)."""
    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    x.meta["example_value"] = torch.empty(8, 32, dtype=dtype)
    w.meta["example_value"] = torch.empty(64, 32, dtype=dtype)
    if linear is cpu_linear.cpu_linear:
        t = graph.call_function(linear, (x, w, None, None, None, "f32"))
    else:
        t = graph.call_function(linear, (x, w, None))
    t.meta["example_value"] = torch.empty(8, 64, dtype=dtype)
    chunk = graph.call_method("chunk", (t, 2), {"dim": -1})
    gate = graph.call_function(operator.getitem, (chunk, 0))
    up = graph.call_function(operator.getitem, (chunk, 1))
    act = graph.call_function(F.silu, (gate,))
    out = graph.call_function(operator.mul, (up, act) if swap else (act, up))
    graph.output((out, act) if reuse_silu else (out,))
    return fx.GraphModule(torch.nn.Module(), graph)


def _calls(gm: fx.GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


@pytest.mark.parametrize("linear", [onednn.onednn_linear, cpu_linear.cpu_linear])
@pytest.mark.parametrize("swap", [False, True])
def test_the_rewrite_makes_the_activation_one_call_with_its_result(loaded, linear: object, swap: bool) -> None:
    gm = _mlp_graph(linear=linear, swap=swap)
    new, rewritten = activation.rewrite_silu_mul(gm)
    assert rewritten == 1
    assert _calls(new) == [linear, activation.silu_mul]  # chunk, halves, silu and mul are gone
    assert F.silu in _calls(gm)  # the original is left as it was
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(8, 32, generator=g), torch.randn(64, 32, generator=g)
    torch.testing.assert_close(new(x, w)[0], gm(x, w)[0], rtol=1e-6, atol=1e-6)


def test_the_rewrite_leaves_what_inductor_fuses_or_the_loop_does_not_take() -> None:
    # the product is Inductor's own (a reduction it fuses the activation into)
    gm = _mlp_graph(linear=F.linear)
    assert activation.rewrite_silu_mul(gm) == (gm, 0)
    # a dtype the loop does not take
    gm = _mlp_graph(torch.float16)
    assert activation.rewrite_silu_mul(gm) == (gm, 0)
    # the activation alone is used elsewhere too: the op would not replace it
    gm = _mlp_graph(reuse_silu=True)
    assert activation.rewrite_silu_mul(gm) == (gm, 0)
