"""Compiled entries whose CPU artifacts load without Inductor (kiln.compiler.replay):
the same kernels, so the same results to the bit, and Inductor's loader wherever
an artifact does not qualify."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kiln import Runtime, SamplingParams
from kiln.compiler import artifacts, replay
from tests.conftest import random_prompts

SCORED = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)


def _scored(rt: Runtime, prompts: list[list[int]]) -> list[tuple[list[int], list]]:
    return [(o.token_ids, o.logprobs) for o in rt.generate(prompts, SCORED)]


def _entry(rt: Runtime) -> Path:
    assert rt.compiled is not None
    return rt.compiled.entry


@pytest.fixture(scope="module")
def compiled_tiny(tiny, tmp_path_factory):
    """The tiny model compiled at -O2 into a fresh cache (four batch sizes of
    prompts), with the runnables the compiling process ran them on."""
    path, _, _ = tiny
    cache = tmp_path_factory.mktemp("replay") / "cache"
    rt = Runtime.load(path, optimization_level=2, cache_dir=cache)
    prompts = random_prompts(4, [3, 11, 6, 17], 64, seed=3)
    assert rt.compiled is not None
    runnables = [fn for p in rt.compiled.model.pieces.values() for fn in [p.range, p.few, *p.exact.values()]
                 if fn is not None]
    compiled_here = (rt.startup_report["compile_cache"], rt.startup_report["artifact_loader"], runnables)
    return path, cache, prompts, _scored(rt, prompts), compiled_here


def test_the_process_that_compiled_runs_the_exported_code(compiled_tiny) -> None:
    """After saving the entry, the compiling process swaps Inductor's fresh
    artifacts for the exported code a warm start runs (faster per step)."""
    *_, (cache_state, loader, runnables) = compiled_tiny
    assert cache_state == "miss" and loader == "replay"
    assert runnables and all(isinstance(fn, replay.ReplayedArtifact) for fn in runnables)


def test_every_cpu_artifact_is_exported_and_a_warm_start_replays_them(compiled_tiny) -> None:
    path, cache, prompts, fresh, _ = compiled_tiny
    warm = Runtime.load(path, optimization_level=2, cache_dir=cache)
    manifest = json.loads((_entry(warm) / "manifest.json").read_text())
    assert replay.covers(manifest) and set(manifest["replay"]) == set(replay.artifacts(manifest))
    direct = onednn_calls = activations = 0
    for record in manifest["replay"].values():
        assert record["libraries"] and set(record["libraries"]) <= set(manifest["kernels"])
        assert record["code"] in manifest["files"]  # checksummed like the rest of the entry
        code = (_entry(warm) / record["code"]).read_text()
        assert "torch._inductor" not in code and "async_compile" not in code
        # Inductor's per-call size checks are dropped (the inputs are the split graph's own)
        assert "assert_size_stride(" not in code and "assert_alignment(" not in code
        # the C linear kernel's op is called without the dispatcher
        assert "torch.ops.kiln.cpu_linear.default(" not in code
        assert "torch.ops.kiln.onednn_linear.default(" not in code
        assert "torch.ops.kiln.silu_mul.default(" not in code
        direct += code.count("__kiln_cpu_linear__(")
        onednn_calls += code.count("__kiln_onednn_linear__(")
        activations += code.count("__kiln_silu_mul__(")
    # the few-row pieces call it for their linears (fp32 at one token only in an AVX-512 build: f32_one_row)
    assert direct > 0 or manifest.get("linear_kernel") is None
    # the range pieces' fp32 linears go through oneDNN (kiln.compiler.onednn)
    assert onednn_calls > 0 or not torch.backends.mkldnn.is_available()
    # the MLP's activation after those linears is one C loop too (kiln.compiler.activation)
    assert activations > 0 or manifest.get("linear_kernel") is None
    assert warm.startup_report["artifact_loader"] == "replay"
    assert warm.startup_report["artifacts_loaded"] == len(manifest["replay"])
    assert _scored(warm, prompts) == fresh  # tokens and logprobs, to the bit


def test_replayed_and_inductor_loaded_artifacts_agree_to_the_bit(compiled_tiny, tmp_path) -> None:
    """The same entry without its replay records loads through Inductor: every
    logprob of every step equals the replay's (and the process's first, fresh
    compile's)."""
    path, cache, prompts, fresh, _ = compiled_tiny
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy, ignore=shutil.ignore_patterns("locks"))
    for manifest_path in (copy / "compiled").glob("*/manifest.json"):
        manifest = json.loads(manifest_path.read_text())
        manifest.pop("replay")
        manifest_path.write_text(json.dumps(manifest))
    through_inductor = Runtime.load(path, optimization_level=2, cache_dir=copy)
    assert through_inductor.startup_report["artifact_loader"] == "inductor"
    assert through_inductor.startup_report["compile_cache"] == "hit"
    replayed = Runtime.load(path, optimization_level=2, cache_dir=cache)
    assert replayed.startup_report["artifact_loader"] == "replay"
    assert _scored(through_inductor, prompts) == _scored(replayed, prompts) == fresh


def test_exported_code_that_fails_to_load_falls_back_to_inductor(compiled_tiny, monkeypatch, caplog) -> None:
    path, cache, prompts, fresh, _ = compiled_tiny

    def broken(entry, record, inductor_dir):
        raise ImportError("kernel library refused")

    monkeypatch.setattr(replay, "load", broken)
    with caplog.at_level("WARNING", logger="kiln.compiler.artifacts"):
        rt = Runtime.load(path, optimization_level=2, cache_dir=cache)
    assert rt.startup_report["artifact_loader"] == "inductor"
    assert any("kernel library refused" in r.getMessage() and "Inductor loads" in r.getMessage()
               for r in caplog.records)
    assert _scored(rt, prompts) == fresh


def _saved_artifact(fn, inputs: list[torch.Tensor], where: Path) -> Path:
    """``fn`` traced, compiled by Inductor for ``inputs`` and saved as kiln saves
    artifacts; where its kernels went is ``where / "inductor"``."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    gm = torch.fx.symbolic_trace(fn)
    with temporary_cache_dir(str(where / "inductor")), artifacts.inductor_settings():
        compiled = torch._inductor.standalone_compile(gm, inputs, dynamic_shapes="from_example_inputs",
                                                      options={"config_patches": {"compile_threads": 1}})
        (where / "artifacts").mkdir(parents=True)
        compiled.save(path=str(where / "artifacts" / "a.bin"), format="binary")
    return where / "artifacts" / "a.bin"


def _libraries(inductor: Path) -> set[str]:
    return {str(p.relative_to(inductor)) for p in inductor.rglob("*.so")}


def _wrapped(part: str, field: str, value) -> tuple[SimpleNamespace, SimpleNamespace]:
    """An AOTAutograd result and an Inductor graph as a plain CPU inference
    artifact has them, with one field changed."""
    meta = SimpleNamespace(num_mutated_inp_runtime_indices=0, num_outputs_aliased=0, num_intermediate_bases=0,
                           tokens={}, is_rng_op_functionalized=False, num_outputs_rng_offset=0)
    result = SimpleNamespace(runtime_metadata=meta, compiled_bw=None, maybe_subclass_meta=None,
                             indices_of_inps_to_detach=[], dispatch_wrappers=[SimpleNamespace(needs_post_compile=False)])
    graph = SimpleNamespace(mutated_input_idxs=set(), constants={}, torchbind_constants={}, inputs_to_check=[],
                            _defers_input_alignment=False, device_types={"cpu"})
    setattr({"meta": meta, "result": result, "graph": graph}[part], field, value)
    return result, graph


@pytest.mark.parametrize(("part", "field", "value", "reason"), [
    ("result", "compiled_bw", object(), "a backward graph"),
    ("result", "maybe_subclass_meta", object(), "tensor subclasses"),
    ("result", "dispatch_wrappers", [SimpleNamespace(needs_post_compile=True)], "wrappers with run-time work"),
    ("result", "dispatch_wrappers", [SimpleNamespace()], "wrappers with run-time work"),
    ("meta", "num_mutated_inp_runtime_indices", 1, "mutated inputs"),
    ("meta", "num_outputs_aliased", 1, "aliased outputs"),
    ("meta", "num_intermediate_bases", 1, "aliased outputs"),
    ("meta", "tokens", {0: object()}, "effect tokens"),
    ("meta", "is_rng_op_functionalized", True, "functionalised RNG"),
    ("graph", "constants", {"c": torch.ones(1)}, "constants"),
    ("graph", "inputs_to_check", [0], "inputs to realign"),
    ("graph", "device_types", {"cpu", "cuda"}, "devices other than the CPU"),
])
def test_wrappers_with_run_time_work_keep_inductors_loader(part, field, value, reason) -> None:
    replay._check_wrappers(*_wrapped("graph", "constants", {}))  # the plain artifact qualifies
    with pytest.raises(replay.NotReplayable, match=reason):
        replay._check_wrappers(*_wrapped(part, field, value))


def test_a_plain_graph_is_exported_and_replays_its_artifact_exactly(tmp_path) -> None:
    def mlp(x, w, b):
        return (torch.nn.functional.silu(x @ w.T + b) * 2,)

    inputs = [torch.randn(4, 64), torch.randn(32, 64), torch.randn(32)]
    _saved_artifact(mlp, inputs, tmp_path)
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    inductor = tmp_path / "inductor"
    with temporary_cache_dir(str(inductor)), artifacts.inductor_settings():
        record = replay.export(tmp_path, "artifacts/a.bin", inductor, _libraries(inductor))
        loaded = torch._inductor.CompiledArtifact.load(path=str(tmp_path / "artifacts" / "a.bin"), format="binary")
        expected = loaded(*inputs)
    assert record["libraries"] and "extern_kernels.addmm" in (tmp_path / record["code"]).read_text()
    replayed = replay.load(tmp_path, record, inductor)
    with torch.enable_grad():
        got = replayed(*inputs)
    assert len(got) == len(expected) == 1 and torch.equal(got[0], expected[0])
    assert not got[0].requires_grad
    with pytest.raises(replay.NotReplayable, match="not among the entry's"):  # a library it does not list
        with temporary_cache_dir(str(inductor)), artifacts.inductor_settings():
            replay.export(tmp_path, "artifacts/a.bin", inductor, set())


@pytest.mark.parametrize(("source", "reason"), [
    ("from torch._inductor.runtime.triton_heuristics import grid\n", "imports grid"),
    ("import triton\n", "imports triton"),
    ("from torch._inductor.codegen.memory_planning import _align\n", "imports _align from"),  # not as align
    ("from torch._inductor.select_algorithm import extern_kernels\n"
     "def call(args):\n    return extern_kernels._mm_plus_mm(*args)\n", "extern kernel _mm_plus_mm"),
    ("from torch._inductor.hooks import run_intermediate_hooks\n"
     "def call(args):\n    run_intermediate_hooks('x', args)\n", "uses run_intermediate_hooks"),
    ("x = async_compile.triton('k', '''src''')\n", "uses async_compile"),
    ("from torch._inductor.async_compile import AsyncCompile\nAsyncCompile.warm_pool()\n", "uses AsyncCompile"),
])
def test_code_that_needs_inductor_at_run_time_is_refused(source, reason, tmp_path) -> None:
    with pytest.raises(replay.NotReplayable, match=reason):
        replay._rewrite(source, tmp_path, set())
