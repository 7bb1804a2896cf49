"""Structured output (``SamplingParams(structured="json_object")``): the JSON
automaton against Python's json module on valid, broken and truncated texts,
the token mask, and requests through the engine core that end as JSON objects."""

from __future__ import annotations

import json
import random

import pytest
import torch

from kiln.engine.request import SamplingParams
from kiln.engine.json_schema import any_object
from kiln.engine.structured import CANDIDATES, MAX_WHITESPACE, JsonAutomaton, TokenConstraint, structured_shape
from tests.unit.test_engine_core import VOCAB, make_engine, run


def _accepts(text: str, shape=None) -> tuple[bool, bool]:
    """(every byte accepted, the value complete)."""
    state = JsonAutomaton(shape if shape is not None else any_object())
    ok = state.feed(text.encode("utf-8"))
    return ok, ok and state.done


def _is_json_object(text: str) -> bool:
    def no_constants(name: str):
        raise ValueError(name)  # Python's json takes NaN and Infinity; JSON does not

    try:
        return isinstance(json.loads(text, parse_constant=no_constants), dict)
    except ValueError:
        return False


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["obj", "arr", "str", "int", "float", "lit"] if depth < 3 else ["str", "int", "float", "lit"])
    if kind == "obj":
        return {"".join(rng.choice("ab\"\\é\n ") for _ in range(rng.randint(0, 4))): _random_value(rng, depth + 1)
                for _ in range(rng.randint(0, 3))}
    if kind == "arr":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "str":
        return "".join(rng.choice("xy \"\\/\t\u00e9\u20ac\U0001f600") for _ in range(rng.randint(0, 5)))
    if kind == "int":
        return rng.randint(-10**6, 10**6)
    if kind == "float":
        return rng.choice([0.5, -1e-7, 3.25e21, -0.0, 12.0])
    return rng.choice([True, False, None])


def _random_object(rng: random.Random) -> str:
    obj = {"k": _random_value(rng), "v": _random_value(rng)}
    indent = rng.choice([None, 2])
    return json.dumps(obj, ensure_ascii=rng.random() < 0.5, indent=indent)


def test_valid_objects_are_accepted_and_closed_and_their_prefixes_are_open() -> None:
    rng = random.Random(0)
    for _ in range(300):
        text = _random_object(rng)
        assert _accepts(text) == (True, True), text
        cut = rng.randint(0, len(text) - 1)
        assert _accepts(text[:cut]) == (True, False), text[:cut]
    for text in ('{}', ' {"a": [] }', '{"a":[1,-0,0.5e+3,2E-2,true,false,null,{"b":{}}]}', '{"\\u00e9\\n": "\\""}'):
        assert _accepts(text) == (True, True), text


@pytest.mark.parametrize("text", [
    '[1]', '"a"', '1', 'true', '{"a"}', '{"a":}', '{"a":1,}', '{,}', '{"a":1 "b":2}', '{"a":[1,]}', '{"a":[,1]}',
    '{"a":01}', '{"a":1.}', '{"a":.5}', '{"a":1e}', '{"a":-}', '{"a":+1}', '{"a":tru}', '{"a":nul1}', "{'a':1}",
    '{"a":"\\x"}', '{"a":"\\u12g4"}', '{"a":"\t"}', '{"a":1}}', '{"a":1]', '{"a":[1}', '{"a":NaN}', '{a:1}',
    '{"a":1} x', '{"a":1}{}',
])
def test_invalid_texts_are_refused(text: str) -> None:
    assert not _is_json_object(text) or text == '{"a":1}{}'  # the oracle agrees, bar a second object
    assert _accepts(text)[1] is False


def test_the_automaton_agrees_with_json_on_mutated_objects() -> None:
    """Random single-byte edits of valid objects: a complete text is accepted
    and closed exactly when Python's json reads it as an object."""
    rng = random.Random(1)
    alphabet = '{}[]:,"\\ 0123456789.eE+-truefalsn'
    for _ in range(3000):
        text = _random_object(rng)
        i = rng.randrange(len(text))
        edit = rng.choice(["delete", "insert", "replace"])
        c = rng.choice(alphabet)
        text = text[:i] + (c if edit != "delete" else "") + text[i + (edit != "insert"):]
        assert _accepts(text)[1] == _is_json_object(text), repr(text)


def test_whitespace_runs_are_capped() -> None:
    assert _accepts("{" + " " * MAX_WHITESPACE + "}") == (True, True)
    assert _accepts("{" + " " * (MAX_WHITESPACE + 1))[0] is False
    assert _accepts('{"a": "' + " " * 200 + '"}') == (True, True)  # inside a string it is text


# ---------------------------------------------------------------- the token mask

TOY = [b"{", b"}", b'"k"', b":", b"1", b",", b" ", b"[", b"]", None, b"x", b"{}", b'"', b"a", b"1}"]
EOS = 9


def test_the_mask_keeps_the_allowed_candidates_and_then_only_the_end() -> None:
    c = TokenConstraint(TOY, ends=[EOS])
    logits = torch.arange(len(TOY), dtype=torch.float32) / 4  # the later a token, the likelier
    row = logits.clone()
    c.mask(row, temperature=1.0)
    allowed = {i for i, v in enumerate(row.tolist()) if v != float("-inf")}
    assert allowed == {0, 6, 11}  # "{", " ", "{}": the only ways to begin an object
    assert row[11] == 11 / 4  # kept values are the logits
    greedy = logits.clone()
    c.mask(greedy)  # temperature 0: the likeliest allowed token alone
    assert torch.isfinite(greedy).nonzero().flatten().tolist() == [11]
    peaked = torch.full((len(TOY),), -50.0)
    peaked[0], peaked[6] = 10.0, -5.0  # " " weighs e^-15 of "{" at temperature 1: not looked for
    c.mask(peaked, temperature=1.0)
    assert torch.isfinite(peaked).nonzero().flatten().tolist() == [0]
    for token in (0, 2, 3, 14):  # {"k":1}
        assert c.allows(token)
        c.advance(token)
    assert c.state.done and c.allows(EOS) and not c.allows(0) and not c.allows(6)
    row = torch.zeros(len(TOY))
    c.mask(row)
    assert {i for i, v in enumerate(row.tolist()) if v != float("-inf")} == {EOS}
    endless = TokenConstraint(TOY, ends=[])  # ignore_eos: whitespace may follow the object
    for token in (11, 6):
        endless.advance(token)
    assert endless.state.done and endless.allows(6) and not endless.allows(0)


def test_the_sampler_takes_a_greedy_rows_argmax_when_its_automaton_allows_it() -> None:
    from kiln.engine.sampler import Sampler

    sampler = Sampler(torch.device("cpu"))
    greedy = [SamplingParams(temperature=0)] * 2
    logits = torch.zeros(2, len(TOY))
    logits[0, 11], logits[0, 10] = 5.0, 4.0  # "{}" first: allowed
    logits[1, 10], logits[1, 0] = 5.0, 4.0  # "x" first: not allowed, "{" next
    constraints = [TokenConstraint(TOY, ends=[EOS]), TokenConstraint(TOY, ends=[EOS])]
    before = logits.clone()
    assert sampler(logits, greedy, [0, 0], constraints=constraints).tokens == [11, 0]
    assert torch.equal(logits, before)  # masked in the sampler's buffer, not the caller's logits
    assert Sampler.allowed([11, 10], [constraints[0], None]) and not Sampler.allowed([10], constraints[:1])


def test_when_no_candidate_is_valid_the_vocabulary_is_searched() -> None:
    vocab = [b"x"] * (CANDIDATES * 3) + [b"{"]  # the one valid token is the least likely
    row = torch.linspace(10, 0, len(vocab))
    c = TokenConstraint(vocab, ends=[])
    c.mask(row)
    assert torch.isfinite(row).nonzero().flatten().tolist() == [len(vocab) - 1]


def test_a_row_nothing_can_continue_is_left_as_it_was(caplog) -> None:
    c = TokenConstraint([b"x", b"y"], ends=[])
    row = torch.tensor([1.0, 2.0])
    c.mask(row)
    assert row.tolist() == [1.0, 2.0] and "no token can continue" in caplog.text


# ---------------------------------------------------------------- through the engine

# the stub model's vocabulary as bytes: everything it would say freely is "x", never JSON
ENGINE_VOCAB = [b"x"] * VOCAB
for _i, _b in enumerate([b"{", b"}", b'"k"', b":", b"1", b",", b" ", b"[", b"]"]):
    ENGINE_VOCAB[_i] = _b
ENGINE_VOCAB[31] = None  # EOS


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=40, temperature=0, structured="json_object"),
    SamplingParams(max_tokens=40, temperature=1.0, seed=3, structured="json_object"),
    SamplingParams(max_tokens=40, temperature=0.7, top_p=0.9, seed=5, structured="json_object"),
])
def test_structured_requests_end_as_json_objects(params) -> None:
    engine = make_engine(eos=(31,), vocab_bytes=lambda: ENGINE_VOCAB)
    engine.add_request("json", [10, 11, 12], params)
    engine.add_request("free", [10, 11, 12], SamplingParams(max_tokens=8, temperature=0))  # same batch, unconstrained
    results = run(engine)
    tokens, reason = results["json"]
    if reason == "stop":
        assert tokens[-1] == 31
        assert _is_json_object(b"".join(ENGINE_VOCAB[t] for t in tokens[:-1]).decode())
    else:  # the budget ran out first: an open object, every token of it valid
        assert reason == "length" and _accepts(b"".join(ENGINE_VOCAB[t] for t in tokens).decode()) == (True, False)
    assert any(ENGINE_VOCAB[t] == b"x" for t in results["free"][0])  # the other row was left alone


def test_greedy_structured_output_is_the_likeliest_valid_token_each_step() -> None:
    engine = make_engine(eos=(31,), vocab_bytes=lambda: ENGINE_VOCAB)
    engine.add_request(0, [10, 11, 12], SamplingParams(max_tokens=6, temperature=0, structured="json_object"))
    tokens, _ = run(engine)[0]
    # the model's one-hot logits tie every other token at 0: topk's order among them decides, but each is valid
    assert _accepts(b"".join(ENGINE_VOCAB[t] for t in tokens if t != 31).decode())[0]


def test_structured_requests_need_a_tokenizer_and_a_known_format() -> None:
    engine = make_engine()
    with pytest.raises(ValueError, match=r"SamplingParams.structured='json_object' needs the model's tokenizer"):
        engine.add_request(0, [1, 2], SamplingParams(structured="json_object"))
    with pytest.raises(ValueError, match=r"structured: must be 'json_object' or a JSON Schema \(a dict\), got 'yaml'"):
        SamplingParams(structured="yaml").validate()


# ---------------------------------------------------------------- JSON Schemas


def _person_schema() -> dict:
    """What pydantic writes for a nested model: $defs and $ref, Optional as anyOf with null, an enum, a list."""
    import enum

    from pydantic import BaseModel, ConfigDict, Field

    class Colour(enum.Enum):
        RED = "red"
        GREEN = "green"

    class Pet(BaseModel):
        model_config = ConfigDict(extra="forbid")
        name: str
        legs: int

    class Person(BaseModel):
        model_config = ConfigDict(extra="forbid")
        name: str
        age: int
        height: float
        colour: Colour
        pets: list[Pet] = Field(max_length=2)
        nickname: str | None = None
        admin: bool = False

    return Person.model_json_schema()


PERSON_VALID = [
    '{"name": "Ada", "age": 36, "height": 1.65, "colour": "red", "pets": []}',
    '{"pets": [{"name": "Rex", "legs": 4}, {"legs": 2, "name": "Tweety"}], "colour": "green", "height": 2, '
    '"age": -1, "name": "\\u00e9", "nickname": null, "admin": true}',
    '{\n  "name": "x",\n  "age": 0,\n  "height": 1e3,\n  "colour": "red",\n  "pets": [],\n  "nickname": "y"\n}',
]
PERSON_INVALID = [
    '{"name": "Ada", "age": 36, "height": 1.65, "colour": "red"}',  # pets is required
    '{"name": "Ada", "age": 36.5, "height": 1.65, "colour": "red", "pets": []}',  # an integer
    '{"name": "Ada", "age": "36", "height": 1.65, "colour": "red", "pets": []}',
    '{"name": "Ada", "age": 36, "height": 1.65, "colour": "blue", "pets": []}',  # not in the enum
    '{"name": "Ada", "age": 36, "height": 1.65, "colour": "red", "pets": [], "email": "a@b"}',  # no such key
    '{"name": "Ada", "name": "Bob", "age": 36, "height": 1.65, "colour": "red", "pets": []}',  # twice
    '{"name": "Ada", "age": 36, "height": 1.65, "colour": "red", "pets": [{"name": "a", "legs": 1}, '
    '{"name": "b", "legs": 1}, {"name": "c", "legs": 1}]}',  # maxItems 2
    '{"name": "Ada", "age": 36, "height": 1.65, "colour": "red", "pets": [{"name": "Rex"}]}',  # legs required
    '{"name": "Ada", "age": 36, "height": 1.65, "colour": "red", "pets": [], "admin": null}',
    '["Ada"]',
]


def test_a_pydantic_schema_keeps_its_types_keys_enums_and_counts() -> None:
    shape = structured_shape(_person_schema())
    for text in PERSON_VALID:
        assert _accepts(text, shape) == (True, True), text
        for cut in range(len(text)):
            assert _accepts(text[:cut], shape) == (True, False), text[:cut]
    for text in PERSON_INVALID:
        assert _accepts(text, shape)[1] is False, text


def _person_ok(text: str) -> bool:
    """A by-hand validator of the Person schema, for the oracle below."""
    try:
        v = json.loads(text, parse_constant=lambda name: (_ for _ in ()).throw(ValueError(name)),
                       object_pairs_hook=lambda pairs: dict(pairs) if len({k for k, _ in pairs}) == len(pairs)
                       else (_ for _ in ()).throw(ValueError("duplicate")))
    except ValueError:
        return False
    keys = {"name", "age", "height", "colour", "pets", "nickname", "admin"}
    if not isinstance(v, dict) or not set(v) <= keys or not {"name", "age", "height", "colour", "pets"} <= set(v):
        return False
    pets = v["pets"]
    return (isinstance(v["name"], str) and type(v["age"]) is int and type(v["height"]) in (int, float)
            and v["colour"] in ("red", "green") and isinstance(pets, list) and len(pets) <= 2
            and all(isinstance(p, dict) and set(p) == {"name", "legs"} and isinstance(p["name"], str)
                    and type(p["legs"]) is int for p in pets)
            and (v.get("nickname") is None or isinstance(v["nickname"], str))
            and type(v.get("admin", False)) is bool)


def test_the_schema_automaton_agrees_with_a_validator_on_mutated_instances() -> None:
    shape = structured_shape(_person_schema())
    rng = random.Random(2)
    alphabet = '{}[]:,"\\ 0123456789.eE+-truefalsnagdimpc'
    agreed = {True: 0, False: 0}
    for _ in range(3000):
        text = rng.choice(PERSON_VALID)
        i = rng.randrange(len(text))
        edit = rng.choice(["delete", "insert", "replace"])
        text = text[:i] + (rng.choice(alphabet) if edit != "delete" else "") + text[i + (edit != "insert"):]
        truth = _person_ok(text)
        assert _accepts(text, shape)[1] == truth, repr(text)
        agreed[truth] += 1
    assert min(agreed.values()) > 300  # both kinds were tried


@pytest.mark.parametrize("schema, match", [
    ({"not": {"type": "string"}}, r"schema\.not is not supported"),
    ({"type": "object", "properties": {"a": {"if": {}}}}, r"schema\.properties\.a\.if is not supported"),
    ({"type": "date"}, r"schema\.type must be one of"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, r"required must list names"),
    ({"$ref": "#/$defs/Missing"}, r"points at nothing"),
    ({"type": "array", "minItems": 3, "maxItems": 1}, r"minItems/maxItems"),
    ({"enum": [{"a": 1}]}, r"objects and arrays as enum"),
])
def test_schemas_kiln_cannot_keep_are_refused_by_name(schema, match) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(structured=schema).validate()


def test_recursive_schemas_and_type_lists() -> None:
    tree = {"$defs": {"Node": {"type": "object", "properties": {"v": {"type": ["integer", "null"]},
                                                                "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}}},
                               "required": ["v"]}},
            "$ref": "#/$defs/Node"}
    shape = structured_shape(tree)
    assert _accepts('{"v": 1, "kids": [{"v": null}, {"v": 2, "kids": [{"v": 3, "kids": []}]}]}', shape) == (True, True)
    assert _accepts('{"v": 1, "kids": [{"kids": []}]}', shape)[1] is False
    assert _accepts("12", structured_shape({"type": "integer"})) == (True, True)  # a number ends at the text's end
    assert _accepts('"b"', structured_shape({"enum": ["a", "b"]})) == (True, True)
    assert _accepts("1", structured_shape({"enum": [1, 12]})) == (True, True)
    assert _accepts("12", structured_shape({"enum": [1, 12]})) == (True, True)
    assert _accepts("123", structured_shape({"enum": [1, 12]}))[0] is False


PET_SCHEMA = {"type": "object", "properties": {"k": {"type": "integer"}, "v": {"type": "array", "items": {
    "type": "integer"}}}, "required": ["k"]}


def test_schema_requests_through_the_engine_end_as_instances() -> None:
    vocab = list(ENGINE_VOCAB)
    vocab[2] = b'"k"'
    vocab[10], vocab[11] = b'"v"', b"-"
    engine = make_engine(eos=(31,), vocab_bytes=lambda: vocab)
    for i, temp in enumerate((0.0, 1.0, 1.0)):
        engine.add_request(i, [10, 11, 12], SamplingParams(max_tokens=40, temperature=temp, seed=i,
                                                           structured=PET_SCHEMA))
    for tokens, reason in run(engine).values():
        text = b"".join(vocab[t] for t in tokens if t != 31).decode()
        assert _accepts(text, structured_shape(PET_SCHEMA))[0], text
        if reason == "stop":
            value = json.loads(text)
            assert isinstance(value["k"], int) and set(value) <= {"k", "v"}


@pytest.mark.parametrize("schema", [
    "json_object", _person_schema(), PET_SCHEMA, {"type": "array", "items": {"enum": ["ab", "ac", 1]}, "maxItems": 2,
                                                   "minItems": 1},
    {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": {"type": "integer"}},
])
def test_no_prefix_the_automaton_accepts_is_a_dead_end(schema) -> None:
    """Random walks over the printable bytes: wherever a walk stands, some byte
    continues it, or the value is complete. A dead end would leave a request
    with no valid token."""
    shape = structured_shape(schema)
    rng = random.Random(4)
    printable = [bytes([b]) for b in range(0x20, 0x7f)]
    for _ in range(60):
        state, text = JsonAutomaton(shape), b""
        for _ in range(60):
            options = [b for b in printable if state.copy().feed(b)]
            if not options:
                assert state.done, text
                break
            text += rng.choice(options)
            assert state.feed(text[-1:])


def test_with_the_greedy_screen_only_rows_that_refuse_their_argmax_get_logits() -> None:
    """Where the runner takes greedy tokens without logits (the fp32 head's
    bf16 screen), a structured row whose argmax its automaton refuses has its
    own row's logits computed, not the batch's."""
    engine = make_engine(eos=(31,), vocab_bytes=lambda: ENGINE_VOCAB)
    runner = engine.runner
    computed: list[int] = []
    head = runner.compute_logits

    def counted(rows):
        computed.append(rows.shape[0])
        return head(rows)

    runner.compute_logits = counted
    runner.greedy_tokens = lambda rows: head(rows).argmax(dim=-1).tolist()  # the screen's answer, exactly
    engine.add_request("json", [10, 11, 12], SamplingParams(max_tokens=12, temperature=0, structured="json_object"))
    engine.add_request("free", [10, 11, 12], SamplingParams(max_tokens=12, temperature=0))
    results = run(engine)
    assert results["free"][0] == _free_tokens()
    text = b"".join(ENGINE_VOCAB[t] for t in results["json"][0] if t != 31).decode()
    assert _accepts(text)[0] and computed and set(computed) == {1}  # one row's logits at a time


def _free_tokens() -> list[int]:
    engine = make_engine(eos=(31,))
    engine.add_request("free", [10, 11, 12], SamplingParams(max_tokens=12, temperature=0))
    return run(engine)["free"][0]
