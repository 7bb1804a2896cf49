"""Incremental detokenization with stop strings.

Decoding a growing token list from the start each step costs O(n^2); instead a
short window is decoded: the tokens since the last emitted boundary, with a few
earlier tokens as context so that tokenizers that treat word starts specially
(SentencePiece's leading space) render the same text as a full decode. Text
ending in an incomplete UTF-8 sequence is held back until it completes, and so is
any tail that could still grow into a stop string.
"""

from __future__ import annotations

from typing import Any

__all__ = ["IncrementalDetokenizer"]

_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # all decoded output text (stop string cut, once found)
        self.emitted = 0  # how much of ``text`` has been handed out
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_ids: list[int], final: bool = False) -> None:
        """Append newly sampled tokens; sets ``stopped`` when a stop string appears."""
        if self.tokenizer is None or self.stopped:
            return
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            before = len(self.text)
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._check_stop(before)

    def _check_stop(self, before: int) -> None:
        for s in self.stop:
            pos = self.text.find(s, max(0, before - len(s) + 1))
            if pos != -1:
                self.text = self.text[:pos]
                self.stopped = True
                return

    def take(self, finished: bool) -> str:
        """The text not handed out yet; while running, keep back a tail that could
        still turn into a stop string."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
