"""-O1..-O3: one trace, split at attention, per-bucket pieces, dispatch by token count.

Compiles are the slow part of the suite; every test here shares Inductor's cache,
so a graph compiled once (the same piece at the same bucket) is a cache hit after.
"""

from __future__ import annotations

import pytest
import torch

from kiln import CompilationConfig, CUDAGraphMode, Runtime, SamplingParams
from kiln.compiler import TokenCountError
from kiln.compiler import capture as capture_module
from kiln.compiler import cpu_linear, onednn
from kiln.compiler.pipeline import WIDENED_HEAD_MAX_ROWS
from tests.conftest import CPU_LM_HEADS, build_hf_model, hf_greedy, load_eager, random_prompts, save_checkpoint
from tests.test_models import VARIANTS

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
FAMILIES = {
    "llama": "llama-gqa-legacy-rope",
    "mistral": "mistral-headdim-sliding",
    "qwen2": "qwen2-bias-tied-yarn-legacy",
    "qwen3": "qwen3-qknorm-headdim",
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_case(request, tmp_path_factory):
    family, overrides, save_opts = VARIANTS[FAMILIES[request.param]]
    model = build_hf_model(family, seed=11, **overrides)
    path = save_checkpoint(model, tmp_path_factory.mktemp(request.param), **save_opts)
    prompts = random_prompts(3, [4, 13, 22], model.config.vocab_size, seed=2)
    expected = [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    eager = load_eager(path).generate(prompts, GREEDY)
    assert [o.token_ids for o in eager] == expected
    return path, prompts, expected


@pytest.mark.parametrize("level", [1, 2, 3])
def test_levels_match_eager_and_transformers(family_case, level) -> None:
    path, prompts, expected = family_case
    rt = Runtime.load(path, optimization_level=level)
    assert rt.startup_report["dynamo_traces"] == 1
    assert [o.token_ids for o in rt.generate(prompts, GREEDY)] == expected
    # the tight budget of the runtime tests: chunked prefill and preemption, compiled
    tight = Runtime.load(path, optimization_level=level, max_num_batched_tokens=8, num_kv_blocks=10,
                         block_size=4, max_num_seqs=3)
    assert [o.token_ids for o in tight.generate(prompts, GREEDY)] == expected
    assert tight.engine.scheduler.num_preemptions > 0


@pytest.fixture(scope="module")
def compiled_llama(llama_checkpoint):
    path, model = llama_checkpoint
    rt = Runtime.load(path, optimization_level=2, compile_sizes=[1, 2, 4])
    return rt, model


def test_startup_report_counts(compiled_llama) -> None:
    rt, model = compiled_llama
    r = rt.startup_report
    layers = model.config.num_hidden_layers
    assert r["optimization_level"] == 2
    # The session's compile cache is shared: a test that ran earlier (with -k, or in
    # another order) may have built this entry, and then it is loaded, not compiled.
    fresh = r["compile_cache"] == "miss"
    assert r["compile_cache"] in ("miss", "hit")
    assert r["dynamo_traces"] == (1 if fresh else 0)
    assert r["pieces"] == layers + 1  # compute pieces between the layers' attention calls
    assert r["unique_pieces"] == 3  # first, middle (shared by every layer), last
    # Per unique piece: the range, and exact sizes 1, 2 and 4; where the C linear kernel
    # is built, one few-row runnable serves 2 to 8 tokens instead of sizes 2 and 4, and it
    # is the LM head; without it, a compiled CPU LM head at each exact size.
    artifacts = r["unique_pieces"] * (1 + (3 if CPU_LM_HEADS else 2)) + CPU_LM_HEADS
    assert (r["inductor_compiles"], r["artifacts_loaded"]) == ((artifacts, 0) if fresh else (0, artifacts))
    assert sorted(rt.compiled.model.logits_heads) == ([1, 2, 4] if CPU_LM_HEADS else [])
    assert (rt.compiled.model.linear_kernel is None) == bool(CPU_LM_HEADS)
    assert len(r["compile_seconds"]) == r["inductor_compiles"]
    for phase in ("load_weights",) + (("trace", "split", "compile") if fresh else ()):
        assert r["phases"][phase] >= 0
    # CPU: call graphs (kiln.graphs.cpu) of uniform decode steps, captured by each size's first step
    assert r["cudagraph_mode"] == "FULL_DECODE_ONLY"
    assert r["cudagraphs_captured"] == 0
    # every linear's weight and the tied LM head's, reordered for oneDNN in a thread (kiln.compiler.onednn)
    if onednn.available(torch.device("cpu")):
        linears = [m.weight for m in rt.compiled.model.model.modules() if isinstance(m, torch.nn.Linear)]
        head = rt.compiled.model.model.logits_inputs()[0][0]
        unique = {w.data_ptr(): w.numel() * 4 for w in [*linears, head]}
        # and the head's bf16 tiles for the greedy screen, where the kernel has AMX (kiln.compiler.greedy_head)
        screen = head.numel() * 2 if rt.compiled.model.greedy_head is not None else 0
        assert r["reordered_weight_bytes"] == sum(unique.values()) + screen
        # what a greedy step reads of the head with the screen: tiles and norms, in place of the fp32 head
        assert r["greedy_screen"] == ({"head_bytes": head.numel() * 4, "tile_bytes": screen + head.shape[0] * 4}
                                      if screen else None)
        rt.compiled.model.reordering.join(timeout=60)
        assert not rt.compiled.model.reordering.is_alive()


def test_decode_steps_cause_no_new_trace(compiled_llama) -> None:
    rt, model = compiled_llama
    traces = capture_module.TRACE_COUNT
    calls = torch._dynamo.utils.counters["stats"]["calls_captured"]
    prompt = random_prompts(1, [9], model.config.vocab_size, seed=3)[0]
    out = rt.generate(prompt, GREEDY)[0]  # a 9-token prefill, then T=1 decode steps
    assert out.token_ids == hf_greedy(model, prompt, GREEDY.max_tokens)
    assert capture_module.TRACE_COUNT == traces
    assert torch._dynamo.utils.counters["stats"]["calls_captured"] == calls


def test_dispatch_prefers_exact_size_then_range(llama_checkpoint) -> None:
    # without CPU call graphs: a replayed decode step calls the kernels its
    # capture recorded and picks no runnable (tests/test_cuda_graphs.py)
    path, model = llama_checkpoint
    rt = Runtime.load(path, optimization_level=2, compile_sizes=[1, 2, 4], cudagraph_mode="NONE")
    backends = list(rt.compiled.model.pieces.values())
    vocab = model.config.vocab_size
    rid = rt.add_request(random_prompts(1, [17], vocab, seed=4)[0], GREEDY)
    rt.step()  # prefill of 17 tokens: no exact or few-row runnable for 17
    assert {b.last_bucket for b in backends} == {"range"}
    rt.step()  # one decode token: the exact size-1 runnable
    assert {b.last_bucket for b in backends} == {1}
    rt.abort(rid)
    two = [rt.add_request(p, GREEDY) for p in random_prompts(2, [5, 7], vocab, seed=5)]
    rt.step()
    rt.step()  # two decode tokens: exact size 2, or the few-row runnable with the C linear kernel
    assert {b.last_bucket for b in backends} == ({2} if CPU_LM_HEADS else {"few"})
    for r in two:
        rt.abort(r)
    backend = backends[0]
    if CPU_LM_HEADS:
        assert backend.select(4)[1] == 4
        assert backend.select(5)[1] == "range"
    else:
        # an fp32 model: the few-row runnable up to the rows the kernel's policy gives its loop (16 a call,
        # or 8 where its fp32 panels take more)
        few = rt.compiled.model.linear_kernel.policy.f32_rows
        assert backend.few_rows == (2, few) and not set(backend.exact) & {2, 4}
        assert [backend.select(n)[1] for n in (1, 2, 3, 4, 8, 9, 16, 17)] == [
            1, *["few"] * 4, *["few" if n <= few else "range" for n in (9, 16)], "range"]
    with pytest.raises(TokenCountError, match="no compiled runnable covers 100000 tokens"):
        backend.select(100000)
    with pytest.raises(TokenCountError):
        backend.select(0)


def test_steps_of_two_to_eight_tokens_give_transformers_tokens(compiled_llama) -> None:
    """Prefills of 2-8 tokens and decode steps of 6 rows: the few-row runnable
    where the C linear kernel is built (exact sizes or the range elsewhere)."""
    rt, model = compiled_llama
    prompts = random_prompts(6, [2, 3, 5, 6, 7, 8], model.config.vocab_size, seed=6)
    outs = rt.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    last = {b.last_bucket for b in rt.compiled.model.pieces.values()}  # the last step decoded 6 rows
    assert last == ({"range"} if CPU_LM_HEADS else {"few"})


def test_the_fp32_lm_head_is_the_c_kernel_up_to_its_few_rows(compiled_llama) -> None:
    """The few-row loop takes up to 16 rows, or 8 where the kernel's fp32
    panels take more (through the op, ``onednn.implementation``)."""
    rt, model = compiled_llama
    compiled = rt.compiled.model
    kernel, weight = compiled.linear_kernel, compiled.model.logits_inputs()[0][0]
    for rows in (1, 5, 8, 9, 16, 17):
        hidden = torch.randn(rows, model.config.hidden_size, generator=torch.Generator().manual_seed(rows))
        logits = compiled.compute_logits(hidden)
        if kernel is not None and rows <= kernel.policy.most_rows("f32"):
            assert torch.equal(logits, kernel(hidden, weight, None, None, None, "f32"))
        elif onednn.available(hidden.device):
            assert torch.equal(logits, onednn.implementation(hidden, weight, None))
        torch.testing.assert_close(logits, hidden @ weight.T, atol=1e-4, rtol=1e-4)


def test_a_bf16_head_onednn_would_widen_is_the_c_kernel_up_to_64_rows(compiled_llama, tmp_path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Where oneDNN has no bf16 kernels its op widens bf16 to fp32 (the whole
    head per call): the C kernel, 8 rows a call, is faster up to 64 rows. The
    fp32 model's kernel holds only fp32, so a build with every kind stands in."""
    compiled = compiled_llama[0].compiled.model
    if compiled.linear_kernel is not None:
        every_kind = cpu_linear.CpuLinearKernel(tmp_path / cpu_linear.build(tmp_path))
        monkeypatch.setattr(compiled, "linear_kernel", every_kind)
    kernel = compiled.linear_kernel
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(300, 64, generator=g).bfloat16()
    for rows in (9, 64, 65):
        hidden = torch.randn(rows, 64, generator=g).bfloat16()
        logits = compiled._native_head(hidden, [weight], None)
        if kernel is not None and torch.bfloat16 in onednn.WIDENED and rows <= WIDENED_HEAD_MAX_ROWS:
            assert logits is not None and torch.equal(logits, kernel(hidden, weight, None, None, None, "bf16"))
            torch.testing.assert_close(logits.float(), hidden.float() @ weight.float().T, atol=0.05, rtol=2 ** -7)
        elif kernel is not None and kernel.amx:  # bf16 on the AMX tiles (LinearPolicy.to_tiles), any rows
            assert logits is not None and torch.equal(logits, onednn.implementation(hidden, weight, None))
            torch.testing.assert_close(logits.float(), hidden.float() @ weight.float().T, atol=0.05, rtol=2 ** -7)
        else:
            assert logits is None  # the head's other paths: oneDNN, compiled heads or torch


def test_user_compile_sizes_reach_the_runtime(llama_checkpoint) -> None:
    rt = Runtime.load(llama_checkpoint[0], optimization_level=1, compile_sizes=[2])
    assert rt.startup_report["compilation"]["compile_sizes"] == [2]
    # 3 unique pieces x (range, 2); a compiled LM head at 2 rows only where the C
    # linear kernel does not take it (a CPU without AVX2)
    assert rt.startup_report["inductor_compiles"] == 3 * 2 + (1 if CPU_LM_HEADS else 0)
    if CPU_LM_HEADS:
        assert all(sorted(b.exact) == [2] for b in rt.compiled.model.pieces.values())
    else:  # size 2 is served by the few-row runnable, compiled for 2 to 16 tokens (8 with fp32 panels)
        few = rt.compiled.model.linear_kernel.policy.f32_rows
        assert all(not b.exact and b.few_rows == (2, few) for b in rt.compiled.model.pieces.values())


def test_compilations_do_not_grow_with_depth(tmp_path) -> None:
    counts = {}
    for layers in (2, 24):
        model = build_hf_model("llama", num_hidden_layers=layers, hidden_size=32, intermediate_size=64,
                               num_attention_heads=2, num_key_value_heads=1)
        path = save_checkpoint(model, tmp_path / f"l{layers}")
        r = Runtime.load(path, optimization_level=1).startup_report
        counts[layers] = (r["inductor_compiles"], r["unique_pieces"], r["pieces"])
    assert counts[2][:2] == counts[24][:2] == (3, 3)
    assert (counts[2][2], counts[24][2]) == (3, 25)
