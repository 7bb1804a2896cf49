"""The OpenAI request bodies as SamplingParams: names, ranges, logit_bias keys, ignored fields."""

from __future__ import annotations

import logging

import pytest

from kiln.engine.request import SamplingParams
from kiln.entrypoints.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest, sampling_params


def test_sampling_fields_reach_sampling_params_over_the_defaults() -> None:
    req = CompletionRequest(prompt="hi", temperature=0.5, min_p=0.1, presence_penalty=-0.5, frequency_penalty=1,
                            repetition_penalty=1.1, logit_bias={"17": 5, "3": -100.0})
    params = sampling_params(req, SamplingParams(top_k=40, repetition_penalty=1.3), 8, None)
    assert (params.temperature, params.top_k, params.min_p, params.max_tokens) == (0.5, 40, 0.1, 8)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (-0.5, 1, 1.1)
    assert params.logit_bias == {17: 5.0, 3: -100.0}
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    assert sampling_params(chat, SamplingParams(repetition_penalty=1.3), 4, None).repetition_penalty == 1.3


@pytest.mark.parametrize("bias, match", [
    ({"seventeen": 1}, "logit_bias keys must be token ids, got 'seventeen'"),
    ({"17": "up"}, r"logit_bias\['17'\] must be a number, got 'up'"),
    ({"17": True}, r"logit_bias\['17'\] must be a number"),
    ({"17": 101}, r"logit_bias\[17\] must be a number in \[-100, 100\], got 101.0"),
    ({"-4": 1}, "logit_bias: key -4 is not a token id"),
])
def test_bad_logit_bias_is_a_400_naming_it(bias, match) -> None:
    with pytest.raises(APIError, match=match) as e:
        sampling_params(CompletionRequest(prompt="hi", logit_bias=bias), SamplingParams(), 4, None)
    assert e.value.status == 400 and e.value.param == "logit_bias"


def test_fields_kiln_does_not_implement_are_served_and_logged(caplog) -> None:
    req = CompletionRequest(prompt="hi", best_of=3, user="me")
    with caplog.at_level(logging.WARNING, logger="kiln.entrypoints.openai.protocol"):
        params = sampling_params(req, SamplingParams(), 4, None)
    assert params.max_tokens == 4
    assert "request fields ignored (kiln does not implement them): best_of, user" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kiln.entrypoints.openai.protocol"):
        sampling_params(CompletionRequest(prompt="hi"), SamplingParams(), 4, None)
    assert not caplog.text


def test_response_format_json_object_keeps_the_output_to_json() -> None:
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                 response_format={"type": "json_object"})
    assert sampling_params(chat, SamplingParams(), 4, None).structured == "json_object"
    text = CompletionRequest(prompt="hi", response_format={"type": "text"})
    assert sampling_params(text, SamplingParams(), 4, None).structured is None
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    typed = CompletionRequest(prompt="hi", response_format={"type": "json_schema",
                                                            "json_schema": {"name": "x", "schema": schema}})
    assert sampling_params(typed, SamplingParams(), 4, None).structured == schema


@pytest.mark.parametrize("fmt, match", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": {"a": {"not": {}}}}}},
     r"response_format.json_schema.schema.properties.a.not is not supported"),
    ({"type": "json_schema", "json_schema": "x"}, r"must be \{'name': ..., 'schema': \{...\}\}"),
    ({"type": "yaml"}, "response_format.type must be 'text', 'json_object' or 'json_schema', got 'yaml'"),
    ({}, "got None"),
])
def test_response_formats_kiln_cannot_keep_are_a_400(fmt, match) -> None:
    with pytest.raises(APIError, match=match) as e:
        sampling_params(CompletionRequest(prompt="hi", response_format=fmt), SamplingParams(), 4, None)
    assert e.value.status == 400 and e.value.param == "response_format"
