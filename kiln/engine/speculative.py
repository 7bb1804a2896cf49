"""Speculative decoding by prompt lookup (``SpeculativeConfig``, vLLM's
``"ngram"`` method).

A model that copies (a quoted passage, code being edited, a list that repeats
its pattern, greedy text caught in a loop) writes tokens that already stand
earlier in its prompt or output. After each step the proposer looks for the
longest n-gram that ends a request's tokens earlier in them, and proposes the
tokens that followed it there as drafts. The scheduler runs them with the
request's next token, as a chunk of ``1 + k`` positions (``ScheduledRequest.
draft_token_ids``); the runner returns the greedy token of every position, and
``accept`` keeps the drafts the model picks itself, then the model's own token
after them. A step gives ``1 + accepted`` tokens for about the cost of one on
a machine whose decode reads every weight for each token (a CPU, a GPU at
small batches): the verifying step reads the weights once for all of them.

Only plain greedy requests speculate (``speculates``): the tokens they keep
are the ones the model gives one at a time, up to the arithmetic of a
several-row step against a one-row step (near-ties; ``bench/speculative.py``
reports how often the tokens agree). Requests that sample, penalize, bias, ask
for logprobs or follow a JSON schema decode one token a step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kiln.config import SpeculativeConfig
from kiln.engine.request import Request, RequestId

__all__ = ["NgramProposer", "accept", "speculates"]


def speculates(req: Request) -> bool:
    """Whether ``req``'s tokens may come from drafts: greedy on the raw logits,
    with nothing that reads each token's distribution or history."""
    p = req.params
    return (p.greedy and p.logprobs is None and not p.changes_logits and req.constraint is None
            and len(req.output_token_ids) >= p.min_tokens)


def accept(drafts: Sequence[int], tokens: Sequence[int]) -> list[int]:
    """The tokens a step gives a request that ran ``drafts``: ``tokens[i]`` is
    the model's token after the request's token and ``drafts[:i]``; the drafts
    it agrees with are kept, then its own token after them."""
    n = 0
    while n < len(drafts) and tokens[n] == drafts[n]:
        n += 1
    return list(tokens[:n + 1])


class NgramProposer:
    """Drafts from earlier in a request's own tokens. Each request's tokens
    are kept in a numpy buffer that grows by the tokens it gained since the
    last call, so a proposal costs one compare over the tokens (to find the
    earlier places of the last token) and a few over those places, not a copy
    of the tokens: 14, 22 and 31 us a call at 200, 2000 and 8000 tokens (a
    500-token vocabulary, so many earlier places; scratch). Taking windows of
    every n-gram length over the whole sequence took 89-687 us."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.n_max = config.prompt_lookup_max
        self.n_min = config.prompt_lookup_min
        self.max_batch = config.disable_by_batch_size  # None: any batch
        self._tokens: dict[RequestId, tuple[np.ndarray, int]] = {}

    def propose(self, req: Request, limit: int) -> list[int]:
        """Up to ``min(k, limit)`` drafts to follow ``req``'s tokens, or none."""
        limit = min(self.k, limit)
        tokens = self._sync(req)
        total = len(tokens)
        if limit < 1 or total < self.n_min + 1:
            return []
        # where an earlier token equals the last one: the ends of every earlier match
        ends = np.flatnonzero(tokens[:total - 1] == tokens[total - 1])
        if ends.size == 0:
            return []
        # how far back each match goes, up to n_max tokens
        length = np.ones(ends.size, dtype=np.int64)
        alive = np.ones(ends.size, dtype=bool)
        for j in range(1, min(self.n_max, total - 1)):
            alive &= ends >= j
            alive[alive] = tokens[ends[alive] - j] == tokens[total - 1 - j]
            length += alive
        best = length.max()
        if best < self.n_min:
            return []
        ends = ends[length == best]
        # the most recent match followed by ``limit`` tokens (in a loop of period p, the last one is followed by
        # only p); else the earliest, followed by the most
        full = ends[ends <= total - 1 - limit]
        start = int(full[-1] if full.size else ends[0]) + 1
        return tokens[start:start + limit].tolist()

    def _sync(self, req: Request) -> np.ndarray:
        """``req``'s prompt and output as a numpy view, appended to since the last call."""
        total = req.num_tokens
        buf, known = self._tokens.get(req.request_id, (None, 0))
        if buf is None or known > total:  # new, or its output was reset
            buf, known = np.empty(max(64, 2 * total), dtype=np.int64), 0
        elif buf.size < total:
            grown = np.empty(2 * total, dtype=np.int64)
            grown[:known] = buf[:known]
            buf = grown
        if known < total:
            buf[known:total] = req.tokens(known, total)
        self._tokens[req.request_id] = (buf, total)
        return buf[:total]

    def forget(self, request_id: RequestId) -> None:
        """Drop a finished request's buffer."""
        self._tokens.pop(request_id, None)
