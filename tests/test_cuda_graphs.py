"""CUDA graphs in a running engine: generation through captured-and-replayed
steps. On CPU, graphs are emulated by ``tests.conftest.RerunGraphs``, so the
runner's padding and its fixed-address inputs are checked for real; the GPU
tests at the end run real graphs. The dispatcher and wrapper alone are tested in
tests/unit/test_cuda_graph_dispatch.py.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from kiln import Runtime, SamplingParams
from kiln.config import CompilationConfig, CUDAGraphMode
from kiln.graphs import CUDAGraphDispatcher
from tests.conftest import RerunGraphs, build_hf_model, hf_greedy, load_eager, random_prompts, save_checkpoint

NONE, PIECEWISE, FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL
F_AND_P = CUDAGraphMode.FULL_AND_PIECEWISE
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


# ----------------------------------------------------------------- CPU runtime


def test_graph_modes_resolve_to_none_on_cpu(llama_checkpoint, caplog) -> None:
    path, model = llama_checkpoint
    prompts = random_prompts(3, [4, 9, 15], model.config.vocab_size, seed=7)
    expected = [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    config = CompilationConfig(level=2, cudagraph_mode="FULL_AND_PIECEWISE")
    with caplog.at_level("INFO", logger="kiln.config"):
        resolved = config.resolve(device_type="cpu", max_num_seqs=4, max_num_batched_tokens=64)
    assert resolved.cudagraph_mode is NONE
    assert sum("resolves to NONE" in r.getMessage() for r in caplog.records) == 1
    rt = Runtime.load(path, device="cpu", optimization_level=2, compile_sizes=[1, 2, 4],
                      cudagraph_mode="FULL_AND_PIECEWISE")
    assert rt.startup_report["cudagraph_mode"] == "NONE"
    assert rt.startup_report["cudagraphs_captured"] == 0
    assert [o.token_ids for o in rt.generate(prompts, GREEDY)] == expected
    assert [o.token_ids for o in load_eager(path, device="cpu").generate(prompts, GREEDY)] == expected


# Under emulation Triton runs in its interpreter, which only CPU-only machines turn on;
# on a GPU the real graphs of test_gpu_graph_modes_match_eager cover that backend.
_INTERPRETED_TRITON = pytest.param(
    "triton", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="Triton runs compiled on this GPU machine")
)


@pytest.mark.parametrize("backend", ["torch", _INTERPRETED_TRITON])
def test_emulated_graphs_generate_the_eager_tokens(llama_checkpoint, backend: str) -> None:
    """FULL_AND_PIECEWISE with graphs emulated on CPU: the torch backend runs
    PIECEWISE only (it declares no FULL support), Triton gets FULL decode graphs
    with padded request rows. Tokens must equal -O0's."""
    path, model = llama_checkpoint
    prompts = random_prompts(3, [4, 13, 22], model.config.vocab_size, seed=2)
    expected = [o.token_ids for o in load_eager(path, device="cpu").generate(prompts, GREEDY)]
    assert expected == [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]

    rt = Runtime.load(path, device="cpu", optimization_level=2, compile_sizes=[1, 2, 4],
                      attention_backend=backend, max_num_batched_tokens=8, max_num_seqs=4)
    runner = rt.engine.runner
    d = CUDAGraphDispatcher(F_AND_P, [1, 2, 4, 8], support=runner.attention_backend.cudagraph_support,
                            has_pieces=True, max_num_seqs=4)
    graphs = RerunGraphs()
    runner.install_cuda_graphs(d, graphs, check_addresses=True)
    report = runner.capture_graphs(progress=False)
    assert report.graphs == len(d.capture_plan()) == (7 if backend == "triton" else 4)  # FULL decode at 1, 2, 4

    padded = []
    dispatch = runner._dispatch

    def spy(shape):
        d = dispatch(shape)
        if d.num_tokens != shape.num_tokens or d.mode is FULL:
            padded.append((shape.num_tokens, d.mode, d.num_tokens, d.descriptor.num_reqs))
        return d

    runner._dispatch = spy
    before = graphs.replays
    assert [o.token_ids for o in rt.generate(prompts, GREEDY)] == expected
    assert graphs.replays > before
    # the decode steps of 3 requests ran padded to 4 tokens (and, FULL, to 4 requests)
    if backend == "triton":
        assert (3, FULL, 4, 4) in padded
    else:
        assert (3, PIECEWISE, 4, None) in padded
        assert all(mode is PIECEWISE for _, mode, _, _ in padded)
    # chunked prefill under the 8-token budget left some mixed steps to pad as well
    assert any(n < t and mode is PIECEWISE for n, mode, t, _ in padded)


# ----------------------------------------------------------------- GPU

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GPU_FAMILIES = {
    "llama": {},
    "mistral": {"head_dim": 32, "sliding_window": 8},
    "qwen2": {"num_key_value_heads": 1, "tie_word_embeddings": True},
    "qwen3": {"head_dim": 32},
}


@cuda_only
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("family", sorted(GPU_FAMILIES))
def test_gpu_graph_modes_match_eager(family: str, dtype: str, tmp_path) -> None:
    model = build_hf_model(family, seed=zlib.crc32(family.encode()) % 1000, **GPU_FAMILIES[family])
    path = save_checkpoint(model, tmp_path / family)
    # 3 requests: decode steps pad 3 -> 4 tokens; a 10-token budget chunks the prefills
    prompts = random_prompts(3, [5, 17, 26], model.config.vocab_size, seed=3)
    common = dict(device="cuda", dtype=dtype, max_num_batched_tokens=10, max_num_seqs=4)
    expected = [o.token_ids for o in Runtime.load(path, optimization_level=0, **common).generate(prompts, GREEDY)]
    for mode in ("NONE", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE"):
        rt = Runtime.load(path, optimization_level=1, cudagraph_mode=mode, **common)
        report = rt.startup_report
        assert report["cudagraph_mode"] == mode
        assert (report["cudagraphs_captured"] > 0) == (mode != "NONE")
        got = [o.token_ids for o in rt.generate(prompts, GREEDY)]
        assert got == expected, f"{family} {dtype} {mode}"
