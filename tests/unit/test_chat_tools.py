"""Tools in chat requests: ``tools``/``tool_choice`` checked as OpenAI defines
them, offered to the chat template, conversations that carry earlier calls,
and the server's answers (``tool_calls``, streamed and not) over a stub engine
that writes a fixed answer."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kiln.engine.outputs import StreamDelta
from kiln.entrypoints.chat import render_chat, validate_messages
from kiln.entrypoints.openai.protocol import APIError, ChatCompletionRequest, tool_use
from kiln.entrypoints.openai.server import ServerState, build_app
from kiln.entrypoints.openai.serving import OpenAIServing

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}

# Qwen2.5's way of offering tools and replaying calls, cut down
TOOL_TEMPLATE = (
    "{% if tools %}<|system|>Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}</tool_call>{% endfor %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PLAIN_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}{{ '\\n' }}{% endfor %}"


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level tokenizer (one token a byte) with the tool template: built in milliseconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["<eos>"] = len(vocab)
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    tok.chat_template = TOOL_TEMPLATE
    return tok


def _req(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "Weather in Paris?"}], **fields)


# ---------------------------------------------------------------- tool_choice


def test_tool_choice_follows_openai_defaults() -> None:
    assert tool_use(_req(), None).tools is None and not tool_use(_req(), None).parse  # no tools: none
    use = tool_use(_req(tools=[WEATHER]), "hermes")  # tools: auto
    assert use.tools == [WEATHER] and use.parse and use.parallel
    assert not tool_use(_req(tools=[WEATHER], parallel_tool_calls=False), "hermes").parallel
    none = tool_use(_req(tools=[WEATHER], tool_choice="none"), None)  # needs no parser, offers nothing
    assert none.tools is None and not none.parse


def test_forced_calls_are_decoded_under_the_calls_schema() -> None:
    use = tool_use(_req(tools=[WEATHER], tool_choice="required"), None)  # needs no parser
    assert use.forced and not use.parse and use.named is None and use.tools == [WEATHER]
    assert use.schema == {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "required": ["name", "parameters"],
         "properties": {"name": {"const": "get_weather"}, "parameters": WEATHER["function"]["parameters"]}}]}}
    one = tool_use(_req(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False), None)
    assert one.schema["maxItems"] == 1
    named = tool_use(_req(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                     None)
    assert named.named == "get_weather" and named.schema == WEATHER["function"]["parameters"]


@pytest.mark.parametrize("fields, parser, match", [
    ({"tools": [WEATHER]}, None, "--tool-call-parser"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, None, "--tool-call-parser"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "hermes", "must be 'none', 'auto', 'required' or a named"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "hermes",
     r"must name one of the tools \(get_weather\)"),
    ({"tool_choice": "auto"}, "hermes", "needs tools"),
    ({"tool_choice": "required"}, None, "needs tools"),
])
def test_tool_choices_kiln_cannot_serve_are_400_naming_tool_choice(fields, parser, match) -> None:
    with pytest.raises(APIError, match=match) as e:
        tool_use(_req(**fields), parser)
    assert e.value.status == 400 and e.value.param == "tool_choice"


@pytest.mark.parametrize("tool, match", [
    ("get_weather", r"tools\[0\] must be"),
    ({"type": "retrieval"}, r"tools\[0\] must be"),
    ({"type": "function", "function": {"name": "get weather!"}}, r"tools\[0\]\.function\.name"),
    ({"type": "function", "function": {"name": "f", "parameters": [1]}}, r"tools\[0\]\.function\.parameters"),
])
def test_bad_tool_definitions_are_400_naming_tools(tool, match) -> None:
    with pytest.raises(APIError, match=match) as e:
        tool_use(_req(tools=[tool]), "hermes")
    assert e.value.param == "tools"


# ---------------------------------------------------------------- messages and the template

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_a_conversation_with_an_earlier_call_renders_its_arguments_as_an_object(tokenizer) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    checked = validate_messages(messages)
    assert checked[1]["content"] == "" and checked[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # the caller's untouched
    text = tokenizer.decode(render_chat(tokenizer, messages, tools=[WEATHER]))
    assert text == ('<|system|>Tools: get_weather\n<|user|>Weather in Paris?\n<|assistant|><tool_call>'
                    '{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n<|tool|>18 C\n'
                    '<|assistant|>')


def test_bad_earlier_calls(caplog) -> None:
    broken = {"role": "assistant", "content": None,
              "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}
    with caplog.at_level(logging.WARNING):
        checked = validate_messages([broken])
    assert checked[0]["tool_calls"][0]["function"]["arguments"] == {}  # as vLLM: the conversation goes on
    assert "messages[0].tool_calls[0].function.arguments is not valid JSON" in caplog.text
    with pytest.raises(ValueError, match=r"messages\[0\]\.tool_calls must be a list"):
        validate_messages([{"role": "assistant", "content": None, "tool_calls": {"name": "f"}}])
    with pytest.raises(ValueError, match=r"messages\[0\]\.tool_calls\[0\] must be"):
        validate_messages([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}])
    with pytest.raises(ValueError, match=r"messages\[0\]\.content is missing"):
        validate_messages([{"role": "user", "content": None}])


def test_a_template_that_refuses_the_messages_is_a_value_error_naming_it(tokenizer) -> None:
    strict = "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    with pytest.raises(ValueError, match="the chat template refused the messages: Tool call IDs should be"):
        render_chat(tokenizer, [{"role": "user", "content": "hi"}], chat_template=strict)


def test_a_given_template_replaces_the_tokenizers_and_one_without_tools_warns(tokenizer, caplog) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with caplog.at_level(logging.WARNING):
        ids = render_chat(tokenizer, messages, tools=[WEATHER], chat_template=PLAIN_TEMPLATE)
    assert tokenizer.decode(ids) == "user: hi\n"
    assert "does not mention 'tools'" in caplog.text
    assert tokenizer.decode(render_chat(tokenizer, messages)) == "<|user|>hi\n<|assistant|>"


def test_a_continued_final_message_is_left_open_and_the_generation_prompt_can_be_left_out(tokenizer) -> None:
    begun = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, I am"}]
    assert tokenizer.decode(render_chat(tokenizer, begun, continue_final_message=True)) == (
        "<|user|>hi\n<|assistant|>Hello, I am")
    assert tokenizer.decode(render_chat(tokenizer, begun[:1], add_generation_prompt=False)) == "<|user|>hi\n"
    with pytest.raises(ValueError, match="add_generation_prompt and continue_final_message cannot both be true"):
        render_chat(tokenizer, begun, add_generation_prompt=True, continue_final_message=True)


# ---------------------------------------------------------------- the server's answers


class _Engine:
    """The AsyncEngine surface the handlers use; every request is answered with
    ``answer``, three tokens a delta."""

    def __init__(self, tokenizer, answer: str) -> None:
        self.tokenizer, self.answer, self.prompts, self.params = tokenizer, answer, [], []
        self.config = SimpleNamespace(max_model_len=4096, sampling_defaults={},
                                      model=SimpleNamespace(vocab_size=len(tokenizer)))
        self.healthy, self.dead = True, None

    def check_request(self, prompt_ids, params) -> None:
        pass

    async def generate(self, prompt_ids, params, **_: Any):
        self.prompts.append(self.tokenizer.decode(prompt_ids))
        self.params.append(params)
        ids = self.tokenizer.encode(self.answer, add_special_tokens=False)
        for i in range(0, len(ids), 3):
            part = ids[i:i + 3]
            yield StreamDelta("r", self.tokenizer.decode(part), part, "stop" if i + 3 >= len(ids) else None)


def _client(tokenizer, answer: str, parser: str | None = "hermes",
            reasoning: str | None = None) -> tuple[TestClient, _Engine]:
    engine = _Engine(tokenizer, answer)
    state = ServerState("m", ("unused", {}), engine=engine)  # type: ignore[arg-type]
    metrics = SimpleNamespace(record_request=lambda *a, **k: None)
    state.serving = OpenAIServing(engine, "m", metrics, tool_call_parser=parser,  # type: ignore[arg-type]
                                  reasoning_parser=reasoning)
    return TestClient(build_app(state)), engine


ANSWER = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
BODY = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER]}


def _events(response) -> list[dict]:
    lines = [ln.removeprefix("data: ") for ln in response.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_the_answer_s_calls_come_back_as_tool_calls(tokenizer) -> None:
    client, engine = _client(tokenizer, ANSWER)
    r = client.post("/v1/chat/completions", json=BODY)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Checking.\n"
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert engine.prompts[0].startswith("<|system|>Tools: get_weather\n")  # the model was offered the tool
    assert engine.params[0].skip_special_tokens is False  # a special <tool_call> token stays in the text
    client.post("/v1/chat/completions", json={**BODY, "skip_special_tokens": True})
    assert engine.params[1].skip_special_tokens is True  # unless the request says otherwise


def test_streamed_calls_add_up_to_the_unstreamed_answer(tokenizer) -> None:
    client, _ = _client(tokenizer, ANSWER + "\n" + ANSWER.replace("Checking.\n", "").replace("Paris", "Oslo"))
    events = _events(client.post("/v1/chat/completions", json={**BODY, "stream": True}))
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": ""}
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert content == "Checking.\n"
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (0, "get_weather", {"city": "Paris"}), (1, "get_weather", {"city": "Oslo"})]
    assert all("<tool_call>" not in (d.get("content") or "") for d in deltas)
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_parallel_tool_calls_false_keeps_the_first_call(tokenizer) -> None:
    second = ANSWER.replace("Checking.\n", "").replace("Paris", "Oslo")
    client, _ = _client(tokenizer, ANSWER + second)
    body = {**BODY, "parallel_tool_calls": False}
    calls = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}]
    events = _events(client.post("/v1/chat/completions", json={**body, "stream": True}))
    streamed = [c for e in events for c in e["choices"][0]["delta"].get("tool_calls", [])]
    assert [json.loads(c["function"]["arguments"]) for c in streamed] == [{"city": "Paris"}]


def test_without_tools_or_with_tool_choice_none_the_answer_is_text(tokenizer) -> None:
    client, engine = _client(tokenizer, ANSWER)
    for body in ({**BODY, "tool_choice": "none"}, {k: v for k, v in BODY.items() if k != "tools"}):
        choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": ANSWER} and choice["finish_reason"] == "stop"
    assert all(not p.startswith("<|system|>Tools") for p in engine.prompts)
    assert all(p.skip_special_tokens for p in engine.params)


def test_tools_on_a_server_without_a_parser_are_a_400(tokenizer) -> None:
    client, engine = _client(tokenizer, ANSWER, parser=None)
    r = client.post("/v1/chat/completions", json=BODY)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "--tool-call-parser" in r.json()["error"]["message"] and engine.prompts == []


THOUGHT = "<think>\nThe user wants the weather; I have a tool.\n</think>\n\n"


def test_reasoning_is_split_off_before_calls_are_looked_for(tokenizer) -> None:
    client, engine = _client(tokenizer, THOUGHT + ANSWER, reasoning="qwen3")
    choice = client.post("/v1/chat/completions", json=BODY).json()["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"] == "\nThe user wants the weather; I have a tool.\n"
    assert message["content"] == "Checking.\n" and choice["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    events = _events(client.post("/v1/chat/completions", json={**BODY, "stream": True}))
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == "Checking.\n"
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", [])] == ["get_weather"]
    assert engine.params[0].skip_special_tokens is False  # the tools are parsed: <tool_call> may be special


def test_reasoning_without_tools_and_an_answer_without_reasoning(tokenizer) -> None:
    plain = {"model": "m", "messages": [{"role": "user", "content": "Capital of France?"}]}
    client, engine = _client(tokenizer, THOUGHT + "Paris.", parser=None, reasoning="qwen3")
    message = client.post("/v1/chat/completions", json=plain).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Paris.",
                       "reasoning_content": "\nThe user wants the weather; I have a tool.\n"}
    client, _ = _client(tokenizer, "Paris.", parser=None, reasoning="qwen3")
    message = client.post("/v1/chat/completions", json=plain).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Paris.", "reasoning_content": None}
    client, _ = _client(tokenizer, THOUGHT + "Paris.", parser=None)  # no parser: the text as written
    message = client.post("/v1/chat/completions", json=plain).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": THOUGHT + "Paris."}


def test_a_required_call_is_read_from_the_constrained_answer(tokenizer) -> None:
    answer = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_weather", "parameters": {}}]'
    client, engine = _client(tokenizer, answer, parser=None)
    body = {**BODY, "tool_choice": "required"}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert engine.params[-1].structured == tool_use(ChatCompletionRequest(**body), None).schema
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [{"city": "Paris"}, {}]
    events = _events(client.post("/v1/chat/completions", json={**body, "stream": True}))
    streamed = [c for e in events for c in e["choices"][0]["delta"].get("tool_calls", [])]
    assert [(c["index"], json.loads(c["function"]["arguments"])) for c in streamed] == [(0, {"city": "Paris"}), (1, {})]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_named_call_is_the_answer_as_its_arguments(tokenizer) -> None:
    client, engine = _client(tokenizer, '{"city": "Oslo"}', parser=None)
    body = {**BODY, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert engine.params[-1].structured == WEATHER["function"]["parameters"]
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert choice["finish_reason"] == "stop"  # OpenAI's for a named function


def test_forced_calls_that_cannot_be_kept_are_a_400(tokenizer) -> None:
    client, _ = _client(tokenizer, "[]", parser=None)
    both = {**BODY, "tool_choice": "required", "response_format": {"type": "json_object"}}
    r = client.post("/v1/chat/completions", json=both)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    odd = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}
    r = client.post("/v1/chat/completions", json={**BODY, "tools": [odd], "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools" and "not is not supported" in r.text


def test_chat_continues_a_begun_assistant_message(tokenizer) -> None:
    client, engine = _client(tokenizer, "Paris.", parser=None)
    body = {"model": "m", "messages": [{"role": "user", "content": "Capital of France?"},
                                       {"role": "assistant", "content": "It is"}], "continue_final_message": True}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and engine.prompts[-1].endswith("<|assistant|>It is")
    r = client.post("/v1/chat/completions", json={**body, "add_generation_prompt": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    tokens = client.post("/tokenize", json={"messages": body["messages"], "continue_final_message": True}).json()
    assert tokenizer.decode(tokens["tokens"]).endswith("<|assistant|>It is")

