"""Structured output: a request's tokens kept to JSON, of a schema's shape or any object.

``SamplingParams(structured=...)`` makes every token the request samples one
that keeps its text a prefix of a JSON value: ``"json_object"`` (OpenAI's
``response_format: {"type": "json_object"}``) any object, a dict a JSON
Schema's shape (``response_format: {"type": "json_schema"}``;
``kiln.engine.json_schema`` says what of a schema is enforced). Once the
value is complete only an end token may follow (EOS or a stop token id;
whitespace where the request has none, with ``ignore_eos``). The text is read
as bytes (``vocab_bytes``: each token's own bytes, special tokens none),
through a pushdown automaton of JSON's grammar (``JsonAutomaton``).

Each step a constrained row keeps, among its ``CANDIDATES`` most likely
tokens after the logit changes, those the automaton accepts, and draws among
them as the sampler draws (temperature, top-k, top-p, min-p apply to them). A
greedy row's token is thus exactly the most likely token that keeps the JSON
valid. A sampled row draws among the most likely valid tokens rather than all
of them; the probability beyond the first 64 of a step is small where a model
writes JSON. Only when none of the candidates is valid is the whole vocabulary
walked, most likely first, until valid tokens are found. A greedy row whose
argmax the automaton allows takes it without a mask (``Sampler.allowed``; the
runner's LM-head screen keeps serving it). On the demo model a greedy answer
kept to a JSON object cost 19.2 ms a token against 19.2 free at one request,
2.14 against 2.10 at 16 (``python -m bench.structured``,
bench/results/structured-cpu-20261207-222016.json). vLLM masks the whole
vocabulary with a compiled grammar instead (xgrammar); kiln has no such
dependency.

Runs of whitespace are capped (``MAX_WHITESPACE`` bytes), so a model cannot
fill its budget with newlines, a failure mode of JSON mode that grammar
engines guard against too. The output can still end unclosed when
``max_tokens`` runs out (finish reason ``length``), as with vLLM.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Sequence
from typing import Any

import torch

from kiln.engine.json_schema import (
    ANY,
    AnyValue,
    Array,
    Literal,
    Number,
    Object,
    Shape,
    String,
    Union,
    any_object,
    compile_schema,
    resolve,
)

__all__ = ["CANDIDATES", "MAX_WHITESPACE", "JsonAutomaton", "TokenConstraint", "structured_shape"]

logger = logging.getLogger(__name__)

CANDIDATES = 64
MAX_WHITESPACE = 48
_NEGLIGIBLE = 1e-4  # a sampled row's unexamined candidates weigh less than this share of the allowed ones
_SCAN_CHUNK = 4096

_WS = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
_ESCAPES = frozenset(b'"\\/bfnrtu')
_HEX = frozenset(b"0123456789abcdefABCDEF")
_QUOTE, _BACKSLASH = ord('"'), ord("\\")

# Frames of the stack, innermost last (tuples: a state is hashable and cheap to copy):
#   (_V, shape)                        a value of ``shape`` comes next
#   (_O, shape, seen, phase, key)      in an object: keys seen, and what comes next
#   (_K, raw, escape)                  in an object's key: its bytes so far
#   (_A, shape, count, phase)          in an array: items so far, and what comes next
#   (_S, enum, raw, escape)            in a string (raw kept only where an enum must match it)
#   (_N, integer, state)               in a number
#   (_L, texts, position)              in a literal: true, false, null or an enum's number
_V, _O, _K, _A, _S, _N, _L = range(7)
# object phases: after "{", after ",", before ":", in a value, after a value; array phases alike
_OPEN, _NEXT, _COLON, _VALUE, _AFTER = range(5)
# number states: after '-', after a leading 0, in the integer, after '.', in the fraction, after 'e',
# after the exponent's sign, in the exponent
_N_MINUS, _N_ZERO, _N_INT, _N_DOT, _N_FRAC, _N_E, _N_ESIGN, _N_EXP = range(8)
_NUMBER_ENDS = frozenset((_N_ZERO, _N_INT, _N_FRAC, _N_EXP))

Stack = tuple


class JsonAutomaton:
    """Where a text is in a JSON value of a schema's shape (``json_schema``),
    fed byte by byte; ``feed`` says whether the bytes can continue it. The
    state is a set of stacks, since alternatives (``anyOf``, a type list)
    stay open until a byte tells them apart, and a number or literal ends
    only at the byte after it."""

    __slots__ = ("stacks", "spaces")

    def __init__(self, shape: Shape) -> None:
        self.stacks: frozenset[Stack] = frozenset({((_V, shape),)})
        self.spaces = 0  # whitespace bytes in a row

    def copy(self) -> JsonAutomaton:
        other = JsonAutomaton.__new__(JsonAutomaton)
        other.stacks, other.spaces = self.stacks, self.spaces
        return other

    @property
    def done(self) -> bool:
        """The value is complete (nothing may follow but whitespace)."""
        return any(_complete(stack) for stack in self.stacks)

    def feed(self, data: bytes) -> bool:
        """Advance over ``data``; False (and the state unchanged) if it cannot continue the value."""
        stacks, spaces = self.stacks, self.spaces
        for b in data:
            nxt: set[Stack] = set()
            for stack in stacks:
                nxt.update(_step(stack, b))
            if not nxt:
                return False
            free = b in _WS and any(not _in_text(s) for s in stacks)
            spaces = spaces + 1 if free else 0
            if spaces > MAX_WHITESPACE:
                return False
            stacks = frozenset(nxt)
        self.stacks, self.spaces = stacks, spaces
        return True


def _in_text(stack: Stack) -> bool:
    return bool(stack) and stack[-1][0] in (_S, _K)


def _complete(stack: Stack) -> bool:
    """Whether the stack holds a whole value: empty, or one number or literal that may end here."""
    return not stack or (len(stack) == 1 and _ends(stack[0]))


def _ends(frame: tuple) -> bool:
    return ((frame[0] == _N and frame[2] in _NUMBER_ENDS)
            or (frame[0] == _L and any(len(t) == frame[2] for t in frame[1])))


def _step(stack: Stack, b: int) -> list[Stack]:
    if not stack:
        return [stack] if b in _WS else []
    frame = stack[-1]
    kind = frame[0]
    if kind == _V:
        return [stack] if b in _WS else _start(stack[:-1], frame[1], b)
    if kind == _S:
        return _string(stack, frame, b)
    if kind == _K:
        return _key(stack, frame, b)
    if kind in (_N, _L):
        out = _continue_scalar(stack, frame, b)
        if _ends(frame):  # the byte may also come after it
            out += _step(_finish(stack[:-1]), b)
        return out
    if kind == _O:
        return _object(stack, frame, b)
    return _array(stack, frame, b)


def _start(base: Stack, shape: Shape, b: int) -> list[Stack]:
    """The stacks where a value of ``shape`` begins with byte ``b`` on top of ``base``."""
    shape = resolve(shape)
    if isinstance(shape, Union):
        return [s for option in shape.options for s in _start(base, option, b)]
    if isinstance(shape, AnyValue):
        return [s for option in _ANY_OPTIONS for s in _start(base, option, b)]
    if isinstance(shape, Object):
        return [base + ((_O, shape, frozenset(), _OPEN, None),)] if b == ord("{") else []
    if isinstance(shape, Array):
        return [base + ((_A, shape, 0, _OPEN),)] if b == ord("[") else []
    if isinstance(shape, String):
        return [base + ((_S, shape.enum, b"" if shape.enum is not None else None, 0),)] if b == _QUOTE else []
    if isinstance(shape, Number):
        if b == ord("-") or b in _DIGITS:
            return [base + ((_N, shape.integer, _N_MINUS if b == ord("-") else _N_ZERO if b == ord("0") else _N_INT),)]
        return []
    texts = tuple(t for t in shape.texts if t[0] == b)  # type: ignore[attr-defined]
    return [base + ((_L, texts, 1),)] if texts else []


_ANY_OPTIONS = (Object({}, extra=ANY), Array(ANY), String(), Number(), Literal((b"true", b"false", b"null")))


def _finish(stack: Stack) -> Stack:
    """``stack`` after the value on top of it ended: its container moves past the value."""
    if not stack:
        return stack
    frame = stack[-1]
    if frame[0] == _O:  # only declared keys are counted: others may repeat, as JSON lets them
        seen = frame[2] | {frame[4]} if frame[4] in frame[1].properties else frame[2]
        return stack[:-1] + ((_O, frame[1], seen, _AFTER, None),)
    return stack[:-1] + ((_A, frame[1], frame[2] + 1, _AFTER),)


def _object(stack: Stack, frame: tuple, b: int) -> list[Stack]:
    _, shape, seen, phase, key = frame
    if b in _WS:
        return [stack]
    if b == ord("}") and phase in (_OPEN, _AFTER) and shape.required <= seen:
        return [_finish(stack[:-1])]
    if b == _QUOTE and phase in (_OPEN, _NEXT) and _more_keys(shape, seen):
        return [stack + ((_K, b"", 0),)]
    if b == ord(",") and phase == _AFTER and _more_keys(shape, seen):
        return [stack[:-1] + ((_O, shape, seen, _NEXT, None),)]
    if b == ord(":") and phase == _COLON:
        return [stack[:-1] + ((_O, shape, seen, _VALUE, key), (_V, shape.value(key)))]
    return []


def _more_keys(shape: Object, seen: frozenset[str]) -> bool:
    return shape.extra is not None or len(seen) < len(shape.properties)


def _key(stack: Stack, frame: tuple, b: int) -> list[Stack]:
    _, raw, escape = frame
    obj = stack[-2]
    shape, seen = obj[1], obj[2]
    if escape == 0 and b == _QUOTE:
        name = shape.keys.get(raw)
        if name is None and shape.extra is not None:
            try:
                name = json.loads(b'"' + raw + b'"')
            except ValueError:
                return []
        if name is None or name in seen:
            return []
        return [stack[:-2] + ((_O, shape, seen, _COLON, name),)]
    escape = _escape(escape, b)
    if escape < 0:
        return []
    raw += bytes((b,))
    if shape.extra is None and not any(k.startswith(raw) and shape.keys[k] not in seen for k in shape.keys):
        return []
    return [stack[:-1] + ((_K, raw, escape),)]


def _string(stack: Stack, frame: tuple, b: int) -> list[Stack]:
    _, enum, raw, escape = frame
    if escape == 0 and b == _QUOTE:
        return [_finish(stack[:-1])] if enum is None or raw in enum else []
    escape = _escape(escape, b)
    if escape < 0:
        return []
    if enum is None:
        return [stack[:-1] + ((_S, None, None, escape),)]
    raw += bytes((b,))
    return [stack[:-1] + ((_S, enum, raw, escape),)] if any(e.startswith(raw) for e in enum) else []


def _escape(escape: int, b: int) -> int:
    """The escape state after byte ``b`` inside a string (0: none, 1: after a
    backslash, 2-5: in a \\u escape's hex digits); -1 if ``b`` is not allowed."""
    if escape == 0:
        if b == _BACKSLASH:
            return 1
        return 0 if b >= 0x20 else -1  # control characters must be escaped; UTF-8 bytes pass
    if escape == 1:
        return (2 if b == ord("u") else 0) if b in _ESCAPES else -1
    if b not in _HEX:
        return -1
    return 0 if escape == 5 else escape + 1


def _continue_scalar(stack: Stack, frame: tuple, b: int) -> list[Stack]:
    if frame[0] == _L:
        texts, pos = frame[1], frame[2]
        cont = tuple(t for t in texts if len(t) > pos and t[pos] == b)
        return [stack[:-1] + ((_L, cont, pos + 1),)] if cont else []
    nxt = _number(frame[2], b, frame[1])
    return [stack[:-1] + ((_N, frame[1], nxt),)] if nxt is not None else []


def _number(s: int, b: int, integer: bool) -> int | None:
    digit = b in _DIGITS
    if s == _N_MINUS:
        return (_N_ZERO if b == ord("0") else _N_INT) if digit else None
    if s in (_N_ZERO, _N_INT):
        if digit:
            return _N_INT if s == _N_INT else None
        if integer:
            return None
        return _N_DOT if b == ord(".") else _N_E if b in b"eE" else None
    if s in (_N_DOT, _N_FRAC):
        return _N_FRAC if digit else (_N_E if s == _N_FRAC and b in b"eE" else None)
    if s in (_N_E, _N_ESIGN):
        return _N_EXP if digit else (_N_ESIGN if s == _N_E and b in b"+-" else None)
    return _N_EXP if digit else None


def _array(stack: Stack, frame: tuple, b: int) -> list[Stack]:
    _, shape, count, phase = frame
    if b in _WS:
        return [stack]
    if b == ord("]") and phase in (_OPEN, _AFTER) and count >= shape.min_items:
        return [_finish(stack[:-1])]
    if b == ord(",") and phase == _AFTER and (shape.max_items is None or count < shape.max_items):
        return [stack[:-1] + ((_A, shape, count, _NEXT),)]
    if phase in (_OPEN, _NEXT) and (shape.max_items is None or count < shape.max_items):
        return _start(stack[:-1] + ((_A, shape, count, _VALUE),), shape.items, b)
    return []


def structured_shape(structured: str | dict[str, Any]) -> Shape:
    """The shape ``SamplingParams.structured`` asks for: any object for
    ``"json_object"``, else the JSON Schema's (ValueError naming what is wrong).
    A request's schema is asked for by its validation, the server's checks
    and its constraint: compiled once, by its JSON text (shapes are never
    changed after compiling, so requests share them)."""
    if structured == "json_object":
        return _ANY_OBJECT
    if isinstance(structured, dict):
        try:
            text = json.dumps(structured, sort_keys=True)
        except (TypeError, ValueError) as e:
            raise ValueError(f"a JSON Schema must be JSON: {e}") from None
        return _compiled(text)
    raise ValueError(f"must be 'json_object' or a JSON Schema (a dict), got {structured!r:.80}")


@functools.lru_cache(maxsize=128)
def _compiled(text: str) -> Shape:
    return compile_schema(json.loads(text))


_ANY_OBJECT = any_object()


class TokenConstraint:
    """One request's JSON automaton over the model's tokens. ``vocab`` gives
    each token id's bytes (None: never allowed, as special tokens);
    ``ends`` are the tokens that may end the output once the value is complete."""

    def __init__(self, vocab: Sequence[bytes | None], ends: Sequence[int], shape: Shape | None = None) -> None:
        self.vocab = vocab
        self.ends = frozenset(ends)
        self.state = JsonAutomaton(shape if shape is not None else any_object())
        self._warned = False

    def allows(self, token: int) -> bool:
        if token in self.ends:
            return self.state.done
        if self.state.done and self.ends:  # closed: the output ends here, no trailing whitespace
            return False
        data = self.vocab[token] if 0 <= token < len(self.vocab) else None
        return bool(data) and self.state.copy().feed(data)  # type: ignore[arg-type]

    def advance(self, token: int) -> None:
        """The request sampled ``token``. A token the automaton refuses (one it
        could not have offered, or an unconstrained step) leaves the state as it was."""
        if token in self.ends:
            return
        data = self.vocab[token] if 0 <= token < len(self.vocab) else None
        if data:
            self.state.feed(data)

    def mask(self, row: torch.Tensor, temperature: float = 0.0) -> None:
        """Set every logit of ``row`` (1-D, processed) but the allowed
        candidates' to -inf, in place. A greedy row (``temperature`` 0) keeps
        only the most likely allowed token; a sampled row stops looking once
        the candidates left weigh less than ``_NEGLIGIBLE`` of those found at
        its temperature. A row of 49152 logits inside a JSON string: 0.13 ms
        greedy, 0.5 ms sampled from a flat row that checks all 64 candidates
        (scratch timings; a peaked row stops sooner)."""
        if temperature <= 0.0:
            best = int(row.argmax())
            if self.allows(best) and row[best] > float("-inf"):
                self._keep(row, [best])
                return
        k = min(CANDIDATES, row.numel())
        values, ids = torch.topk(row, k)
        allowed = self._candidates(ids.tolist(), values.tolist(), temperature)
        if not allowed:
            allowed = self._scan(row)
        if not allowed:
            if not self._warned:
                logger.warning("no token can continue this request's JSON (its end tokens are suppressed?); "
                               "sampling it unconstrained")
                self._warned = True
            return
        self._keep(row, allowed[:1] if temperature <= 0.0 else allowed)

    def _candidates(self, ids: list[int], values: list[float], temperature: float) -> list[int]:
        """The allowed tokens among ``ids`` (most likely first, logits ``values``),
        looked at until the rest cannot matter: the first for a greedy row."""
        allowed: list[int] = []
        if values[0] == float("-inf"):
            return allowed
        weights = [math.exp((v - values[0]) / temperature) for v in values] if temperature > 0.0 else None
        left = sum(weights) if weights is not None else 0.0
        found = 0.0
        for i, (t, v) in enumerate(zip(ids, values)):
            if v == float("-inf"):
                break
            if weights is not None:
                left -= weights[i]
            if self.allows(t):
                allowed.append(t)
                if weights is None:
                    break
                found += weights[i]
            if weights is not None and found > 0.0 and left < _NEGLIGIBLE * found:
                break
        return allowed

    @staticmethod
    def _keep(row: torch.Tensor, tokens: list[int]) -> None:
        index = torch.tensor(tokens, dtype=torch.long, device=row.device)
        kept = row[index]
        row.fill_(float("-inf"))
        row[index] = kept

    def _scan(self, row: torch.Tensor) -> list[int]:
        """The allowed tokens of the first chunk of the vocabulary, most likely
        first, that has any (the most likely allowed token among them)."""
        order = torch.argsort(row, descending=True)
        finite = int(torch.isfinite(row).sum())
        for start in range(0, finite, _SCAN_CHUNK):
            chunk = order[start:min(start + _SCAN_CHUNK, finite)].tolist()
            allowed = [t for t in chunk if self.allows(t)]
            if allowed:
                return allowed
        return []
