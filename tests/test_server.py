"""``kiln serve`` for real: the server in a subprocess on a free port, driven by
the official ``openai`` client (sync and async) and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kiln import SamplingParams
from kiln.engine.structured import JsonAutomaton, structured_shape
from tests.conftest import fresh_env, kiln_cli, load_eager

MODEL = "random-demo"
PROMPTS = ["The quick brown fox", "Return the value of", "A file is", "Python is"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: list[str], env: dict[str, str], wrap: list[str] | None = None,
                 timeout: float = 600) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "kiln", "serve", *args, "--port", str(port)]
    proc = subprocess.Popen((wrap or []) + cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    saw_503 = False
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"kiln serve exited with {proc.returncode}: {proc.stdout.read()[-3000:]}")
        try:
            code = httpx.get(f"{base}/health", timeout=2).status_code
        except httpx.TransportError:
            time.sleep(0.2)
            continue
        saw_503 |= code == 503
        if code == 200:
            return proc, base
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("kiln serve did not become healthy in time")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def server(demo_tokenizer_dir) -> Iterator[str]:
    env = {**os.environ, "KILN_CACHE_DIR": str(demo_tokenizer_dir.parent.parent)}
    # speculation on: every greedy answer below must equal the offline engine's, which has none
    proc, base = start_server([MODEL, "-O0", "--max-num-seqs", "64", "--speculative-config",
                               '{"num_speculative_tokens": 3, "prompt_lookup_min": 1}'], env)
    yield base
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def offline(demo_tokenizer_dir):
    return load_eager(demo_tokenizer_dir)


def _metrics(base: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{base}/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def test_health_models_version_and_tokens(server, client, offline) -> None:
    assert httpx.get(f"{server}/health").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == offline.config.max_model_len
    assert httpx.get(f"{server}/version").json()["version"]
    tok = httpx.post(f"{server}/tokenize", json={"prompt": "Hello world"}).json()
    assert tok["tokens"] == offline.tokenizer.encode("Hello world") and tok["count"] == len(tok["tokens"])
    assert httpx.post(f"{server}/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == "Hello world"


def test_completions_streamed_equal_non_streamed_and_offline(client, offline) -> None:
    expected = offline.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0))[0]
    full = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert full.choices[0].text == expected.text and full.choices[0].finish_reason == expected.finish_reason
    assert full.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert full.usage.completion_tokens == len(expected.token_ids) and full.usage.total_tokens == (
        full.usage.prompt_tokens + full.usage.completion_tokens)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    ids = client.completions.create(model=MODEL, prompt=expected.prompt_token_ids, max_tokens=12, temperature=0)
    assert ids.choices[0].text == expected.text


def test_chat_streamed_equals_non_streamed_and_offline(client, offline) -> None:
    messages = [{"role": "user", "content": "Say something."}]
    expected = offline.chat(messages, SamplingParams(max_tokens=10, temperature=0))
    full = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0)
    assert full.choices[0].message.content == expected.text and full.choices[0].message.role == "assistant"
    assert full.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert full.usage.completion_tokens == len(expected.token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [expected.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_done_is_last_and_the_default_chat_length_is_the_rest_of_the_context(server) -> None:
    with httpx.stream("POST", f"{server}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1


def test_n_seeds_stop_and_logprobs(client, offline) -> None:
    two = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, n=2, temperature=1.0, seed=3)
    assert [c.index for c in two.choices] == [0, 1] and two.usage.completion_tokens == 16
    again = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, n=2, temperature=1.0, seed=3)
    assert [c.text for c in again.choices] == [c.text for c in two.choices]  # same seed, same text
    free = offline.generate(PROMPTS[2], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0].text
    stop = free[5:8]
    cut = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=20, temperature=0, stop=[stop])
    assert cut.choices[0].text == free[: free.index(stop)] and cut.choices[0].finish_reason == "stop"
    kept = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=20, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == free[: free.index(stop) + len(stop)] and kept.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=20, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text  # never leaks
    lp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                        temperature=0, logprobs=True, top_logprobs=2)
    content = lp.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)  # greedy: the top token
    legacy = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0, logprobs=1)
    assert len(legacy.choices[0].logprobs.token_logprobs) == 3


def test_echo_with_logprobs_gives_the_prompts_logprobs(server, client, offline) -> None:
    """lm-evaluation-harness's loglikelihood request (token ids, ``echo``,
    ``logprobs=1``, ``max_tokens`` 0 or 1): the prompt's tokens first, the
    first with no logprob, each top dict with the most likely token and the
    prompt's own; vLLM's ``prompt_logprobs`` field too, streamed or not."""
    ids = offline.tokenizer.encode(PROMPTS[3])
    expected = offline.generate(ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    prompt_text = offline.tokenizer.decode(ids)
    for max_tokens in (0, 1):
        r = client.completions.create(model=MODEL, prompt=ids, max_tokens=max_tokens, temperature=0, logprobs=1,
                                      echo=True)
        choice, lp = r.choices[0], r.choices[0].logprobs
        n = len(ids) + max_tokens
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:len(ids)] == pytest.approx([p.logprob for p in expected.prompt_logprobs[1:]],
                                                              abs=1e-4)
        for top, p, logprob in zip(lp.top_logprobs[1:], expected.prompt_logprobs[1:], lp.token_logprobs[1:]):
            assert max(top.values()) == pytest.approx(p.top[0][1], abs=1e-4) and logprob in top.values()
            assert len(top) <= 2
        assert choice.text == prompt_text + expected.text[:len(choice.text) - len(prompt_text)]
        assert r.usage.completion_tokens == max_tokens and choice.finish_reason == "length"
        assert len(choice.model_extra["prompt_logprobs"]) == len(ids)
        chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=max_tokens, temperature=0,
                                                logprobs=1, echo=True, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == choice.text
        assert [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs] == (
            lp.token_logprobs)
    assert r.choices[0].text == prompt_text + expected.text
    vllm = httpx.post(f"{server}/v1/completions", json={"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}).json()
    entries = vllm["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids) and vllm["choices"][0]["logprobs"] is None
    for entry, token, p in zip(entries[1:], ids[1:], expected.prompt_logprobs[1:]):
        assert entry[str(token)]["logprob"] == pytest.approx(p.logprob, abs=1e-4)
        assert entry[str(token)]["rank"] == p.rank and 2 <= len(entry) <= 3
        assert {e["rank"] for t, e in entry.items() if t != str(token)} <= {1, 2}
    chat = httpx.post(f"{server}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def _strict_json(text: str) -> dict:
    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_logprobs_of_filtered_tokens_are_json_numbers(server) -> None:
    """A top logprob of a token the filters removed is -inf, which JSON cannot
    carry: it goes out as -9999.0, as vLLM sends it, streamed or not."""
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 1.0, "top_k": 1, "logprobs": 3,
            "seed": 0}
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    tops = _strict_json(r.text)["choices"][0]["logprobs"]["top_logprobs"]
    assert all(isinstance(v, float) for t in tops for v in t.values())
    assert all(-9999.0 in t.values() for t in tops)  # top-k 1: the others were removed
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "temperature": 1.0,
            "top_p": 1e-6, "logprobs": True, "top_logprobs": 2, "seed": 0}
    r = httpx.post(f"{server}/v1/chat/completions", json=chat, timeout=120)
    assert r.status_code == 200, r.text
    content = _strict_json(r.text)["choices"][0]["logprobs"]["content"]
    assert [t["top_logprobs"][1]["logprob"] for t in content] == [-9999.0] * 3
    for request, path in ((body, "completions"), (chat, "chat/completions")):
        with httpx.stream("POST", f"{server}/v1/{path}", json={**request, "stream": True}, timeout=120) as r:
            events = [_strict_json(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert len(events) >= 3


def test_created_is_when_the_request_came(server) -> None:
    """``created`` stamps the request's arrival, as OpenAI and vLLM do, not the
    end of a generation that ran for seconds."""
    for path, extra in (("completions", {"prompt": PROMPTS[0], "max_tokens": 1000}),  # of a 1024-token context
                        ("chat/completions", {"messages": [{"role": "user", "content": "x"}]})):  # the rest of it
        before = time.time()
        r = httpx.post(f"{server}/v1/{path}", json={"model": MODEL, "ignore_eos": True, "temperature": 0, **extra},
                       timeout=300)
        took = time.time() - before
        assert r.status_code == 200 and int(before) <= r.json()["created"] <= int(before) + 1, (took, r.text[:200])


def test_penalties_min_p_and_logit_bias_reach_the_sampler(client, offline) -> None:
    """OpenAI's logit_bias (token ids as strings) and the penalties vLLM
    accepts give the tokens of the same SamplingParams offline."""
    options = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "repetition_penalty": 1.3}
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, **options)
    expected = offline.generate(PROMPTS[2], params)[0]
    assert expected.text != offline.generate(PROMPTS[2], SamplingParams(max_tokens=16, temperature=0,
                                                                       ignore_eos=True))[0].text
    got = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=0,
                                    extra_body={"ignore_eos": True, "repetition_penalty": 1.3},
                                    frequency_penalty=1.5, presence_penalty=0.5)
    assert got.choices[0].text == expected.text
    token = offline.tokenizer.encode(" kiln")[0]
    biased = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0,
                                       logit_bias={str(token): 100})
    assert biased.choices[0].text == offline.tokenizer.decode([token] * 3)
    sampled = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, seed=5,
                                        extra_body={"min_p": 0.2})
    assert sampled.choices[0].text == offline.generate(PROMPTS[0], SamplingParams(
        max_tokens=8, temperature=1.0, seed=5, min_p=0.2))[0].text


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
        ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"prompt": "hi", "top_p": 2}, 400, "top_p"),
        ({"prompt": "hi", "n": 0}, 400, "n"),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"prompt": "hi", "max_tokens": 5000}, 400, "input_tokens"),
        ({"prompt": "", "max_tokens": 3}, 400, "prompt"),
        ({"prompt": [[1, 2], [99999]]}, 400, "prompt"),
        ({"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
        ({"prompt": "hi", "frequency_penalty": "lots"}, 400, "frequency_penalty"),
        ({"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
        ({"prompt": "hi", "min_p": 2}, 400, "min_p"),
        ({"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
        ({"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"5": 300}}, 400, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
        ({"prompt": "hi", "model": "gpt-17"}, 404, "model"),
        ({"max_tokens": 3}, 400, "prompt"),
        ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),  # 0 only with echo
        ({"prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
        ({"prompt": "hi", "echo": True, "logprobs": 21}, 400, "logprobs"),
    ],
)
def test_completion_errors_use_the_envelope(server, body, status, param) -> None:
    r = httpx.post(f"{server}/v1/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == status and error["message"] and error["type"]


def test_errors_through_the_client_and_raw_http(client, server) -> None:
    with pytest.raises(openai.BadRequestError, match="maximum context length is"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=100000)
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.role"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], logprobs=True,
                                       top_logprobs=30)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    r = httpx.post(f"{server}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    ok = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"unknown_field": 1})
    assert ok.choices[0].finish_reason == "length"  # unknown fields are ignored; the server kept serving


def test_a_client_that_disconnects_mid_stream_aborts_its_request(server) -> None:
    with httpx.stream("POST", f"{server}/v1/completions", json={
            "prompt": "Once", "max_tokens": 900, "stream": True, "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                break  # one chunk, then hang up
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = _metrics(server)
        if m[("kiln:num_requests_running", ())] == 0 and m[("kiln:kv_cache_usage_perc", ())] == 0:
            break
        time.sleep(0.2)
    assert m[("kiln:num_requests_running", ())] == 0 and m[("kiln:kv_cache_usage_perc", ())] == 0
    assert m[("kiln:request_success_total", (("finished_reason", "abort"),))] >= 1


def test_32_concurrent_streams_get_the_offline_tokens(server, offline) -> None:
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(32)]
    expected = [o.text for o in offline.generate(prompts, SamplingParams(max_tokens=8, temperature=0))]
    aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)

    async def one(p: str) -> str:
        stream = await aclient.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_of_them() -> list[str]:
        return await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), timeout=300)

    assert asyncio.run(all_of_them()) == expected
    # the random model's greedy answers repeat themselves: some of these steps ran drafts
    assert _metrics(server)[("kiln:spec_decode_num_draft_tokens_total", ())] > 0


def test_metrics_count_what_was_sent(server, client) -> None:
    before = _metrics(server)
    long_prompt = " ".join(PROMPTS) * 3  # more than one 16-token block
    out = [client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=k, temperature=0,
                                     extra_body={"ignore_eos": True})
           for k in (2, 5)]
    after = _metrics(server)

    def delta(name: str, labels: tuple = ()) -> float:
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert delta("kiln:request_success_total", (("finished_reason", "length"),)) == 2
    assert delta("kiln:generation_tokens_total") == 7
    assert delta("kiln:prompt_tokens_total") == sum(o.usage.prompt_tokens for o in out)
    assert delta("kiln:time_to_first_token_seconds_count") == 2
    assert delta("kiln:e2e_request_latency_seconds_count") == 2
    assert delta("kiln:request_queue_time_seconds_count") == 2
    assert after[("kiln:startup_info", (("compile_cache", "off"), ("cudagraph_mode", "NONE"),
                                        ("optimization_level", "0")))] == 1
    assert ("kiln:startup_phase_seconds", (("phase", "total"),)) in after
    # the two requests share their prompt: the second finds the first's full blocks
    assert delta("kiln:prefix_cache_queries_total") == sum(o.usage.prompt_tokens for o in out)
    assert delta("kiln:prefix_cache_hits_total") > 0
    assert 0 <= delta("kiln:spec_decode_num_accepted_tokens_total") <= delta("kiln:spec_decode_num_draft_tokens_total")
    assert ("kiln:spec_decode_num_draft_tokens_total", ()) in after


def test_json_object_responses_are_json(client) -> None:
    """The random model writes no JSON of its own: every token it picks here is
    kept to an object, which closes (then EOS) or runs out of tokens open."""
    for extra in ({"temperature": 0}, {"temperature": 1.0, "seed": 7}):
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON please"}],
                                             max_tokens=48, response_format={"type": "json_object"}, **extra)
        text, reason = out.choices[0].message.content, out.choices[0].finish_reason
        state = JsonAutomaton(structured_shape("json_object"))
        assert state.feed(text.encode("utf-8")), text
        if reason == "stop":
            assert state.done and isinstance(json.loads(text), dict)
        else:
            assert reason == "length" and out.usage.completion_tokens == 48
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"enum": ["a", "b"]}},
              "required": ["n", "s"]}
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON please"}],
                                         max_tokens=48, temperature=0,
                                         response_format={"type": "json_schema",
                                                          "json_schema": {"name": "x", "schema": schema}})
    text = out.choices[0].message.content
    state = JsonAutomaton(structured_shape(schema))
    assert state.feed(text.encode("utf-8")), text
    if out.choices[0].finish_reason == "stop":
        value = json.loads(text)
        assert set(value) == {"n", "s"} and isinstance(value["n"], int) and value["s"] in ("a", "b")
    with pytest.raises(openai.BadRequestError, match="schema.not is not supported"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": {"not": {}}}})


TOOLS_TEMPLATE = ("{% if tools %}Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\\n' }}{% endif %}"
                  "{% for m in messages %}{{ m.role }}: {{ m.content }}{{ '\\n' }}{% endfor %}assistant:")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def test_serve_with_a_chat_template_and_a_tool_call_parser(demo_tokenizer_dir, tmp_path) -> None:
    """The flags reach the handlers: the given template renders the tools, and
    a request offering tools is answered (the random model writes no call)."""
    template = tmp_path / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    env = {**os.environ, "KILN_CACHE_DIR": str(demo_tokenizer_dir.parent.parent)}
    proc, base = start_server([MODEL, "-O0", "--chat-template", str(template), "--tool-call-parser", "hermes"], env)
    try:
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        tok = httpx.post(f"{base}/tokenize", json={"messages": messages, "tools": [WEATHER]}).json()
        offline = load_eager(demo_tokenizer_dir).tokenizer
        assert offline.decode(tok["tokens"]) == "Tools: get_weather\nuser: Weather in Paris?\nassistant:"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        out = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=6,
                                             temperature=0)
        assert out.usage.prompt_tokens == tok["count"]
        assert out.choices[0].finish_reason in ("stop", "length") and out.choices[0].message.tool_calls is None
        forced = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                                tool_choice="required", max_tokens=64, temperature=0)
        if forced.choices[0].finish_reason == "tool_calls":  # the random model's call, decoded under its schema
            calls = forced.choices[0].message.tool_calls
            assert calls and all(c.function.name == "get_weather" for c in calls)
            assert all(isinstance(json.loads(c.function.arguments), dict) for c in calls)
        else:
            assert forced.choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError, match="must name one of the tools"):
            client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=6,
                                           tool_choice={"type": "function", "function": {"name": "nope"}})
    finally:
        stop_server(proc)


def test_a_bundle_through_a_read_only_mount_serves(tiny, tmp_path) -> None:
    path, prompts, expected = tiny
    bundle = tmp_path / "bundle"
    proc = kiln_cli(["compile", str(path), "--out", str(bundle), "-O1", "--include-weights"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    mount = tmp_path / "ro"
    mount.mkdir()
    env = fresh_env(tmp_path / "machine", KILN_CACHE_DIR=str(tmp_path / "user-cache"))
    port_proc, base = start_server(
        [str(mount), "--served-model-name", "tiny"], env,
        wrap=["unshare", "-m", "sh", "-c", f'mount --bind -o ro "{bundle}" "{mount}" && exec "$0" "$@"'],
    )
    try:
        got = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": prompts[0], "max_tokens": 6,
                                                         "temperature": 0, "ignore_eos": True}).json()
        assert got["usage"]["completion_tokens"] == 6
        metrics = _metrics(base)
        assert metrics[("kiln:startup_info", (("compile_cache", "bundle"), ("cudagraph_mode", "NONE"),
                                              ("optimization_level", "1")))] == 1
    finally:
        stop_server(port_proc)
    assert not (tmp_path / "user-cache" / "compiled").exists()


def test_serve_answers_while_it_compiles_in_the_background_then_swaps(tiny, tmp_path) -> None:
    """``kiln serve`` compiles in the background by default: on an empty cache it
    serves eagerly from the start, then swaps the compiled pieces in."""
    path, prompts, expected = tiny
    env = fresh_env(tmp_path / "machine", KILN_CACHE_DIR=str(tmp_path / "cache"))
    proc, base = start_server([str(path), "-O1", "--served-model-name", "tiny"], env)

    def tokens(prompt: list[int]) -> list[int]:
        """Greedy tokens, read from the logprobs (the tiny model has no tokenizer:
        each token is its id)."""
        got = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 6,
                                                         "temperature": 0, "ignore_eos": True, "logprobs": 0})
        return [int(t) for t in got.json()["choices"][0]["logprobs"]["tokens"]]

    def execution() -> tuple[str, str]:
        (labels,) = [k[1] for k, v in _metrics(base).items() if k[0] == "kiln:execution_info" and v == 1]
        return dict(labels)["execution"], dict(labels)["background_compile"]

    try:
        assert execution() == ("eager", "building")
        assert [tokens(p) for p in prompts] == expected
        deadline = time.monotonic() + 600
        while execution() != ("compiled", "swapped"):
            assert time.monotonic() < deadline and execution()[1] != "failed", execution()
            time.sleep(0.5)
        assert [tokens(p) for p in prompts] == expected
        after = _metrics(base)
        assert 0 < after[("kiln:background_compile_build_seconds", ())] <= after[
            ("kiln:background_compile_swapped_at_seconds", ())]
    finally:
        stop_server(proc)
