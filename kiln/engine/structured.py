"""Structured output: a request's tokens kept to a JSON object.

``SamplingParams(structured="json_object")`` (OpenAI's ``response_format:
{"type": "json_object"}``) makes every token the request samples one that
keeps its text a prefix of a JSON object, and once the object is closed only
an end token (EOS or a stop token id; whitespace where the request has none,
with ``ignore_eos``). The text is read as bytes
(``vocab_bytes``: each token's own bytes, special tokens none), through a
pushdown automaton of JSON's grammar (``JsonObjectState``).

Each step a constrained row keeps, among its ``CANDIDATES`` most likely
tokens after the logit changes, those the automaton accepts, and draws among
them as the sampler draws (temperature, top-k, top-p, min-p apply to them). A
greedy row's token is thus exactly the most likely token that keeps the JSON
valid. A sampled row draws among the most likely valid tokens rather than all
of them; the probability beyond the first 64 of a step is small where a model
writes JSON. Only when none of the candidates is valid is the whole vocabulary
walked, most likely first, until valid tokens are found. A candidate costs a
few microseconds (its bytes through the automaton), so a step of a
constrained request costs well under a millisecond more. vLLM masks the whole
vocabulary with a compiled grammar instead (xgrammar); kiln has no such
dependency.

Runs of whitespace are capped (``MAX_WHITESPACE`` bytes), so a model cannot
fill its budget with newlines, a failure mode of JSON mode that grammar
engines guard against too. The output can still end unclosed when
``max_tokens`` runs out (finish reason ``length``), as with vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

__all__ = ["CANDIDATES", "MAX_WHITESPACE", "STRUCTURED_FORMATS", "JsonObjectState", "TokenConstraint"]

logger = logging.getLogger(__name__)

STRUCTURED_FORMATS = ("json_object",)
CANDIDATES = 64
MAX_WHITESPACE = 48
_SCAN_CHUNK = 4096

_WS = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
_ESCAPES = frozenset(b'"\\/bfnrtu')
_HEX = frozenset(b"0123456789abcdefABCDEF")
_LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}

# modes: what the next byte may be
_START, _VALUE, _KEY_OR_CLOSE, _KEY, _COLON, _AFTER, _STRING, _NUMBER, _LITERAL, _DONE = range(10)
# number states: after '-', after a leading 0, in the integer, after '.', in the fraction, after 'e',
# after the exponent's sign, in the exponent
_N_MINUS, _N_ZERO, _N_INT, _N_DOT, _N_FRAC, _N_E, _N_ESIGN, _N_EXP = range(8)
_NUMBER_ENDS = frozenset((_N_ZERO, _N_INT, _N_FRAC, _N_EXP))


class JsonObjectState:
    """Where a text is in a JSON object, fed byte by byte; ``feed`` says
    whether the bytes can continue it. Cheap to copy: the stack of open
    containers is a string."""

    __slots__ = ("mode", "stack", "sub", "key", "array_open", "spaces")

    def __init__(self) -> None:
        self.mode = _START
        self.stack = ""  # "o" an object, "a" an array, innermost last
        self.sub = 0  # the string's escape state, the number's state, or the literal's bytes left
        self.key = False  # the string is an object's key
        self.array_open = False  # a value may also be "]": the array was just opened
        self.spaces = 0  # whitespace bytes in a row

    def copy(self) -> JsonObjectState:
        other = JsonObjectState.__new__(JsonObjectState)
        other.mode, other.stack, other.sub, other.key = self.mode, self.stack, self.sub, self.key
        other.array_open, other.spaces = self.array_open, self.spaces
        return other

    @property
    def done(self) -> bool:
        """The object is closed."""
        return self.mode == _DONE

    def feed(self, data: bytes) -> bool:
        """Advance over ``data``; False (and the state undefined) if it cannot continue a JSON object."""
        return all(self._byte(b) for b in data)

    def _byte(self, b: int) -> bool:
        mode = self.mode
        if mode == _STRING:
            return self._string(b)
        if mode == _NUMBER:
            if self._number(b):
                return True
            if self.sub not in _NUMBER_ENDS:
                return False
            self.mode = _AFTER  # the byte ends the number and is read after it
            return self._byte(b)
        if mode == _LITERAL:
            expected, left = _LITERALS[self.sub >> 8], self.sub & 0xFF
            if b != expected[len(expected) - left]:
                return False
            self.sub -= 1
            if left == 1:
                self.mode = _AFTER
            return True
        if b in _WS:
            self.spaces += 1
            return self.spaces <= MAX_WHITESPACE
        self.spaces = 0
        return self._structural(b, mode)

    def _structural(self, b: int, mode: int) -> bool:
        if mode == _START:
            return b == ord("{") and self._open("o")
        if mode == _VALUE:
            if b == ord("]") and self.array_open:
                return self._close("a")
            return self._value(b)
        if mode in (_KEY_OR_CLOSE, _KEY):
            if b == ord("}") and mode == _KEY_OR_CLOSE:
                return self._close("o")
            if b != ord('"'):
                return False
            self.mode, self.sub, self.key = _STRING, 0, True
            return True
        if mode == _COLON:
            if b != ord(":"):
                return False
            self.mode, self.array_open = _VALUE, False
            return True
        if mode == _AFTER:
            inner = self.stack[-1]
            if b == ord(","):
                self.mode, self.array_open = (_KEY if inner == "o" else _VALUE), False
                return True
            return self._close(inner) if b == (ord("}") if inner == "o" else ord("]")) else False
        return False  # _DONE: only whitespace

    def _value(self, b: int) -> bool:
        if b == ord("{"):
            return self._open("o")
        if b == ord("["):
            return self._open("a")
        if b == ord('"'):
            self.mode, self.sub, self.key = _STRING, 0, False
            return True
        if b == ord("-") or b in _DIGITS:
            self.mode = _NUMBER
            self.sub = _N_MINUS if b == ord("-") else (_N_ZERO if b == ord("0") else _N_INT)
            return True
        if b in _LITERALS:
            self.mode, self.sub = _LITERAL, (b << 8) | len(_LITERALS[b])
            return True
        return False

    def _open(self, kind: str) -> bool:
        self.stack += kind
        self.mode = _KEY_OR_CLOSE if kind == "o" else _VALUE
        self.array_open = kind == "a"
        return True

    def _close(self, kind: str) -> bool:
        if not self.stack or self.stack[-1] != kind:
            return False
        self.stack = self.stack[:-1]
        self.mode = _AFTER if self.stack else _DONE
        self.array_open = False
        return True

    def _string(self, b: int) -> bool:
        esc = self.sub
        if esc == 0:
            if b == ord('"'):
                self.mode = _COLON if self.key else _AFTER
                return True
            if b == ord("\\"):
                self.sub = 1
            return b >= 0x20  # control characters must be escaped; bytes of UTF-8 characters pass
        if esc == 1:
            if b not in _ESCAPES:
                return False
            self.sub = 2 if b == ord("u") else 0
            return True
        if b not in _HEX:  # esc 2..5: the \\u escape's four hex digits
            return False
        self.sub = 0 if esc == 5 else esc + 1
        return True

    def _number(self, b: int) -> bool:
        s = self.sub
        digit = b in _DIGITS
        if s == _N_MINUS:
            nxt = (_N_ZERO if b == ord("0") else _N_INT) if digit else None
        elif s in (_N_ZERO, _N_INT):
            nxt = (_N_INT if s == _N_INT and digit else None) or (
                _N_DOT if b == ord(".") else _N_E if b in b"eE" else None)
        elif s in (_N_DOT, _N_FRAC):
            nxt = _N_FRAC if digit else (_N_E if s == _N_FRAC and b in b"eE" else None)
        elif s in (_N_E, _N_ESIGN):
            nxt = _N_EXP if digit else (_N_ESIGN if s == _N_E and b in b"+-" else None)
        else:  # _N_EXP
            nxt = _N_EXP if digit else None
        if nxt is None:
            return False
        self.sub = nxt
        return True


class TokenConstraint:
    """One request's JSON automaton over the model's tokens. ``vocab`` gives
    each token id's bytes (None: never allowed, as special tokens);
    ``ends`` are the tokens that may end the output once the object is closed."""

    def __init__(self, vocab: Sequence[bytes | None], ends: Sequence[int]) -> None:
        self.vocab = vocab
        self.ends = frozenset(ends)
        self.state = JsonObjectState()
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
        nxt = self.state.copy()
        if data and nxt.feed(data):
            self.state = nxt

    def mask(self, row: torch.Tensor) -> None:
        """Set every logit of ``row`` (1-D, processed) but the allowed
        candidates' to -inf, in place."""
        k = min(CANDIDATES, row.numel())
        values, ids = torch.topk(row, k)
        allowed = [t for t, v in zip(ids.tolist(), values.tolist()) if v > float("-inf") and self.allows(t)]
        if not allowed:
            allowed = self._scan(row)
        if not allowed:
            if not self._warned:
                logger.warning("no token can continue this request's JSON (its end tokens are suppressed?); "
                               "sampling it unconstrained")
                self._warned = True
            return
        index = torch.tensor(allowed, dtype=torch.long, device=row.device)
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
