"""CPU call graphs (kiln.graphs.cpu): a capture records the calls made through
the given sites and refuses torch work it would leave out; a replay makes the
same calls again, so it computes from whatever the captured buffers hold now.

The "native" functions here are numpy ufuncs over views of the tensors: like
kiln's C kernels, they compute without going through torch's dispatcher."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from kiln.config import CompilationConfig, CUDAGraphMode, CUDAGraphSupport, cpu_capture_sizes
from kiln.forward_context import BatchDescriptor
from kiln.graphs import CpuCallGraphs, CUDAGraphDispatcher, NotCapturable
from kiln.graphs.cpu import ReplayError


class Kernels:
    """Two native functions reached through an object and a namespace, as
    kiln's kernel objects and exported code reach theirs."""

    def __init__(self) -> None:
        self.add = lambda out, a, b: np.add(a, b, out=out)  # returns the output array
        self.namespace = {"scale": lambda out, a, k: np.multiply(a, k, out=out) is out and 0}

    def sites(self) -> list[tuple[object, str]]:
        return [(self, "add"), (self.namespace, "scale")]


def step(kernels: Kernels, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A "forward": an allocation, a view, two native calls."""
    tmp = torch.empty(4)
    out = torch.empty(4)
    kernels.add(tmp.numpy(), x.numpy(), y[:4].numpy())
    kernels.namespace["scale"](out.numpy(), tmp.numpy(), 3.0)
    return out


def test_a_replay_recomputes_from_the_captured_inputs() -> None:
    kernels = Kernels()
    x, y = torch.ones(4), torch.arange(8.0)
    graphs = CpuCallGraphs(kernels.sites)
    graph, out = graphs.capture(lambda: step(kernels, x, y), None)
    assert torch.equal(out, (x + y[:4]) * 3)
    assert len(graph.calls) == 2
    # the sites hold the functions again, not the recorders
    assert kernels.sites() and kernels.namespace["scale"].__name__ == "<lambda>"
    x.fill_(10.0)
    y.copy_(torch.arange(8.0) * 2)
    graphs.replay(graph)
    assert torch.equal(out, (10 + torch.arange(4.0) * 2) * 3)


def test_torch_work_during_a_capture_is_refused_and_the_sites_restored() -> None:
    kernels = Kernels()
    before = dict(kernels.namespace)
    x, y = torch.ones(4), torch.zeros(8)

    def with_torch_work() -> torch.Tensor:
        out = step(kernels, x, y)
        return out.add_(1)  # computed by torch: a replay would leave it out

    with pytest.raises(NotCapturable, match="aten::add_"):
        CpuCallGraphs(kernels.sites).capture(with_torch_work, None)
    assert kernels.namespace == before
    assert kernels.add.__name__ == "<lambda>"


@pytest.mark.parametrize("inference", [True, False])
def test_a_view_that_copies_is_refused(inference: bool) -> None:
    """``reshape`` of a non-contiguous tensor copies. Under inference mode (as
    the runner steps) the dispatch mode sees ``reshape`` itself, otherwise the
    ``clone`` it decomposes into: refused either way."""
    kernels = Kernels()
    t = torch.ones(4, 4).t()

    def copying_view() -> torch.Tensor:
        kernels.add(np.empty(4, dtype=np.float32), np.ones(4, dtype=np.float32), np.ones(4, dtype=np.float32))
        return t.reshape(16)

    with torch.inference_mode(inference), pytest.raises(NotCapturable, match="copied|aten::clone"):
        CpuCallGraphs(kernels.sites).capture(copying_view, None)


def test_a_capture_with_no_native_call_is_refused() -> None:
    with pytest.raises(NotCapturable, match="no native call"):
        CpuCallGraphs(lambda: []).capture(lambda: torch.empty(2), None)


def test_a_replayed_call_that_returns_otherwise_raises() -> None:
    codes = iter([0, 3])
    holder = {"kernel": lambda: next(codes)}
    graphs = CpuCallGraphs(lambda: [(holder, "kernel")])
    graph, _ = graphs.capture(lambda: holder["kernel"](), None)
    with pytest.raises(ReplayError, match="returned 3 on replay, 0 at capture"):
        graphs.replay(graph)


def _inside(t: torch.Tensor, chunk: torch.Tensor) -> bool:
    return chunk.data_ptr() <= t.data_ptr() < chunk.data_ptr() + chunk.numel()


def test_graphs_share_one_arena_each_capture_from_its_start() -> None:
    """Whole steps, never two at once: the graphs of two sizes take their
    buffers from the same memory, and each replay recomputes its own."""
    kernels = Kernels()
    graphs = CpuCallGraphs(kernels.sites)
    pool = graphs.new_pool()
    x, y = torch.ones(4), torch.arange(8.0)
    small, small_out = graphs.capture(lambda: step(kernels, x, y), pool)
    u, v = torch.full((4,), 2.0), torch.arange(8.0) + 1
    large, large_out = graphs.capture(lambda: step(kernels, u, v), pool)
    assert len(pool.chunks) == 1 and all(_inside(t, pool.chunks[0]) for t in (small_out, large_out))
    assert small.kept[0].data_ptr() == large.kept[0].data_ptr()  # each capture's first buffer at the start
    assert small.nbytes == large.nbytes == 2 * 4 * 4
    graphs.replay(large)
    graphs.replay(small)
    assert torch.equal(small_out, (x + y[:4]) * 3)
    graphs.replay(large)
    assert torch.equal(large_out, (u + v[:4]) * 3)


def test_a_buffer_larger_than_a_chunk_gets_one_of_its_own() -> None:
    from kiln.graphs.cpu import CaptureArena

    holder = {"kernel": lambda *args: 0}
    graphs = CpuCallGraphs(lambda: [(holder, "kernel")])
    pool = graphs.new_pool()
    n = CaptureArena.CHUNK_BYTES // 4 + 1  # fp32 elements: one past a chunk

    def two_buffers() -> torch.Tensor:
        big, small = torch.empty(n), torch.empty(3)
        holder["kernel"](big, small)
        return big

    graph, big = graphs.capture(two_buffers, pool)
    assert [c.numel() for c in pool.chunks] == [4 * n, CaptureArena.CHUNK_BYTES]  # the small one past its end
    small = next(t for t in graph.kept if t.numel() == 3)
    assert _inside(big, pool.chunks[0]) and _inside(small, pool.chunks[1])
    assert big.data_ptr() % CaptureArena.ALIGN == 0 and small.data_ptr() % CaptureArena.ALIGN == 0


def test_an_allocator_site_carves_from_the_arena_in_the_capturing_thread_only() -> None:
    """Inductor's exported code allocates through ``empty_strided_cpu``, which
    bypasses torch's dispatcher: a capture swaps it for the arena's while it
    runs, for its own thread."""
    import threading

    plain = torch._C._dynamo.guards._empty_strided_cpu
    code = {"empty_strided_cpu": plain, "kernel": lambda *args: 0}
    graphs = CpuCallGraphs(lambda: [(code, "kernel")], allocators=lambda: [(code, "empty_strided_cpu")])
    pool = graphs.new_pool()
    theirs = []

    def step() -> torch.Tensor:
        out = code["empty_strided_cpu"]((2, 3), (4, 1), torch.bfloat16)  # rows padded to 4 elements
        other = threading.Thread(target=lambda: theirs.append(code["empty_strided_cpu"]((5,), (1,), torch.float32)))
        other.start()
        other.join()
        code["kernel"](out)
        return out

    graph, out = graphs.capture(step, pool)
    assert code["empty_strided_cpu"] is plain
    assert _inside(out, pool.chunks[0]) and not _inside(theirs[0], pool.chunks[0])
    assert (out.shape, out.stride(), out.dtype) == ((2, 3), (4, 1), torch.bfloat16)
    assert graph.nbytes == (4 + 3) * 2


def test_a_decode_step_runs_the_next_graph_and_a_dropped_size_the_one_after() -> None:
    d = CUDAGraphDispatcher(CUDAGraphMode.FULL_DECODE_ONLY, [1, 2, 4, 8], support=CUDAGraphSupport.UNIFORM_DECODE,
                            has_pieces=True, max_num_seqs=8)
    assert d.dispatch(2, 2, True).descriptor == BatchDescriptor(2, 2, True)
    three = d.dispatch(3, 3, True)  # padded to the graph of 4: a padding request attends to nothing
    assert (three.mode, three.descriptor) == (CUDAGraphMode.FULL, BatchDescriptor(4, 4, True))
    assert d.dispatch(2, 1, False).mode is CUDAGraphMode.NONE  # not a uniform decode step
    assert d.dispatch(9, 9, True).mode is CUDAGraphMode.NONE  # above the largest size
    d.drop(4)
    assert d.dispatch(3, 3, True).descriptor == BatchDescriptor(8, 8, True)
    assert d.capture_sizes == [1, 2, 8]


@pytest.mark.parametrize(("max_num_seqs", "sizes"), [
    (6, [1, 2, 3, 4, 5, 6]),
    (8, [1, 2, 3, 4, 5, 6, 7, 8]),
    (12, [1, 2, 3, 4, 5, 6, 7, 8, 12]),
    (16, [1, 2, 3, 4, 5, 6, 7, 8, 16]),
    (50, [1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 48, 50]),
    (64, [1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 48, 64]),
    (256, [1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 48, 64]),
])
def test_cpu_capture_sizes_are_every_few_row_size_then_the_amx_tiles(max_num_seqs: int, sizes: list[int]) -> None:
    """Each size up to 8 requests its own graph; above, multiples of 16 up to
    64, never more request rows than the buffers hold (so ``max_num_seqs``
    itself between two of them)."""
    assert cpu_capture_sizes(max_num_seqs) == sizes
    resolved = CompilationConfig(level=2).resolve(device_type="cpu", max_num_seqs=max_num_seqs,
                                                  max_num_batched_tokens=2048)
    assert resolved.cudagraph_capture_sizes == tuple(sizes)


@pytest.mark.parametrize(("level", "mode", "expected"), [
    (2, None, CUDAGraphMode.FULL_DECODE_ONLY), (3, None, CUDAGraphMode.FULL_DECODE_ONLY),
    (1, None, CUDAGraphMode.NONE), (0, None, CUDAGraphMode.NONE),
    (2, "FULL", CUDAGraphMode.FULL_DECODE_ONLY), (2, "PIECEWISE", CUDAGraphMode.NONE), (2, "NONE", CUDAGraphMode.NONE),
])
def test_graph_modes_on_cpu_are_whole_decode_steps(level: int, mode: str | None, expected: CUDAGraphMode) -> None:
    resolved = CompilationConfig(level=level, cudagraph_mode=mode).resolve(
        device_type="cpu", max_num_seqs=6, max_num_batched_tokens=64)
    assert resolved.cudagraph_mode is expected
    assert resolved.cudagraph_capture_sizes == (1, 2, 3, 4, 5, 6)  # every decode size, up to max_num_seqs


def test_calls_from_another_thread_are_not_recorded() -> None:
    """Another engine's thread may call a shared kernel while a capture runs."""
    import threading

    calls = []
    holder = {"kernel": lambda tag: calls.append(tag) or 0}

    def step() -> None:
        holder["kernel"]("mine")
        other = threading.Thread(target=lambda: holder["kernel"]("theirs"))
        other.start()
        other.join()

    graph, _ = CpuCallGraphs(lambda: [(holder, "kernel")]).capture(step, None)
    assert calls == ["mine", "theirs"]
    assert [args for _, args, _ in graph.calls] == [("mine",)]


def test_captures_in_two_threads_at_once_each_record_their_own_and_give_the_sites_back() -> None:
    """Two engines in one process share the C kernels' sites and may capture
    at the same time, and end in either order: each records its own calls,
    carves from its own arena, and the sites hold the original functions
    after both."""
    import threading

    kernel = lambda tag: 0  # noqa: E731
    plain = torch._C._dynamo.guards._empty_strided_cpu
    code = {"kernel": kernel, "empty_strided_cpu": plain}
    graphs = CpuCallGraphs(lambda: [(code, "kernel")], allocators=lambda: [(code, "empty_strided_cpu")])
    started, first_done = threading.Barrier(2), threading.Event()
    results: dict[str, tuple] = {}

    def engine(tag: str, ends_first: bool) -> None:
        pool = graphs.new_pool()

        def step() -> torch.Tensor:
            code["kernel"](tag)
            started.wait(timeout=60)  # both captures under way
            if not ends_first:
                assert first_done.wait(timeout=60)  # the other capture ended meanwhile
            code["kernel"](tag)
            return code["empty_strided_cpu"]((4,), (1,), torch.float32)

        graph, out = graphs.capture(step, pool)
        if ends_first:
            first_done.set()
        results[tag] = (graph, out, pool)

    threads = [threading.Thread(target=engine, args=("a", True)), threading.Thread(target=engine, args=("b", False))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert set(results) == {"a", "b"}  # both captures ended
    assert code["kernel"] is kernel and code["empty_strided_cpu"] is plain
    for tag, (graph, out, pool) in results.items():
        assert [args for _, args, _ in graph.calls] == [(tag,), (tag,)]
        assert _inside(out, pool.chunks[0])


def test_a_capture_never_imports_torch_dynamo() -> None:
    """torch wraps a dispatch mode's hook so that its first call imports
    torch._dynamo (about 2 s), which a warm start replaying exported code
    never loads otherwise: a padded step's capture slices its rows, and a
    refused one runs a torch operator, and neither may pay that."""
    code = textwrap.dedent("""
        import sys
        import torch
        from kiln.graphs import CpuCallGraphs, NotCapturable
        holder = {"kernel": lambda *args: 0}
        graphs = CpuCallGraphs(lambda: [(holder, "kernel")])
        x = torch.zeros(4)
        pool = graphs.new_pool()
        with torch.inference_mode():
            graphs.capture(lambda: holder["kernel"](x[:2]) or torch.empty(3), pool)
            try:
                graphs.capture(lambda: holder["kernel"](x) or x.add(1), pool)
            except NotCapturable:
                pass
            else:
                raise SystemExit("the add was not refused")
        print("torch._dynamo" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
