"""Many-row fp32 and bf16 linears through oneDNN (kiln/compiler/onednn.py): the op
against ``F.linear``, its fake, and the rewrite that puts it into the pieces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from kiln.checkpoint import QuantizedTensor
from kiln.compiler import cpu_linear, onednn
from kiln.compiler.gemv import lower_quantized
from kiln.models.quant import FORMATS, dequantize, pack, quantize_int8, quantized_linear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("dtype", sorted(onednn.DTYPES | onednn.WIDENED, key=str))
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_the_op_computes_linear(rows: int, bias: bool, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    w = torch.randn(160, 96, generator=g).to(dtype)
    b = torch.randn(160, generator=g).to(dtype) if bias else None
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = onednn.onednn_linear(x, w, b)
    assert got.dtype == dtype and got.shape == (rows, 160)
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 0.1}
    torch.testing.assert_close(got.double(), want, **tol)
    # three dimensions in, and a non-contiguous input: as F.linear takes them
    x3 = torch.randn(2, rows, 96, generator=g).to(dtype)
    torch.testing.assert_close(onednn.implementation(x3, w, b), F.linear(x3, w, b), **tol)
    xt = torch.randn(96, rows, generator=g).to(dtype).t()
    torch.testing.assert_close(onednn.implementation(xt, w, b), F.linear(xt, w, b), **tol)


def test_bf16_where_onednn_has_its_kernels_else_widened() -> None:
    assert torch.float32 in onednn.DTYPES
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert (torch.bfloat16 in onednn.DTYPES) == native and (torch.bfloat16 in onednn.WIDENED) == (not native)
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(33, 96, generator=g).bfloat16(), torch.randn(160, 96, generator=g).bfloat16()
    b = torch.randn(160, generator=g).bfloat16()
    if native:  # bf16 F.linear runs oneDNN too: the reordered weight gives its bits
        assert torch.equal(onednn.implementation(x, w, None), F.linear(x, w))
    else:  # fp32 sums of the bf16 values, rounded once: the exact product rounded, up to the sums' order
        got = onednn.implementation(x, w, b)
        assert got.dtype == torch.bfloat16
        exact = F.linear(x.double(), w.double(), b.double())
        torch.testing.assert_close(got.double(), exact.bfloat16().double(), rtol=2 ** -7, atol=1e-3)


def test_the_fake_has_the_output_shape() -> None:
    with FakeTensorMode():
        out = onednn.onednn_linear(torch.empty(7, 3, 96), torch.empty(160, 96), None)
    assert out.shape == (7, 3, 160) and out.dtype == torch.float32


def _graph(dtype: torch.dtype, *, example: bool = True, bias: bool = False) -> fx.GraphModule:
    """``(x, w[, b]) -> linear(x, w[, b])`` with example values, as Dynamo records them."""
    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    args = [x, w]
    if bias:
        args.append(graph.placeholder("b"))
    if example:
        x.meta["example_value"] = torch.empty(8, 64, dtype=dtype)
        w.meta["example_value"] = torch.empty(32, 64, dtype=dtype)
    h = graph.call_function(F.linear, tuple(args))
    h.meta["example_value"] = torch.empty(8, 32, dtype=dtype)
    graph.output((h,))
    return fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize("bias", [False, True])
def test_the_rewrite_routes_fp32_linears_and_keeps_their_result(bias: bool) -> None:
    gm = _graph(torch.float32, bias=bias)
    new, rewritten = onednn.rewrite_linears(gm)
    assert rewritten == 1
    assert [n.target for n in new.graph.nodes if n.op == "call_function"] == [onednn.onednn_linear]
    assert any(n.target is F.linear for n in gm.graph.nodes)  # the original is left as it was
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(8, 64, generator=g), torch.randn(32, 64, generator=g)] + (
        [torch.randn(32, generator=g)] if bias else [])
    torch.testing.assert_close(new(*args)[0], gm(*args)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_rewrite_takes_bf16_and_leaves_other_dtypes(dtype: torch.dtype) -> None:
    """bf16 is rewritten: computed as it is where oneDNN has bf16 kernels,
    widened to fp32 in the op where it has none; fp16 is left to Inductor."""
    gm = _graph(dtype)
    new, rewritten = onednn.rewrite_linears(gm)
    assert (dtype == torch.bfloat16) == (dtype in onednn.REWRITE_DTYPES)
    if dtype in onednn.REWRITE_DTYPES:
        assert rewritten == 1
        assert [n.target for n in new.graph.nodes if n.op == "call_function"] == [onednn.onednn_linear]
        g = torch.Generator().manual_seed(3)
        x, w = torch.randn(8, 64, generator=g).to(dtype), torch.randn(32, 64, generator=g).to(dtype)
        torch.testing.assert_close(new(x, w)[0], gm(x, w)[0], rtol=2 ** -7, atol=1e-2)
    else:
        assert (new, rewritten) == (gm, 0)


def test_the_rewrite_leaves_a_weight_computed_in_the_graph() -> None:
    """A weight that is not a graph input would be reordered on every call
    (``lower_quantized`` routes a dequantized one to the op itself, below)."""
    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    x.meta["example_value"] = torch.empty(8, 64)
    w.meta["example_value"] = torch.empty(32, 64)
    scaled = graph.call_function(torch.mul, (w, 2.0))
    scaled.meta["example_value"] = torch.empty(32, 64)
    graph.output((graph.call_function(F.linear, (x, scaled)),))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    assert onednn.rewrite_linears(gm) == (gm, 0)


def test_the_rewrite_leaves_linears_without_a_recorded_input() -> None:
    gm = _graph(torch.float32, example=False)
    assert onednn.rewrite_linears(gm) == (gm, 0)


def test_takes_one_dtype_on_cpu() -> None:
    f32, b16 = torch.empty(2, 4), torch.empty(2, 4, dtype=torch.bfloat16)
    assert onednn.takes(f32, f32) and onednn.takes(b16, b16)  # bf16 natively or widened
    assert not onednn.takes(f32, b16) and not onednn.takes(b16, f32)
    assert not onednn.takes(f32.half(), f32.half())
    assert onednn.available(torch.device("cpu"))
    assert not onednn.available(torch.device("meta"))


def test_a_weight_is_reordered_once_and_forgotten_with_its_storage() -> None:
    w = torch.randn(160, 96)
    x = torch.randn(9, 96)
    # the weight as it is until a copy is made: oneDNN's result either way, bit for bit
    plain = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    before = onednn.packed_bytes()
    assert torch.equal(onednn.implementation(x, w, None), plain)
    assert onednn.packed_bytes() == before  # the op itself reorders nothing
    first = onednn.packed(w)
    assert onednn.packed(w) is first  # kept: not reordered again
    assert torch.equal(onednn.implementation(x, w, None), plain)
    size = first.numel() * first.element_size()
    assert onednn.packed_bytes() == before + size
    view = w.view(-1)  # the storage outlives the first tensor: the copy stays
    del w
    assert onednn.packed_bytes() == before + size
    del view
    assert onednn.packed_bytes() == before


@pytest.mark.parametrize("background", [False, True])
def test_prepack_counts_a_tied_weight_once_and_skips_what_the_op_does_not_take(background: bool) -> None:
    w = torch.randn(64, 32)
    half = torch.randn(64, 32, dtype=torch.float16)
    vector = torch.randn(32)
    b16 = torch.randn(64, 32).bfloat16()  # reordered where oneDNN has bf16 kernels; widened per call, not kept, else
    before = onednn.packed_bytes()
    nbytes, thread = onednn.prepack([w, w, half, vector, b16], background=background)
    assert nbytes == 64 * 32 * 4 + (64 * 32 * 2 if torch.bfloat16 in onednn.DTYPES else 0)
    assert (thread is not None) == background
    if thread is not None:
        thread.join(timeout=60)
        assert not thread.is_alive()
    assert onednn.packed_bytes() == before + nbytes  # made by prepack and kept
    made = onednn.packed(w)
    assert onednn.packed_bytes() == before + nbytes and onednn.packed(w) is made  # not made again


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lowered_packed_linear_multiplies_its_dequantized_weight_through_onednn(dtype: torch.dtype) -> None:
    """Many-row pieces: an fp32 or bf16 packed linear's dequantized weight goes
    to the op as it is (MKL's sgemm ran fp32 at less than half the speed on
    an AMD EPYC)."""
    graph = fx.Graph()
    x, words, scales = graph.placeholder("x"), graph.placeholder("words"), graph.placeholder("scales")
    x.meta["example_value"] = torch.empty(40, 64, dtype=dtype)
    words.meta["example_value"] = torch.empty(16, 2, 8)
    scales.meta["example_value"] = torch.empty(16, 2)
    out = graph.call_function(quantized_linear, (x, words, scales, None, None, "q8_0"))
    out.meta["example_value"] = torch.empty(40, 16, dtype=dtype)
    graph.output((out,))
    gm = lower_quantized(fx.GraphModule(torch.nn.Module(), graph), torch.device("cpu"))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert (onednn.onednn_linear in targets) == (dtype in onednn.REWRITE_DTYPES)
    assert (F.linear in targets) == (dtype not in onednn.REWRITE_DTYPES)
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 64, generator=g)
    q = quantize_int8(w)
    blocks = QuantizedTensor(q.values, q.scales.expand(16, 2).contiguous(), None, 8, "q8_0")
    packed_words, packed_scales, _ = pack(blocks, FORMATS["q8_0"])
    xs = torch.randn(40, 64, generator=g).to(dtype)
    want = F.linear(xs.float(), dequantize(packed_words, packed_scales, None, FORMATS["q8_0"])).to(dtype)
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 0.05}
    torch.testing.assert_close(gm(xs, packed_words, packed_scales)[0], want, **tol)


@pytest.fixture(scope="module")
def amx_kernel(tmp_path_factory: pytest.TempPathFactory) -> cpu_linear.CpuLinearKernel:
    """The C kernel built for bf16 alone (its AMX tiles), where this CPU has them."""
    root = tmp_path_factory.mktemp("inductor")
    kernel = cpu_linear.CpuLinearKernel(root / cpu_linear.build(root, {"bf16"}))
    if not kernel.amx:
        pytest.skip("the CPU has no AMX tiles")
    return kernel


@pytest.mark.parametrize("background", [False, True])
def test_bf16_weights_get_amx_tiles_before_prepack_returns(amx_kernel, background: bool) -> None:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(160, 96, generator=g).bfloat16()
    odd = torch.randn(40, 96, generator=g).bfloat16()  # 40 rows: not the tiles', oneDNN's reordering
    f32 = torch.randn(160, 96, generator=g)
    before = onednn.packed_bytes()
    nbytes, thread = onednn.prepack([w, odd, f32], background=background, kernel=amx_kernel)
    assert nbytes == 160 * 96 * 2 + 40 * 96 * 2 + 160 * 96 * 4
    tiles = onednn._PACKED[onednn._key(w)]  # there already, whether or not the thread has run
    assert isinstance(tiles, onednn.KernelWeight) and tiles.rows == 160
    if thread is not None:
        thread.join(timeout=60)
    assert not isinstance(onednn.packed(odd), onednn.KernelWeight)
    assert not isinstance(onednn.packed(f32), onednn.KernelWeight)  # this kernel's build has no fp32 panels
    assert onednn.packed_bytes() == before + nbytes
    b = torch.randn(160, generator=g).bfloat16()
    for rows in (5, onednn.AMX_MAX_ROWS):  # the tiles' products
        x = torch.randn(rows, 96, generator=g).bfloat16()
        assert torch.equal(onednn.implementation(x, w, b), amx_kernel.amx_linear(x, tiles.layout, 160, b))
        assert torch.equal(onednn.onednn_linear(x, w, b), amx_kernel.amx_linear(x, tiles.layout, 160, b))
    x = torch.randn(onednn.AMX_MAX_ROWS + 1, 96, generator=g).bfloat16()  # more rows: oneDNN's, on the weight as it is
    plain = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    assert torch.equal(onednn.implementation(x, w, b), plain)
    del tiles
    del w  # the tiles go with the weight
    assert onednn.packed_bytes() == before + nbytes - 160 * 96 * 2


@pytest.fixture(scope="module")
def panels_kernel(f32_kernel_library) -> cpu_linear.CpuLinearKernel:
    """The C kernel built for fp32 alone (its panels), where this CPU has AVX-512."""
    kernel = cpu_linear.CpuLinearKernel(f32_kernel_library)
    if not kernel.panels:
        pytest.skip("the kernel's build for this CPU has no fp32 panels (AVX2)")
    return kernel


@pytest.mark.parametrize("background", [False, True])
def test_fp32_weights_get_panels_before_prepack_returns(panels_kernel, background: bool) -> None:
    """At every row count: the panels beat oneDNN's reordered weights from 16
    rows to 512 (kiln_panels_linear in cpu_linear.c)."""
    g = torch.Generator().manual_seed(6)
    w = torch.randn(100, 96, generator=g)
    b16 = torch.randn(64, 96, generator=g).bfloat16()  # not the fp32 panels'
    before = onednn.packed_bytes()
    nbytes, thread = onednn.prepack([w, w, b16], background=background, kernel=panels_kernel)
    assert nbytes == 100 * 96 * 4 + (64 * 96 * 2 if torch.bfloat16 in onednn.DTYPES else 0)
    panels = onednn._PACKED[onednn._key(w)]  # there already, whether or not the thread has run
    assert isinstance(panels, onednn.KernelWeight) and panels.rows == 100 and panels.max_rows is None
    if thread is not None:
        thread.join(timeout=60)
    assert not isinstance(onednn.packed(b16), onednn.KernelWeight)
    padded = 144 * 96 * 4  # two panels of 48 columns
    assert onednn.packed_bytes() == before + padded + (64 * 96 * 2 if torch.bfloat16 in onednn.DTYPES else 0)
    bias = torch.randn(100, generator=g)
    for rows in (5, 64, 2049):
        x = torch.randn(rows, 96, generator=g)
        want = panels_kernel.panels_linear(x, panels.layout, 100, bias)
        assert torch.equal(onednn.implementation(x, w, bias), want)
        assert torch.equal(onednn.onednn_linear(x, w, bias), want)
        torch.testing.assert_close(want, F.linear(x, w, bias), atol=1e-4, rtol=1e-5)
    del panels, w
    assert onednn.packed_bytes() == before + (64 * 96 * 2 if torch.bfloat16 in onednn.DTYPES else 0)


def test_prepack_tells_each_panels_layout_the_next_ones(panels_kernel) -> None:
    """In the order listed (a model's module order), skipping weights of
    other layouts: each call can ask for the next one's first panels."""
    g = torch.Generator().manual_seed(7)
    first, second, third = (torch.randn(n, k, generator=g) for n, k in ((100, 96), (48, 64), (60, 96)))
    b16 = torch.randn(64, 96, generator=g).bfloat16()
    onednn.prepack([first, b16, second, third], kernel=panels_kernel)
    laid = [onednn._PACKED[onednn._key(w)] for w in (first, second, third)]
    for kw, (nxt, w) in zip(laid, ((laid[1], second), (laid[2], third))):
        assert kw.ahead is not None and kw.ahead.panels is nxt.layout
        assert (kw.ahead.rows, kw.ahead.depth) == tuple(w.shape)
    assert laid[2].ahead is None
    x = torch.randn(9, 96, generator=g)
    assert torch.equal(laid[0](x, None), panels_kernel.panels_linear(x, laid[0].layout, 100, None))
