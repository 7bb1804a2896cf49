"""CUDA graphs without a GPU: the dispatcher's decisions and the capture/replay
wrapper's bookkeeping (graphs emulated by ``RerunGraphs``, see tests/test_cuda_graphs.py)."""

from __future__ import annotations

import pytest
import torch

from kiln.config import CUDAGraphMode, CUDAGraphSupport, default_capture_sizes
from kiln.forward_context import BatchDescriptor, ForwardContext, set_forward_context
from kiln.graphs import CUDAGraphDispatcher, CUDAGraphWrapper, Dispatch, capture_session
from tests.conftest import RerunGraphs

NONE, PIECEWISE, FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL
F_AND_P, F_DECODE = CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY
ALWAYS, UNIFORM, NEVER = CUDAGraphSupport.ALWAYS, CUDAGraphSupport.UNIFORM_DECODE, CUDAGraphSupport.NEVER
SIZES = [1, 2, 4, 8, 16, 24, 32]


def dispatcher(mode: CUDAGraphMode, support: CUDAGraphSupport = ALWAYS, has_pieces: bool = True,
               max_num_seqs: int = 16, sizes: list[int] = SIZES) -> CUDAGraphDispatcher:
    return CUDAGraphDispatcher(mode, sizes, support=support, has_pieces=has_pieces, max_num_seqs=max_num_seqs)


# ----------------------------------------------------------------- dispatcher


def test_default_capture_sizes() -> None:
    assert default_capture_sizes(max_num_seqs=64, max_num_batched_tokens=2048)[:6] == [1, 2, 4, 8, 16, 24]
    assert default_capture_sizes(max_num_seqs=64, max_num_batched_tokens=2048)[-1] == 128
    assert default_capture_sizes(max_num_seqs=1024, max_num_batched_tokens=8192)[-1] == 512
    assert default_capture_sizes(max_num_seqs=64, max_num_batched_tokens=20) == [1, 2, 4, 8, 16]


def test_full_and_piecewise_decisions() -> None:
    d = dispatcher(F_AND_P)
    # uniform decode: FULL, tokens and requests padded together
    assert d.dispatch(3, 3, True) == _full(4, 4, True)
    assert d.dispatch(16, 16, True) == _full(16, 16, True)
    # a mixed batch: PIECEWISE, keyed by the padded token count alone
    assert d.dispatch(5, 2, False) == _piecewise(8)
    assert d.dispatch(17, 3, False) == _piecewise(24)
    # above the largest capture size: no graph, no padding
    assert d.dispatch(33, 33, True).mode is NONE
    assert d.dispatch(33, 33, True).descriptor == BatchDescriptor(33, 33, True)
    assert d.dispatch(40, 2, False).num_tokens == 40


def test_full_graph_requests_are_capped_by_max_num_seqs() -> None:
    d = dispatcher(F_AND_P, max_num_seqs=6)
    assert d.dispatch(5, 5, True) == _full(8, 6, True)


def test_full_mode_pads_mixed_batches_to_every_request_row() -> None:
    d = dispatcher(FULL, ALWAYS, max_num_seqs=16)
    assert d.dispatch(5, 2, False) == _full(8, 16, False)
    assert d.dispatch(2, 2, True) == _full(2, 2, True)


def test_full_decode_only_runs_mixed_batches_without_graphs() -> None:
    d = dispatcher(F_DECODE)
    assert d.dispatch(2, 2, True) == _full(2, 2, True)
    assert d.dispatch(7, 2, False).mode is NONE
    assert d.dispatch(7, 2, False).num_tokens == 7


def test_piecewise_mode_never_captures_full_graphs() -> None:
    d = dispatcher(PIECEWISE)
    assert d.dispatch(1, 1, True) == _piecewise(1)
    assert d.dispatch(9, 1, False) == _piecewise(16)


@pytest.mark.parametrize(
    ("requested", "support", "has_pieces", "expected"),
    [
        (F_AND_P, NEVER, True, PIECEWISE),
        (FULL, NEVER, True, PIECEWISE),
        (F_DECODE, NEVER, True, NONE),
        (FULL, UNIFORM, True, F_AND_P),
        (F_AND_P, UNIFORM, True, F_AND_P),
        (PIECEWISE, ALWAYS, False, NONE),
        (F_AND_P, ALWAYS, False, F_DECODE),
        (FULL, ALWAYS, False, FULL),
        (F_AND_P, NEVER, False, NONE),
        (NONE, ALWAYS, True, NONE),
    ],
)
def test_mode_downgrades_to_what_backend_and_model_allow(requested, support, has_pieces, expected) -> None:
    assert dispatcher(requested, support, has_pieces).mode is expected


def test_uniform_decode_backend_keeps_mixed_batches_out_of_full_graphs() -> None:
    d = dispatcher(FULL, UNIFORM)
    assert d.dispatch(4, 4, True).mode is FULL
    assert d.dispatch(4, 2, False) == _piecewise(4)


def test_capture_plan_is_largest_first_and_covers_every_dispatch() -> None:
    d = dispatcher(F_AND_P, sizes=[1, 2, 4, 8])
    plan = d.capture_plan()
    assert [p.num_tokens for p in plan] == [8, 8, 4, 4, 2, 2, 1, 1]
    keys = {(p.mode, p.descriptor) for p in plan}
    for n, r, uniform in [(1, 1, True), (3, 3, True), (5, 2, False), (8, 8, True), (8, 1, False)]:
        got = d.dispatch(n, r, uniform)
        assert (got.mode, got.descriptor) in keys
    assert dispatcher(NONE).capture_plan() == []
    # uniform decode never exceeds max_num_seqs tokens: no FULL decode graphs above the
    # first size that holds them
    few_seqs = dispatcher(F_AND_P, sizes=[1, 2, 4, 8, 16], max_num_seqs=3)
    assert [p.num_tokens for p in few_seqs.capture_plan() if p.mode is FULL] == [4, 2, 1]
    full_keys = {p.descriptor for p in few_seqs.capture_plan() if p.mode is FULL}
    assert all(few_seqs.dispatch(n, n, True).descriptor in full_keys for n in (1, 2, 3))
    assert len(dispatcher(FULL, ALWAYS, sizes=[1, 2]).capture_plan()) == 4  # uniform and mixed per size


def test_a_graph_mode_needs_capture_sizes() -> None:
    with pytest.raises(ValueError, match="capture size"):
        dispatcher(F_AND_P, sizes=[])


def _full(t: int, r: int, uniform: bool) -> Dispatch:
    return Dispatch(FULL, BatchDescriptor(t, r, uniform))


def _piecewise(t: int) -> Dispatch:
    return Dispatch(PIECEWISE, BatchDescriptor(t, None, False))


# ----------------------------------------------------------------- wrapper


def _context(mode: CUDAGraphMode, desc: BatchDescriptor | None) -> ForwardContext:
    return ForwardContext(attn_metadata=None, kv_caches=[], batch_descriptor=desc, cudagraph_mode=mode)


def test_wrapper_captures_once_per_descriptor_and_replays_the_captured_output() -> None:
    graphs = RerunGraphs()
    calls = []

    def double(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return x * 2

    w = CUDAGraphWrapper(double, FULL, graphs, graphs.new_pool(), name="double")
    x = torch.ones(4)
    d4 = BatchDescriptor(4, 4, True)
    with set_forward_context(_context(FULL, d4)):
        with capture_session():
            first = w(x)
        x.fill_(3)  # the runner refreshes the buffer in place
        again = w(x)
    assert graphs.captures == 1 and graphs.replays == 1 and w.replays == 1
    assert again is first  # the captured output tensor, refreshed
    assert torch.equal(again, torch.full((4,), 6.0))
    # another mode passes straight through, capturing nothing
    with set_forward_context(_context(PIECEWISE, d4)):
        assert torch.equal(w(torch.ones(2)), torch.full((2,), 2.0))
    assert graphs.captures == 1
    # an unknown descriptor outside the load-time capture session is an error, not a capture
    with set_forward_context(_context(FULL, BatchDescriptor(8, 8, True))), pytest.raises(RuntimeError, match="no FULL"):
        w(torch.ones(8))


def test_wrapper_detects_inputs_that_moved_since_capture() -> None:
    graphs = RerunGraphs()
    w = CUDAGraphWrapper(lambda x: x + 1, PIECEWISE, graphs, graphs.new_pool(), check_addresses=True)
    d = BatchDescriptor(2, None, False)
    with set_forward_context(_context(PIECEWISE, d)):
        with capture_session():
            w(torch.zeros(2))
        with pytest.raises(RuntimeError, match="moved since capture"):
            w(torch.zeros(2))


def test_wrapper_mode_must_be_full_or_piecewise() -> None:
    with pytest.raises(ValueError, match="FULL or PIECEWISE"):
        CUDAGraphWrapper(lambda: None, F_AND_P, RerunGraphs(), None)


