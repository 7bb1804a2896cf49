"""SamplingParams.validate: every bad field is a ValueError naming it."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.engine.request import SamplingParams


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"max_tokens": 0}, r"p\.max_tokens must be an integer >= 1, got 0"),
        ({"max_tokens": 2.0}, r"p\.max_tokens"),
        ({"max_tokens": True}, r"p\.max_tokens"),
        ({"temperature": -0.1}, r"p\.temperature must be a number >= 0"),
        ({"temperature": float("nan")}, r"p\.temperature"),
        ({"temperature": "hot"}, r"p\.temperature"),
        ({"top_k": -2}, r"p\.top_k"),
        ({"top_p": 0.0}, r"p\.top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"p\.top_p"),
        ({"seed": "abc"}, r"p\.seed must be an integer or None, got 'abc'"),
        ({"seed": 1.5}, r"p\.seed"),
        ({"stop": 5}, r"p\.stop must be a string or a list of non-empty strings, got 5"),
        ({"stop": {"a": 1}}, r"p\.stop must be a string or a list"),
        ({"stop": {"a", "b"}}, r"p\.stop must be a string or a list"),
        ({"stop": ["ok", ""]}, r"p\.stop"),
        ({"stop": ""}, r"p\.stop must not be empty"),
        ({"stop_token_ids": 3}, r"p\.stop_token_ids must be a list of integers"),
        ({"stop_token_ids": {3, 4}}, r"p\.stop_token_ids"),
        ({"stop_token_ids": [1, "2"]}, r"p\.stop_token_ids"),
        ({"ignore_eos": "no"}, r"p\.ignore_eos must be true or false"),
        ({"include_stop_str_in_output": 1}, r"p\.include_stop_str_in_output must be true or false, got 1"),
        ({"skip_special_tokens": None}, r"p\.skip_special_tokens must be true or false"),
        ({"min_p": -0.1}, r"p\.min_p must be in \[0, 1\]"),
        ({"min_tokens": -1}, r"p\.min_tokens must be an integer in \[0, max_tokens=16\], got -1"),
        ({"min_tokens": 17}, r"p\.min_tokens must be an integer in \[0, max_tokens=16\]"),
        ({"min_tokens": 2.0}, r"p\.min_tokens"),
        ({"min_p": 1.5}, r"p\.min_p"),
        ({"presence_penalty": 2.5}, r"p\.presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -3}, r"p\.frequency_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": float("nan")}, r"p\.frequency_penalty"),
        ({"repetition_penalty": 0.0}, r"p\.repetition_penalty must be a finite number > 0"),
        ({"repetition_penalty": float("inf")}, r"p\.repetition_penalty"),
        ({"logit_bias": [1, 2]}, r"p\.logit_bias must map token ids to numbers"),
        ({"logit_bias": {"5": 1.0}}, r"p\.logit_bias: key '5' is not a token id"),
        ({"logit_bias": {-1: 1.0}}, r"p\.logit_bias: key -1"),
        ({"logit_bias": {5: 101}}, r"p\.logit_bias\[5\] must be a number in \[-100, 100\], got 101"),
        ({"logit_bias": {5: "up"}}, r"p\.logit_bias\[5\]"),
    ],
)
def test_bad_fields_are_value_errors_naming_the_field(fields, match) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**fields).validate("p")


def test_accepted_forms() -> None:
    for fields in ({"stop": "x"}, {"stop": ["x", "yz"]}, {"stop": ("x",)}, {"stop_token_ids": [np.int64(3)]},
                   {"seed": np.int32(7)}, {"temperature": np.float32(0.5)}, {"temperature": 0},
                   {"top_k": -1}):  # vLLM's other spelling of "off"
        SamplingParams(**fields).validate("p")
    assert SamplingParams(stop="x").stop_strings == ["x"] and SamplingParams().stop_strings == []


def test_which_options_change_the_logits() -> None:
    """The argmax of the raw logits stays the greedy token unless a bias or a
    penalty is set; only the penalties read the tokens so far."""
    assert not SamplingParams().changes_logits and not SamplingParams().penalized
    assert not SamplingParams(min_p=0.5, top_k=3, logit_bias={}).changes_logits
    assert SamplingParams(logit_bias={3: 1.0}).changes_logits and not SamplingParams(logit_bias={3: 1.0}).penalized
    for field, value in (("presence_penalty", 0.5), ("frequency_penalty", -0.5), ("repetition_penalty", 1.2)):
        params = SamplingParams(**{field: value})
        params.validate()
        assert params.penalized and params.changes_logits
