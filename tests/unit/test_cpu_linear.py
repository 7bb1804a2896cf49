"""The C small-batch linear kernel (kiln/compiler/cpu_linear.c) against torch,
its op, and the rewrite that puts it into few-token pieces."""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from kiln.checkpoint import QuantizedTensor
from kiln.compiler import cpu_linear
from kiln.compiler.gemv import decompose_linears
from kiln.models.quant import FORMATS, dequantize, pack, quantize_int8, quantized_linear, round_activations
from kiln.graphs import CpuCallGraphs, NativeReplay
from kiln.graphs.cpu import ReplayError
from kiln.native import python_headers
from tests.conftest import KERNEL_BUILDS, cpu_flags


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every build of KERNEL_BUILDS, compiled side by side on the machine's
    cores (gcc takes seconds for each): the library as kiln builds it for
    this machine (every kind, with Python's headers where they are
    installed) as ``native``, the others with their flags."""
    roots = {name: tmp_path_factory.mktemp("inductor") for name, _ in KERNEL_BUILDS}

    def build(item: tuple[str, tuple[str, ...]]) -> tuple[str, Path]:
        name, flags = item
        root = roots[name]
        return name, root / (cpu_linear.build(root) if name == "native" else cpu_linear.SOURCE.build(root, flags))

    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        return dict(pool.map(build, KERNEL_BUILDS))


@pytest.fixture(scope="module")
def native_kernel(builds: dict[str, Path]) -> cpu_linear.CpuLinearKernel:
    """The library as kiln builds it for this machine (one build shared by the tests)."""
    return cpu_linear.CpuLinearKernel(builds["native"])


@pytest.fixture(scope="module", params=KERNEL_BUILDS, ids=[name for name, _ in KERNEL_BUILDS])
def kernel(request: pytest.FixtureRequest, builds: dict[str, Path],
           native_kernel: cpu_linear.CpuLinearKernel) -> cpu_linear.CpuLinearKernel:
    name, flags = request.param
    if name == "native":
        return native_kernel
    built = cpu_linear.CpuLinearKernel(builds[name])
    if name == "avx2":
        assert built.isa == "avx2"
    elif name == "no-bf16-dot":
        assert built.isa == "avx512"
        assert not built.vnni  # the packed kinds' fp32 products on AVX-512
    return built


def test_the_native_build_uses_the_widest_vectors_this_cpu_has(native_kernel) -> None:
    built = native_kernel
    flags = cpu_flags()
    want = ("avx512-bf16" if "avx512_bf16" in flags else "avx512") if "avx512f" in flags else "avx2"
    assert built.isa == want
    assert built.vnni == ({"avx512f", "avx512_vnni"} <= flags)


def _blocks(w: torch.Tensor, bits: int) -> QuantizedTensor:
    """GGUF-like blocks of 32: q8_0 (symmetric) or q4_1 (scale and minimum)."""
    n, k = w.shape
    wb = w.view(n, k // 32, 32)
    if bits == 8:
        d = (wb.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-8)
        q = torch.round(wb / d).clamp(-127, 127).to(torch.int8)
        return QuantizedTensor(q.view(n, k), d.view(n, -1), None, 8, "q8_0")
    lo = wb.amin(-1, keepdim=True)
    d = ((wb.amax(-1, keepdim=True) - lo) / 15).clamp_min(1e-8)
    q = torch.round((wb - lo) / d).clamp(0, 15).to(torch.int8)
    return QuantizedTensor(q.view(n, k), d.view(n, -1), lo.view(n, -1), 4, "q4_1")


# 9-16: one call of the blocked fp32 rows (rows_f32_block), padded to a multiple of the
# rows a pass takes; 17 and 35: calls of 16 rows and a rest
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 11, 12, 13, 16, 17, 35])
@pytest.mark.parametrize("k", [64, 100, 8])  # 100: a tail past the vectors of 16 and 8
def test_fp32_equals_linear(kernel, rows: int, k: int) -> None:
    torch.manual_seed(rows * 100 + k)
    x, w, b = torch.randn(rows, k), torch.randn(37, k), torch.randn(37)
    torch.testing.assert_close(kernel(x, w, None, None, b, "f32"), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kernel(x, w, None, None, None, "f32"), F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_fp32_takes_16_rows_a_call_and_the_other_kinds_8(kernel) -> None:
    """A call takes 16 fp32 rows; the pieces send it 16 where the build has
    no fp32 panels (AVX2), else 8, the panels taking more."""
    few = cpu_linear.MAX_ROWS if kernel.panels else 16
    assert kernel.max_rows["f32"] == 16 and kernel.policy.f32_rows == few
    assert {kind: most for kind, most in kernel.max_rows.items() if kind != "f32"} == dict.fromkeys(
        set(kernel.max_rows) - {"f32"}, cpu_linear.MAX_ROWS)
    assert kernel.policy.takes("f32", few) and not kernel.policy.takes("f32", few + 1)
    assert kernel.policy.takes("bf16", 8) == (not kernel.amx) and not kernel.policy.takes("bf16", 9)
    assert not kernel.policy.takes("q8_0", 9)
    # one fp32 row: the kernel in an AVX-512 build (it streams a step's weights faster), a reduction in AVX2's
    assert kernel.policy.f32_one_row == kernel.isa.startswith("avx512") == kernel.policy.takes("f32", 1)
    # bf16 out of the fp32 kind: 8 rows (the blocked rows write fp32 only)
    x, w, out = torch.randn(9, 64), torch.randn(8, 64), torch.empty(9, 8, dtype=torch.bfloat16)
    assert kernel._fn(0, x.data_ptr(), 0, 64, 9, w.data_ptr(), None, None, 8, 64, None, out.data_ptr(), 1, 8,
                      1) == -1


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n", [3, 4, 8, 37, 133])  # fewer rows than a block, a block, one block ahead, tails
def test_fp32_blocked_rows_over_threads_and_strides(kernel, threads: int, n: int) -> None:
    """The blocked fp32 rows against torch for every split of the output rows
    among threads (each thread's share a multiple of 4, its last block asking
    for none ahead), strided activations and a K of a wide model's MLP."""
    torch.manual_seed(threads * 1000 + n)
    w, b = torch.randn(n, 1552), torch.randn(n)
    x = torch.randn(14, 1600)[:, 7:1559]  # rows 1600 apart
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernel(x, w, None, None, b, "f32")
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=2e-4, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 4, 8])
@pytest.mark.parametrize("k", [96, 200, 50])  # past the last vector of 64 and of 32 bf16 values
def test_bf16_accumulates_in_fp32_and_rounds_once(kernel, rows: int, k: int) -> None:
    torch.manual_seed(rows)
    x = torch.randn(rows, k).to(torch.bfloat16)
    w = torch.randn(50, k).to(torch.bfloat16)
    b = torch.randn(50).to(torch.bfloat16)
    got = kernel(x, w, None, None, b, "bf16")
    assert got.dtype == torch.bfloat16
    want = (F.linear(x.float(), w.float()) + b.float()).to(torch.bfloat16)
    # the same fp32 sums in another order: at most one bf16 step apart
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2 ** -7)


# k = 192: q8_0's 6 groups, q4's 3 (a chunk of 2 cut short); 576: q4's 9; 224: the 8-bit kinds' 7
_PACKED_CASES = [(fmt, k) for fmt in ("int8", "q8_0", "q4", "int8-a8", "q8_0-a8", "q4-a8")
                 for k in (128, 192, 576) + (() if fmt.startswith("q4") else (224,))]


@pytest.mark.parametrize("fmt, k", _PACKED_CASES)
@pytest.mark.parametrize("rows", [1, 2, 4, 7])
def test_packed_formats_equal_their_dequantized_weight(kernel, fmt: str, rows: int, k: int) -> None:
    """``linear(x, dequantized W)``; for the ``-a8`` formats with ``x`` rounded
    first (``round_activations``): with VNNI as integer dot products, elsewhere
    in fp32 on the same values. Odd group counts leave a group past the last
    pair that the kernel's two sets of accumulators take in turn."""
    torch.manual_seed(rows * 1000 + k)
    packing = FORMATS[fmt].packing
    w = torch.randn(24, k) * 0.1
    q = quantize_int8(w) if packing == "int8" else _blocks(w, 8 if packing == "q8_0" else 4)
    words, scales, offsets = pack(q, FORMATS[fmt])
    x, b = torch.randn(rows, k), torch.randn(24)
    x[0, 32:64] = 0  # a block of zeros: scale 0, every value 0
    weight = dequantize(words, scales, offsets, FORMATS[fmt])

    def seen(x: torch.Tensor) -> torch.Tensor:  # what the layer multiplies
        return round_activations(x, k) if FORMATS[fmt].round_activations else x.float()

    torch.testing.assert_close(kernel(x, words, scales, offsets, b, fmt), F.linear(seen(x), weight, b),
                               atol=1e-4, rtol=1e-4)
    x16 = x.to(torch.bfloat16)
    got16 = kernel(x16, words, scales, offsets, None, fmt)
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16.float(), F.linear(seen(x16), weight), atol=0.05, rtol=2 ** -7)


def test_rounding_changes_the_result_by_the_rounding_alone(kernel) -> None:
    """The rounded and the exact form of a layer differ (the flag reaches the
    kernel), by no more than the activations' rounding explains."""
    torch.manual_seed(5)
    w = torch.randn(32, 256) * 0.1
    words, scales, offsets = pack(_blocks(w, 4), FORMATS["q4"])
    x = torch.randn(3, 256)
    exact, rounded = (kernel(x, words, scales, offsets, None, f) for f in ("q4", "q4-a8"))
    assert not torch.equal(exact, rounded)
    weight = dequantize(words, scales, offsets, FORMATS["q4"])
    bound = (round_activations(x, 256) - x).abs() @ weight.abs().T  # |sum of rounding errors x weights|
    assert bool(((exact - rounded).abs() <= bound + 1e-4).all())


def test_rows_of_any_shape_and_strides(kernel) -> None:
    torch.manual_seed(0)
    w = torch.randn(16, 32)
    x3 = torch.randn(2, 3, 32)
    torch.testing.assert_close(kernel(x3, w, None, None, None, "f32"), F.linear(x3, w), atol=1e-5, rtol=1e-5)
    strided = torch.randn(4, 64)[:, :32]  # rows 64 apart, as a slice of a fused projection
    torch.testing.assert_close(kernel(strided, w, None, None, None, "f32"), F.linear(strided, w),
                               atol=1e-5, rtol=1e-5)
    transposed = torch.randn(32, 3).t()  # elements not contiguous: copied first
    torch.testing.assert_close(kernel(transposed, w, None, None, None, "f32"), F.linear(transposed, w),
                               atol=1e-5, rtol=1e-5)
    for empty in (torch.empty(0, 32), torch.empty(2, 0, 32)):  # no rows: no call, an empty result
        assert kernel(empty, w, None, None, None, "f32").shape == (*empty.shape[:-1], 16)


def test_the_op_runs_the_loaded_kernel_and_has_a_fake(kernel) -> None:
    cpu_linear.load(kernel.path)
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    torch.testing.assert_close(cpu_linear.cpu_linear(x, w, None, None, None, "f32"), F.linear(x, w),
                               atol=1e-5, rtol=1e-5)
    with FakeTensorMode() as mode:
        fake = cpu_linear.cpu_linear(mode.from_tensor(torch.empty(3, 5, 16)), mode.from_tensor(w), None, None,
                                     None, "f32")
    assert fake.shape == (3, 5, 8)


def test_a_refused_shape_names_the_kernel_and_the_shape(kernel) -> None:
    words = torch.zeros(4, 1, 8)  # q4 needs rows of 64 elements: 40 is refused
    with pytest.raises(RuntimeError, match=r"cpu-linear-.*q4 linear of \(1, 40\)"):
        kernel(torch.zeros(1, 40), words, torch.zeros(4, 1), torch.zeros(4, 1), None, "q4")


def _graph(dtype: torch.dtype, tokens: int, packed: bool) -> fx.GraphModule:
    """``x -> linear(x, w) -> packed_linear`` with example values, as Dynamo records them."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    w = graph.placeholder("w")
    x.meta["example_value"] = torch.empty(tokens, 64, dtype=dtype)
    w.meta["example_value"] = torch.empty(32, 64, dtype=dtype)
    h = graph.call_function(F.linear, (x, w))
    h.meta["example_value"] = torch.empty(tokens, 32, dtype=dtype)
    out = h
    if packed:
        words, scales = graph.placeholder("words"), graph.placeholder("scales")
        words.meta["example_value"] = torch.empty(16, 1, 8)
        scales.meta["example_value"] = torch.empty(16, 1)
        out = graph.call_function(quantized_linear, (h, words, scales, None, None, "int8"))
        out.meta["example_value"] = torch.empty(tokens, 16, dtype=dtype)
    graph.output((out,))
    return fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize("dtype, tokens, packed, one_row, calls", [
    (torch.float32, 1, True, False, 1),  # at one token the packed linear calls the kernel, fp32 stays a reduction
    (torch.float32, 1, False, False, 0),  # fp32 at one token stays in Inductor (an AVX2 build)
    (torch.float32, 1, False, True, 1),  # ... or calls the kernel (an AVX-512 build: f32_one_row)
    (torch.float32, 1, True, True, 2),
    (torch.float32, 2, True, False, 2),
    (torch.bfloat16, 1, False, False, 1),  # bf16 always
    (torch.float16, 2, False, True, 0),  # a dtype the kernel does not take
])
def test_the_rewrite_calls_the_kernel_where_it_pays(dtype, tokens: int, packed: bool, one_row: bool,
                                                     calls: int) -> None:
    policy = cpu_linear.LinearPolicy(f32_one_row=one_row)
    gm, rewritten = decompose_linears(_graph(dtype, tokens, packed), tokens, policy)
    ops = [n for n in gm.graph.nodes if n.target is cpu_linear.cpu_linear]
    assert len(ops) == calls
    assert rewritten == 1 + packed  # every linear is rewritten, as the kernel's call or as a reduction
    assert not any(n.target in (F.linear, quantized_linear) for n in gm.graph.nodes)
    without, _ = decompose_linears(_graph(dtype, tokens, packed), tokens)
    assert not any(n.target is cpu_linear.cpu_linear for n in without.graph.nodes)


def test_a_policy_without_a_kind_leaves_its_linears_to_inductor() -> None:
    policy = cpu_linear.LinearPolicy(frozenset({"f32"}))
    assert policy.takes("f32", 2) and not policy.takes("bf16", 2) and not policy.takes("int8", 1)
    gm, rewritten = decompose_linears(_graph(torch.float32, 2, True), 2, policy)
    assert [n.args[-1] for n in gm.graph.nodes if n.target is cpu_linear.cpu_linear] == ["f32"]
    assert rewritten == 2  # the packed linear as its unpacking reduction


def test_with_amx_tiles_bf16_linears_call_the_tiles_at_every_row_count() -> None:
    """Where the kernel has AMX tiles (``LinearPolicy.tiles``) a bf16 linear
    becomes ``kiln::onednn_linear`` (its tiles) at one row as at eight, never
    the kernel's own bf16 loop nor a reduction; fp32 and packed linears keep
    the kernel."""
    from kiln.compiler import onednn
    from kiln.compiler.gemv import kernel_takes_all

    policy = cpu_linear.LinearPolicy(frozenset(cpu_linear._KINDS), 16, tiles=True)
    assert policy.to_tiles("bf16") and not policy.to_tiles("f32") and not policy.to_tiles("q8_0")
    assert not any(policy.takes("bf16", n) for n in (1, 2, 8))
    assert policy.takes("f32", 2) and policy.takes("q8_0", 1)
    for tokens in (1, 2, 8):
        graph = _graph(torch.bfloat16, tokens, packed=True)
        gm, rewritten = decompose_linears(graph, tokens, policy)
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert targets.count(onednn.onednn_linear) == 1 and targets.count(cpu_linear.cpu_linear) == 1
        assert rewritten == 2 and torch.sum not in targets
        assert kernel_takes_all(graph, tokens, policy)
    without = cpu_linear.LinearPolicy(frozenset(cpu_linear._KINDS), 16)
    gm, _ = decompose_linears(_graph(torch.bfloat16, 2, packed=False), 2, without)
    assert [n.args[-1] for n in gm.graph.nodes if n.target is cpu_linear.cpu_linear] == ["bf16"]


def test_kernel_takes_all_says_whether_any_linear_stays_a_reduction() -> None:
    from kiln.compiler.gemv import kernel_takes_all

    graph = _graph(torch.float32, 2, True)
    assert kernel_takes_all(graph, 2, cpu_linear.LinearPolicy())
    assert not kernel_takes_all(graph, 1, cpu_linear.LinearPolicy())  # fp32 at one token: a reduction
    assert kernel_takes_all(graph, 1, cpu_linear.LinearPolicy(f32_one_row=True))  # unless the build says so
    assert not kernel_takes_all(graph, 2, cpu_linear.LinearPolicy(frozenset({"f32"})))


def test_the_few_row_span_is_sixteen_rows_only_where_every_linear_is_fp32() -> None:
    """One dynamic compilation serves 2 to 16 tokens where the kernel's blocked
    fp32 rows take every linear; a packed or bf16 linear keeps it at 8."""
    from types import SimpleNamespace

    from kiln.compiler.pipeline import _few_rows

    def span(graph: fx.GraphModule, sizes: list[int], f32_rows: int = 16) -> tuple[int, int] | None:
        policy = cpu_linear.LinearPolicy(frozenset(cpu_linear._KINDS), f32_rows)
        return _few_rows({"p": (SimpleNamespace(graph_module=graph), None)}, sizes, torch.device("cpu"), policy)

    assert span(_graph(torch.float32, 2, False), [1, 2, 4]) == (2, 16)
    assert span(_graph(torch.float32, 2, False), [1, 12]) == (2, 16)
    assert span(_graph(torch.float32, 2, False), [1, 2], f32_rows=8) == (2, 8)  # a library before the blocked rows
    assert span(_graph(torch.float32, 2, True), [1, 2, 4]) == (2, 8)  # the packed linear: 8 rows a call
    assert span(_graph(torch.bfloat16, 2, False), [1, 2, 4]) == (2, 8)
    assert span(_graph(torch.float32, 2, True), [1, 12]) is None  # no size in the packed model's span
    assert span(_graph(torch.float32, 2, False), [1]) is None


def _model(dtype: torch.dtype, packed: str | None, head_dtype: torch.dtype) -> torch.nn.Module:
    from kiln.models.quant import QuantizedLinear

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = (QuantizedLinear(64, [16], False, FORMATS[packed]) if packed
                         else torch.nn.Linear(64, 16, dtype=dtype))
            self.embed = torch.nn.Embedding(100, 64, dtype=head_dtype)

        def logits_inputs(self):  # noqa: ANN202  (a tied head: the embedding's weight)
            return [self.embed.weight], None

    return Tiny()


@pytest.mark.parametrize("dtype, packed, head_dtype, kinds", [
    (torch.float32, None, torch.float32, {"f32"}),
    (torch.bfloat16, None, torch.bfloat16, {"bf16"}),
    (torch.float32, "q4-a8", torch.float32, {"q4-a8", "f32"}),
    (torch.float32, "q8_0", torch.bfloat16, {"q8_0", "bf16"}),
    (torch.float16, None, torch.float16, set()),  # fp16: the kernel takes nothing
])
def test_model_kinds_are_its_linears_and_its_head(dtype, packed, head_dtype, kinds: set[str]) -> None:
    assert cpu_linear.model_kinds(_model(dtype, packed, head_dtype)) == kinds


def test_a_library_built_for_some_kinds_takes_them_and_refuses_the_rest(tmp_path, native_kernel,
                                                                        f32_kernel_library) -> None:
    fp32 = cpu_linear.CpuLinearKernel(f32_kernel_library)
    assert fp32.kinds == {"f32"} and fp32.policy.kinds == fp32.kinds
    x, w = torch.randn(3, 64), torch.randn(24, 64)
    torch.testing.assert_close(fp32(x, w, None, None, None, "f32"), F.linear(x, w), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match=r"cpu-linear-.*refused a bf16 linear of \(3, 64\)"):
        fp32(x.bfloat16(), w.bfloat16(), None, None, None, "bf16")
    q4 = cpu_linear.CpuLinearKernel(tmp_path / cpu_linear.build(tmp_path, {"q4-a8"}))
    assert q4.kinds == {"q4", "q4-a8"}  # the rounded kind shares its packing's code
    every = native_kernel  # built with every kind, as kiln builds it (a module's one build of it)
    assert len({every.path.name, fp32.path.name, q4.path.name}) == 3
    assert every.kinds == set(cpu_linear._KINDS)
    with pytest.raises(ValueError, match=r"unknown linear kernel kinds \['f16'\]"):
        cpu_linear.build(tmp_path, {"f16"})


@pytest.mark.skipif(python_headers() is None, reason="Python's headers are not installed: the library is ctypes-only")
def test_the_extension_call_gives_the_ctypes_call_bits(native_kernel) -> None:
    kernel = native_kernel
    assert kernel._linear is not None  # built with Python's headers: the extension module's call
    ctypes_only = cpu_linear.CpuLinearKernel(kernel.path)
    ctypes_only._linear = ctypes_only._silu_mul_ext = ctypes_only._panels_linear_ext = None
    torch.manual_seed(0)
    w = torch.randn(40, 64)
    q = _blocks(w, 4)
    words, scales, offsets = pack(q, FORMATS["q4"])
    bias = torch.randn(40)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(8, 80, dtype=dtype)[:, 3:67]  # rows with a stride
        kind = "f32" if dtype == torch.float32 else "bf16"
        for args in ((x[:3], w.to(dtype), None, None, bias, kind), (x, words, scales, offsets, None, "q4"),
                     (x[:1], words, scales, offsets, bias, "q4-a8")):
            assert torch.equal(kernel(*args), ctypes_only(*args))
        gate_up = torch.randn(5, 2 * 72, dtype=dtype)
        assert torch.equal(kernel.silu_mul(gate_up), ctypes_only.silu_mul(gate_up))
    if kernel.panels:  # the panels' call, with the next linear asked for ahead and without
        panels, nxt = kernel.f32_panels(w), kernel.f32_panels(torch.randn(50, 40))
        x = torch.randn(20, 64)
        for ahead in (None, cpu_linear.PanelsAhead(nxt, 50, 40)):
            assert torch.equal(kernel.panels_linear(x, panels, 40, bias, ahead),
                               ctypes_only.panels_linear(x, panels, 40, bias, ahead))


@pytest.mark.skipif(python_headers() is None, reason="Python's headers are not installed: the library is ctypes-only")
@pytest.mark.parametrize("build", KERNEL_BUILDS, ids=[name for name, _ in KERNEL_BUILDS])
def test_argmax_rows_picks_what_torch_max_picks(build, tmp_path) -> None:
    """The first of equal values, the first NaN, all -inf rows, tails past the
    vectors, strided rows, fp32 and bf16; against ``max(dim=-1)``."""
    _, flags = build
    kernel = cpu_linear.CpuLinearKernel(tmp_path / cpu_linear.SOURCE.build(
        tmp_path, (*flags, "-DKILN_KINDS=0x1", "-DKILN_PYTHON"),  # fp32 alone: the fastest build
        include_dirs=(python_headers(),)))
    torch.manual_seed(0)
    for n in (1, 7, 16, 33, 100, 49152):
        x = torch.randn(6, n + 5)[:, 2:n + 2]  # strided rows
        x[1] = x[1].round()  # ties
        x[2, n // 2:] = float("nan")
        x[2, n // 3] = float("nan")
        x[3] = float("-inf")
        x[4, -1] = 1e9  # the largest in the tail
        x[5] = 0.5
        for t in (x, x.to(torch.bfloat16)):
            assert kernel.argmax_rows(t) == t.max(dim=-1).indices.tolist(), (n, t.dtype)
    assert kernel.argmax_rows(torch.zeros(2, 4, dtype=torch.float16)) is None  # a dtype it does not take
    assert kernel.argmax_rows(torch.zeros(4, 2).t()) is None  # values of a row not side by side


# ------------------------------------------------------------------ kiln_replay
def _native(kernel: cpu_linear.CpuLinearKernel) -> NativeReplay:
    assert kernel.replay_loop is not None and kernel.replay_args == 64
    return NativeReplay(kernel.replay_loop, kernel.replay_args)


def test_kiln_replay_makes_a_call_graphs_calls_from_c(native_kernel) -> None:
    """The kernel's ``linear`` (an extension function) and a ctypes function,
    captured through their sites, are made again from C: the replay reads the
    inputs' new values, and the results equal the calls made from Python."""
    torch.manual_seed(3)
    x, w, b = torch.randn(2, 64), torch.randn(16, 64), torch.randn(16)
    v, w8 = torch.randn(1, 16), torch.randn(8, 16)
    outs: list[torch.Tensor] = []

    def step() -> None:
        outs.append(native_kernel(x, w, None, None, b, "f32"))  # through ``_linear``
        out = torch.empty(1, 8)
        rc = native_kernel._fn(0, v.data_ptr(), 0, 16, 1, w8.data_ptr(), None, None, 8, 16, None, out.data_ptr(),
                               0, 8, 1)  # through ``_fn``, as its ctypes caller does
        assert rc == 0
        outs.append(out)

    graphs = CpuCallGraphs(native_kernel.native_sites, _native(native_kernel))
    graph, _ = graphs.capture(step, None)
    assert len(graph.calls) == 2 and graph.native is not None
    x.copy_(torch.randn(2, 64))
    v.copy_(torch.randn(1, 16))
    graphs.replay(graph)
    torch.testing.assert_close(outs[0], F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs[1], F.linear(v, w8), atol=1e-4, rtol=1e-4)


def test_every_native_function_a_step_can_call_is_a_call_graph_site(native_kernel) -> None:
    """A step's native call made through no site drops out of a CPU call
    graph's replay without a word (the AMX linears once did). Every native
    function the kernel holds is a site, or one of those named here that no
    step's forward calls: a new entry must be put on one side or the other."""
    import types

    def native(value: object) -> bool:
        return isinstance(value, (ctypes._CFuncPtr, types.BuiltinFunctionType))

    held = {name for name, value in vars(native_kernel).items() if native(value)}
    sites = {name for holder, name in native_kernel.native_sites() if holder is native_kernel}
    # the sampler's and the greedy screen's (after the forward), the load's, the replay's own
    outside_a_step = {"_argmax", "_greedy_screen", "_amx_pack", "_panels_pack", "_panels_size", "replay_loop"}
    missed = held - outside_a_step - sites
    assert not missed, f"native functions no CPU call graph records: {missed}"
    assert {"_fn", "_linear"} <= held  # the test sees the kernel's functions at all


def test_kiln_replay_stops_at_a_call_that_returns_otherwise(native_kernel) -> None:
    """A checked call whose return differs from its capture's raises
    ReplayError naming it, as the Python loop does: here libc's ``strlen``
    over a buffer whose string grew."""
    libc = ctypes.CDLL(None)
    strlen = libc.strlen
    strlen.argtypes, strlen.restype = [ctypes.c_void_p], ctypes.c_int
    buf = ctypes.create_string_buffer(b"abc", 8)
    holder = {"strlen": strlen}
    graphs = CpuCallGraphs(lambda: [(holder, "strlen")], _native(native_kernel))
    graph, _ = graphs.capture(lambda: holder["strlen"](ctypes.addressof(buf)), None)
    assert graph.native is not None and graph.calls[0][2] == 3
    graphs.replay(graph)
    buf.value = b"abcd"
    with pytest.raises(ReplayError, match="strlen returned 4 on replay, 3 at capture"):
        graphs.replay(graph)


def test_a_call_kiln_replay_cannot_make_is_replayed_from_python(native_kernel) -> None:
    """A Python function, a float argument or more integers than the loop
    passes: the graph keeps the Python loop, and the reason is given."""
    native = _native(native_kernel)
    x = torch.ones(4)

    def python_fn(*args):  # noqa: ANN002, ANN202
        return None

    assert "not a known C function" in native.prepare([(python_fn, (x,), None)])
    assert "not an integer" in native.prepare([(native_kernel._linear, (0, x, 1.5), 0)])
    assert "more than the native loop's 64" in native.prepare([(native_kernel._linear, (0,) * 65, 0)])
    declared_float = ctypes.CDLL(None)["labs"]  # a new function object, declared here with a double
    declared_float.argtypes = [ctypes.c_double]
    assert "not a known C function" in native.prepare([(declared_float, (1,), None)])


# ---------------------------------------------------------------- AMX tiles
AMX = {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"} <= cpu_flags()
needs_amx = pytest.mark.skipif(not AMX, reason="the CPU has no AMX tiles")


def test_only_the_native_build_of_a_cpu_with_amx_has_the_tiles(kernel, native_kernel) -> None:
    """Linux grants the tiles on request (kiln_amx); builds without AVX-512 or
    AVX512-BF16 leave the AMX code out, and their entry points refuse."""
    assert kernel.amx == (AMX and kernel is native_kernel)
    if not kernel.amx:
        assert kernel.amx_tiles(torch.randn(32, 64).bfloat16()) is None
        library = ctypes.CDLL(str(kernel.path))
        assert library.kiln_amx() == 0
        i64 = ctypes.c_int64
        assert library.kiln_amx_linear(None, i64(64), i64(1), i64(64), None, i64(32), None, None, i64(32), 1) == -3


def test_the_native_build_targets_the_tiles_where_the_cpu_has_them(native_kernel) -> None:
    """What lets a cold compile take a predicted AMX target without
    Inductor's probe (kiln.compiler.toolchain.trusted_prediction)."""
    assert native_kernel.amx_target == (AMX and "amx_int8" in cpu_flags())
    assert native_kernel.amx_target or not native_kernel.amx
    # fp16 products: only on a CPU with them (a gcc before 13 does not target them there)
    assert not native_kernel.amx_fp16_target or (native_kernel.amx_target and "amx_fp16" in cpu_flags())


@needs_amx
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 40, 64, 300])
@pytest.mark.parametrize("n, k", [(48, 64), (160, 96), (32, 1536)])  # 48: a last block of 16 columns alone
@pytest.mark.parametrize("bias", [False, True])
def test_amx_bf16_accumulates_in_fp32_and_rounds_once(native_kernel, rows: int, n: int, k: int,
                                                      bias: bool) -> None:
    g = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    tiles = native_kernel.amx_tiles(w)
    assert tiles is not None and tiles.numel() == n * k and tiles.dtype == torch.bfloat16
    got = native_kernel.amx_linear(x, tiles, n, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    want = F.linear(x.float(), w.float(), None if b is None else b.float()).bfloat16()
    # the same fp32 sums in another order: at most one bf16 step apart
    torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=2 ** -7)


@needs_amx
def test_amx_gives_a_row_the_same_bits_in_any_batch_and_layout(native_kernel) -> None:
    """Each output is one fixed sequence of tile products over K, whatever the
    number of rows, the rows' stride or the threads: a request's logits do
    not depend on what it was batched with."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(300, 160, generator=g).bfloat16()
    x = wide[:, 32:128]  # rows with a stride of 160
    w = torch.randn(64, 96, generator=g).bfloat16()
    b = torch.randn(64, generator=g).bfloat16()
    tiles = native_kernel.amx_tiles(w)
    full = native_kernel.amx_linear(x, tiles, 64, b)
    for rows in (1, 7, 16, 33, 299):
        assert torch.equal(native_kernel.amx_linear(x[:rows], tiles, 64, b), full[:rows])
        assert torch.equal(native_kernel.amx_linear(x[-rows:].contiguous(), tiles, 64, b), full[-rows:])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(native_kernel.amx_linear(x, tiles, 64, b), full)
    finally:
        torch.set_num_threads(threads)
    # more dimensions in, none out of shape; one row whose dimension of size one has any stride; no rows at all
    assert torch.equal(native_kernel.amx_linear(x[:6].reshape(2, 3, 96), tiles, 64, b), full[:6].view(2, 3, 64))
    one = x[:1].contiguous().as_strided((1, 96), (1, 1))
    assert torch.equal(native_kernel.amx_linear(one, tiles, 64, b), full[:1])
    assert native_kernel.amx_linear(x[:0], tiles, 64, b).shape == (0, 64)


@needs_amx
def test_amx_tiles_are_made_only_for_weights_the_kernel_takes(native_kernel) -> None:
    assert native_kernel.amx_tiles(torch.randn(48, 64).bfloat16()) is not None
    assert native_kernel.amx_tiles(torch.randn(48, 64).bfloat16().t().contiguous().t()) is not None  # any strides
    for refused in (torch.randn(40, 64).bfloat16(),  # N not a multiple of 16
                    torch.randn(48, 80).bfloat16(),  # K not a multiple of 32
                    torch.randn(48, 64),  # fp32
                    torch.randn(48, 64).half(),
                    torch.randn(64).bfloat16()):
        assert native_kernel.amx_tiles(refused) is None


# ------------------------------------------------------------ fp32 panels
def test_the_builds_with_avx512_have_the_fp32_panels(kernel) -> None:
    """An AVX2 build leaves the panels out, and its entry points refuse."""
    assert kernel.panels == (kernel.isa != "avx2" and "f32" in kernel.kinds)
    if not kernel.panels:
        assert kernel.f32_panels(torch.randn(48, 64)) is None
        library = ctypes.CDLL(str(kernel.path))
        i64 = ctypes.c_int64
        assert library.kiln_panels() == 0
        assert library.kiln_panels_linear(None, i64(64), i64(1), i64(64), None, i64(48), None, None, i64(48), 1,
                                          None, i64(0), i64(0)) == -1


needs_avx512 = pytest.mark.skipif("avx512f" not in cpu_flags(), reason="the CPU has no AVX-512 (no fp32 panels)")


@needs_avx512
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 64, 300])
@pytest.mark.parametrize("n, k", [(48, 64), (100, 70), (1, 3), (49, 1536)])  # whole panels, then partial ones
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_panels_compute_the_linear(native_kernel, rows: int, n: int, k: int, bias: bool) -> None:
    kernel = native_kernel
    g = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    panels = kernel.f32_panels(w)
    assert panels is not None and panels.numel() == (n + 47) // 48 * 48 * k
    got = kernel.panels_linear(x, panels, n, b)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    # fp32 sums of k products in another order than the float64 reference
    torch.testing.assert_close(got.double(), want, atol=1e-5 * k, rtol=1e-5)


@needs_avx512
def test_fp32_panels_give_a_row_the_same_bits_in_any_batch_and_layout(native_kernel) -> None:
    """Each output is one chain of fused multiply-adds over K in order,
    whatever the rows around it, their stride, the threads or the chunk of
    rows it falls in: a request's logits do not depend on its batch."""
    kernel = native_kernel
    g = torch.Generator().manual_seed(4)
    wide = torch.randn(600, 160, generator=g)
    x = wide[:, 32:128]  # rows with a stride of 160
    w = torch.randn(100, 96, generator=g)
    b = torch.randn(100, generator=g)
    panels = kernel.f32_panels(w)
    full = kernel.panels_linear(x, panels, 100, b)
    for rows in (1, 7, 16, 33, 257, 599):  # 257: past the first chunk of 256 rows
        assert torch.equal(kernel.panels_linear(x[:rows], panels, 100, b), full[:rows])
        assert torch.equal(kernel.panels_linear(x[-rows:].contiguous(), panels, 100, b), full[-rows:])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(kernel.panels_linear(x, panels, 100, b), full)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(kernel.panels_linear(x[:6].reshape(2, 3, 96), panels, 100, b), full[:6].view(2, 3, 100))
    assert kernel.panels_linear(x[:0], panels, 100, b).shape == (0, 100)


@needs_avx512
def test_fp32_panels_are_made_only_for_weights_the_kernel_takes(native_kernel) -> None:
    kernel = native_kernel
    assert kernel.f32_panels(torch.randn(48, 64).t().contiguous().t()) is not None  # any strides
    for refused in (torch.randn(48, 64).bfloat16(), torch.randn(48, 64).half(), torch.randn(64)):
        assert kernel.f32_panels(refused) is None
    library = ctypes.CDLL(str(kernel.path))
    i64 = ctypes.c_int64
    x = torch.randn(2, 64)
    # rows shorter than K, or an output row shorter than N: refused, nothing written
    assert library.kiln_panels_linear(ctypes.c_void_p(x.data_ptr()), i64(32), i64(2), i64(64), None, i64(48), None,
                                      None, i64(48), 1, None, i64(0), i64(0)) == -1
    assert library.kiln_panels_linear(ctypes.c_void_p(x.data_ptr()), i64(64), i64(2), i64(64), None, i64(48), None,
                                      None, i64(40), 1, None, i64(0), i64(0)) == -1
    # a next linear to ask for ahead without its sizes
    assert library.kiln_panels_linear(ctypes.c_void_p(x.data_ptr()), i64(64), i64(2), i64(64), None, i64(48), None,
                                      None, i64(48), 1, ctypes.c_void_p(x.data_ptr()), i64(0), i64(64)) == -1


@needs_avx512
def test_fp32_panels_asking_for_the_next_linear_change_no_bit(native_kernel) -> None:
    """``ahead`` only asks for the next linear's first panels (kiln_panels_linear):
    every row count, chunked or not, one thread or two, gives the same bits."""
    kernel = native_kernel
    g = torch.Generator().manual_seed(8)
    w, nxt = torch.randn(150, 96, generator=g), torch.randn(70, 200, generator=g)
    panels = kernel.f32_panels(w)
    ahead = cpu_linear.PanelsAhead(kernel.f32_panels(nxt), 70, 200)
    threads = torch.get_num_threads()
    for n_threads in {1, threads}:
        torch.set_num_threads(n_threads)
        try:
            for rows in (1, 9, 64, 300):
                x = torch.randn(rows, 96, generator=g)
                assert torch.equal(kernel.panels_linear(x, panels, 150, None, ahead),
                                   kernel.panels_linear(x, panels, 150, None))
        finally:
            torch.set_num_threads(threads)


# ------------------------------------------------------------ SiLU times up
def _silu_mul_exact(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.double().chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("rows, inter", [(1, 1536), (64, 1536), (3, 100), (5, 7), (2, 4864)])  # 100, 7: tails
def test_silu_mul_is_the_exact_activation_rounded_once(kernel, rows: int, inter: int) -> None:
    """fp32 within a few ulp of the exact silu(gate) * up; bf16 the exact
    value rounded once, or a neighbour where it sits near a rounding tie."""
    g = torch.Generator().manual_seed(rows * inter)
    x = torch.randn(rows, 2 * inter, generator=g) * 6
    exact = _silu_mul_exact(x)
    got = kernel.silu_mul(x)
    assert got.dtype == torch.float32 and got.shape == (rows, inter)
    torch.testing.assert_close(got.double(), exact, rtol=5e-7, atol=1e-30)
    xb = x.bfloat16()
    got_b = kernel.silu_mul(xb)
    want_b = _silu_mul_exact(xb).bfloat16()
    assert got_b.dtype == torch.bfloat16
    torch.testing.assert_close(got_b.float(), want_b.float(), rtol=2 ** -7, atol=1e-30)  # one bf16 step
    assert (got_b != want_b).float().mean() < 0.01


def test_silu_mul_takes_strided_rows_more_dimensions_and_no_rows(kernel) -> None:
    g = torch.Generator().manual_seed(4)
    wide = torch.randn(6, 90, generator=g)
    x = wide[:, 5:85]  # rows 90 apart, 80 wide: gate 40, up 40
    full = kernel.silu_mul(x)
    torch.testing.assert_close(full.double(), _silu_mul_exact(x), rtol=5e-7, atol=1e-30)
    assert torch.equal(kernel.silu_mul(x.reshape(2, 3, 80)), full.view(2, 3, 40))
    assert torch.equal(kernel.silu_mul(x.t().contiguous().t()), full)  # columns contiguous: copied to rows
    one = x[:1].contiguous().as_strided((1, 80), (1, 1))  # a dimension of size one may carry any stride
    assert torch.equal(kernel.silu_mul(one), full[:1])
    assert kernel.silu_mul(torch.empty(0, 80)).shape == (0, 40)
    assert kernel.silu_mul(torch.empty(4, 80).half()) is None  # a dtype the loop does not take
    with pytest.raises(ValueError, match=r"even last dimension, got \(4, 81\)"):
        kernel.silu_mul(torch.empty(4, 81))


def test_silu_mul_keeps_nan_and_the_limits(kernel) -> None:
    gate = torch.tensor([float("nan"), float("inf"), 100.0, -100.0, 0.0, -0.0, 1.0, 80.5])
    x = torch.cat([gate, torch.full((8,), 2.0)]).view(1, 16)
    got = kernel.silu_mul(x)[0]
    assert got[0].isnan() and got[1] == float("inf") and got[2] == 200.0
    assert -1e-30 < got[3] <= 0 and got[4] == 0 and got[5] == 0  # silu(-100) is 0 to any precision used here
    torch.testing.assert_close(got[6:].double(), _silu_mul_exact(x)[0, 6:], rtol=5e-7, atol=0)


def test_silu_mul_splits_its_rows_over_threads_without_changing_a_bit(kernel) -> None:
    x = torch.randn(64, 2 * 1536, generator=torch.Generator().manual_seed(5)).bfloat16()
    full = kernel.silu_mul(x)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(kernel.silu_mul(x), full)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(kernel.silu_mul(x[:1]), full[:1])  # below the threshold for threads: one thread, same bits
