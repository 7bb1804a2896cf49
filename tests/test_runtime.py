"""The synchronous front-end as users drive it: interleaved and paused streams,
several threads on one Runtime, and API edges that must fail early and clearly."""

from __future__ import annotations

import json
import shutil
import threading

import numpy as np
import pytest
import torch

from kiln import RequestNotFoundError, Runtime, SamplingParams
from tests.conftest import load_eager

PARAMS = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def rt(demo_tokenizer_dir) -> Runtime:
    return load_eager(demo_tokenizer_dir)


@pytest.fixture(scope="module")
def reference(rt):
    prompts = ["The quick brown fox", "Return the value", "A file is"]
    return prompts, {p: rt.generate(p, PARAMS)[0] for p in prompts}


def _collect(deltas: list) -> tuple[str, list[int], str | None]:
    return "".join(d.text for d in deltas), sum((d.token_ids for d in deltas), []), deltas[-1].finish_reason


def test_streams_read_alternately_each_get_all_of_their_output(rt, reference) -> None:
    prompts, ref = reference
    streams = [rt.stream(p, PARAMS) for p in prompts[:2]]
    got: list[list] = [[], []]
    live = [True, True]
    while any(live):
        for i, s in enumerate(streams):
            if live[i]:
                delta = next(s, None)
                if delta is None:
                    live[i] = False
                else:
                    got[i].append(delta)
    for p, deltas in zip(prompts, got):
        assert _collect(deltas) == (ref[p].text, ref[p].token_ids, "length")
        assert all(d.finish_reason is None for d in deltas[:-1])
    assert not rt.has_unfinished()


def test_a_stream_paused_while_generate_runs_loses_nothing(rt, reference) -> None:
    prompts, ref = reference
    stream = rt.stream(prompts[0], PARAMS)
    first = next(stream)
    out = rt.generate(prompts[1], PARAMS)[0]  # steps the engine to the end for both
    assert out.token_ids == ref[prompts[1]].token_ids
    rest = list(stream)
    assert _collect([first, *rest]) == (ref[prompts[0]].text, ref[prompts[0]].token_ids, "length")


def test_six_threads_share_one_runtime(rt, reference) -> None:
    prompts, ref = reference
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            mine = [prompts[i % 3], prompts[(i + 1) % 3]]
            results[i] = [o.token_ids for o in rt.generate(mine, PARAMS)]
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    for i in range(6):
        assert results[i] == [ref[prompts[i % 3]].token_ids, ref[prompts[(i + 1) % 3]].token_ids]
    assert not rt.has_unfinished() and rt.stats().kv_cache_usage == 0.0


def test_stream_validates_when_called(rt) -> None:
    with pytest.raises(ValueError, match=r"SamplingParams\.max_tokens"):
        rt.stream("hello", SamplingParams(max_tokens=-1))  # no next() needed
    assert not rt.has_unfinished()


@pytest.mark.parametrize(
    "prompts, params, match",
    [
        ("hi", SamplingParams(stop=5), r"params\[0\]\.stop must be a string or a list"),
        ("hi", SamplingParams(stop={"a": 1}), r"params\[0\]\.stop"),
        ("hi", SamplingParams(stop={"a"}), r"params\[0\]\.stop"),
        ("hi", {"max_tokens": 4}, "params must be a SamplingParams or a list of them, got dict"),
        ("hi", SamplingParams(seed="abc"), r"params\[0\]\.seed must be an integer"),
        ("hi", SamplingParams(temperature=float("nan")), r"params\[0\]\.temperature"),
        (12, None, "prompts must be a string, a list of token ids, or a list of either; got int"),
        ([[1, 2], {"a": 1}], None, "prompt 1 must be a string or a list of token ids"),
    ],
)
def test_api_edges_are_value_errors(rt, prompts, params, match) -> None:
    with pytest.raises(ValueError, match=match):
        rt.generate(prompts, params)
    assert not rt.has_unfinished()


def test_numpy_and_torch_token_ids_are_prompts(rt) -> None:
    ids = [5, 17, 99]
    expected = rt.generate(ids, PARAMS)[0].token_ids
    for prompt in ([np.int64(t) for t in ids], np.array(ids), torch.tensor(ids)):
        out = rt.generate(prompt, PARAMS)
        assert len(out) == 1 and out[0].token_ids == expected


def test_unknown_request_ids(rt) -> None:
    with pytest.raises(RequestNotFoundError, match="no request 12345: it was never added, or was released"):
        rt.get_output(12345)
    rid = rt.add_request("hello", SamplingParams(max_tokens=2, temperature=0))
    while rt.has_unfinished():
        rt.step()
    assert rt.release(rid).finished
    with pytest.raises(RequestNotFoundError):
        rt.release(rid)
    rt.abort(rid)  # idempotent, as in vLLM


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]


def test_chat_renders_the_template_and_streams_the_same(rt) -> None:
    out = rt.chat(CHAT, PARAMS)
    rendered = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert out.prompt_token_ids == rt.tokenizer.encode(rendered, add_special_tokens=False)
    assert _collect(list(rt.stream_chat(CHAT, PARAMS))) == (out.text, out.token_ids, "length")


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "messages must be a non-empty list"),
        ("hello", "messages must be a non-empty list"),
        ([{"role": "user", "content": "a"}, "b"], r"messages\[1\] must be a dict"),
        ([{"role": "wizard", "content": "a"}], r"messages\[0\]\.role must be one of"),
        ([{"role": "user"}], r"messages\[0\]\.content is missing"),
        ([{"role": "user", "content": 3}], r"messages\[0\]\.content must be a string or a list of text parts"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], r"messages\[0\]\.content\[0\] must be"),
    ],
)
def test_bad_messages_name_the_index(rt, messages, match) -> None:
    with pytest.raises(ValueError, match=match):
        rt.chat(messages)
    assert not rt.has_unfinished()


def test_generation_config_defaults_apply_when_the_caller_sets_none(llama_checkpoint, tmp_path) -> None:
    path, _ = llama_checkpoint
    ckpt = tmp_path / "ckpt"
    shutil.copytree(path, ckpt)
    (ckpt / "generation_config.json").write_text(json.dumps({
        "temperature": 0.3, "top_k": 5, "top_p": "x", "repetition_penalty": 1.05, "min_p": 7}))
    rt = load_eager(ckpt)  # a value out of its range (min_p) is ignored too, with a warning
    assert rt.default_params() == SamplingParams(temperature=0.3, top_k=5, repetition_penalty=1.05)
    assert rt.startup_report["config"]["sampling_defaults"] == {
        "temperature": {"value": 0.3, "source": "generation_config.json"},
        "top_k": {"value": 5, "source": "generation_config.json"},
        "repetition_penalty": {"value": 1.05, "source": "generation_config.json"},
    }
    rid = rt.add_request([1, 2, 3])  # no SamplingParams: the checkpoint's defaults
    queued = rt.engine.scheduler.requests[rid].params
    assert (queued.temperature, queued.top_k, queued.top_p) == (0.3, 5, 1.0)
    rid = rt.add_request([1, 2, 3], SamplingParams(temperature=0))  # the caller's win
    assert rt.engine.scheduler.requests[rid].params.temperature == 0
