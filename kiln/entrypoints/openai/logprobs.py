"""Log-probabilities as the OpenAI API writes them, and vLLM's prompt logprobs.

Three shapes of the same ``TokenLogprobs``:

- completions' ``logprobs``: parallel lists ``tokens``, ``token_logprobs``,
  ``top_logprobs`` (token text -> logprob: the ``k`` most likely and the chosen
  token, so up to ``k + 1`` entries, as OpenAI documents) and ``text_offset``.
  With ``echo`` the prompt's tokens come first; its first token has ``None``
  for its logprob and its alternatives (nothing predicts it).
- chat's ``logprobs.content``: one entry per token with its ``bytes`` and its
  ``top_logprobs`` list.
- vLLM's ``prompt_logprobs``: per prompt token ``None`` (the first) or
  ``{token id: {"logprob", "rank", "decoded_token"}}`` over the prompt token and
  the ``k`` most likely.

A token is named by the text it adds after the tokens before it
(``detokenizer.token_texts_after``), so a SentencePiece word start keeps its
leading space and the tokens add up to the text.
"""

from __future__ import annotations

from typing import Any

from kiln.engine.detokenizer import token_bytes, token_texts_after
from kiln.engine.outputs import TokenLogprobs

__all__ = ["LOGPROB_FLOOR", "LogprobFormatter", "json_logprob"]

# tokens of context for a logprob token's text (detokenizer.token_texts_after takes its last few)
_CONTEXT = 6

# What a log-probability of -inf (a token the filters removed) is sent as: JSON has no infinity, and vLLM
# sends this number
LOGPROB_FLOOR = -9999.0


def json_logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


class LogprobFormatter:
    """Formats logprobs over one tokenizer (None: a model without one, whose
    tokens are named by their ids)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def position_texts(self, prior: list[int], token_ids: list[int],
                       lps: list[TokenLogprobs | None]) -> list[list[str]]:
        """At each position of ``token_ids`` (which follow ``prior``), the text
        of its token then of each alternative in ``lps``, as logprobs name them:
        after the tokens before that position (its context decoded once)."""
        out = []
        for ctx, t, lp in zip(self.contexts(prior, token_ids), token_ids, lps):
            ids = [t, *(i for i, _ in lp.top)] if lp is not None else [t]
            out.append(token_texts_after(self.tokenizer, ctx, ids) if self.tokenizer is not None
                       else [str(i) for i in ids])
        return out

    @staticmethod
    def contexts(prior: list[int], token_ids: list[int]) -> list[list[int]]:
        """The tokens before each of ``token_ids`` (``prior``: all before the first), the last few of them."""
        ids = prior[-_CONTEXT:] + token_ids
        start = len(ids) - len(token_ids)
        return [ids[max(0, start + i - _CONTEXT):start + i] for i in range(len(token_ids))]

    def token_bytes(self, token_id: int) -> bytes:
        tokenizer = self.tokenizer
        return token_bytes(tokenizer, token_id) if tokenizer is not None else str(token_id).encode("utf-8")

    def completion(self, lps: list[TokenLogprobs | None], token_ids: list[int], offset: int,
                   prior: list[int]) -> dict[str, list[Any]]:
        """Completions' logprobs of ``token_ids``, which follow the tokens
        ``prior``; the first starts at character ``offset`` of the choice's
        text. A position whose ``lps`` entry is None (a prompt's first token)
        has None for its logprob and alternatives."""
        texts = self.position_texts(prior, token_ids, lps)
        offsets = []
        for t in texts:
            offsets.append(offset)
            offset += len(t[0])
        top: list[dict[str, float] | None] = []
        for t, lp in zip(texts, lps):
            if lp is None:
                top.append(None)
                continue
            alternatives = {t[0]: json_logprob(lp.logprob)}  # the chosen token first, as vLLM orders them
            alternatives.update((text, json_logprob(v)) for text, (_, v) in zip(t[1:], lp.top))
            top.append(alternatives)
        return {"tokens": [t[0] for t in texts],
                "token_logprobs": [None if lp is None else json_logprob(lp.logprob) for lp in lps],
                "top_logprobs": top, "text_offset": offsets}

    @staticmethod
    def joined(first: dict[str, list[Any]], second: dict[str, list[Any]]) -> dict[str, list[Any]]:
        """Two completions' logprobs one after the other (an echoed prompt's, then the output's)."""
        return {key: first[key] + second[key] for key in first}

    def chat(self, lps: list[TokenLogprobs], token_ids: list[int], prior: list[int]) -> dict[str, Any]:
        """Chat's logprobs of ``token_ids``, which follow the tokens ``prior``."""
        def entry(text: str, token_id: int, logprob: float) -> dict[str, Any]:
            return {"token": text, "logprob": json_logprob(logprob), "bytes": list(self.token_bytes(token_id))}

        return {"content": [{**entry(texts[0], t, lp.logprob),
                             "top_logprobs": [entry(text, i, v) for text, (i, v) in zip(texts[1:], lp.top)]}
                            for texts, t, lp in zip(self.position_texts(prior, token_ids, lps), token_ids, lps)]}

    def prompt(self, lps: list[TokenLogprobs | None], prompt_ids: list[int]) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs``: per prompt token None (the first) or its
        entry and its alternatives', keyed by token id (a JSON key: a string)."""
        out: list[dict[str, Any] | None] = []
        for texts, t, lp in zip(self.position_texts([], prompt_ids, lps), prompt_ids, lps):
            if lp is None:
                out.append(None)
                continue
            entries = {str(t): {"logprob": json_logprob(lp.logprob), "rank": lp.rank, "decoded_token": texts[0]}}
            for rank, (text, (i, v)) in enumerate(zip(texts[1:], lp.top), start=1):
                entries.setdefault(str(i), {"logprob": json_logprob(v), "rank": rank, "decoded_token": text})
            out.append(entries)
        return out
