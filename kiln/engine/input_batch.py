"""The runner's persistent input buffers, and a step's inputs written into them.

Buffers are allocated once, sized by ``max_num_batched_tokens`` and
``max_num_seqs``: the model always reads views of the same memory, which is what
CUDA graph replay needs. The host side stages every value in numpy views of
(pinned, on CUDA) CPU tensors, then one copy per buffer moves them to the device.

Padding (for a CUDA graph's fixed size) gives tokens id 0, position 0 and slot -1
(no KV write); a FULL graph also pads the request rows with requests that own no
tokens and no context. Neither changes a real row's output.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kiln.attention.backend import CommonAttentionMetadata
from kiln.engine.scheduler import SchedulerOutput

__all__ = ["InputBatch", "StepShape"]


class _Buffer:
    """A device tensor and its host staging twin (the same memory on CPU)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.cpu = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.np = self.cpu.numpy()
        self.device = self.cpu if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)
        # The device views of the first n rows, made once each up to
        # _KEPT_VIEWS rows (a decode step's sizes; a prompt step's slices cost
        # nothing next to its compute): a step takes about ten of them, and a
        # slice is a torch call that cost 1-3 us in a CPU decode step (the
        # caches cold after the weights stream through).
        self._views: dict[int, torch.Tensor] = {}

    _KEPT_VIEWS = 512

    def view(self, n: int) -> torch.Tensor:
        """The device tensor's first ``n`` rows."""
        v = self._views.get(n)
        if v is None:
            v = self.device[:n]
            if n <= self._KEPT_VIEWS:
                self._views[n] = v
        return v

    def upload(self, n: int) -> torch.Tensor:
        """Copy the first ``n`` rows to the device; return the device view."""
        if self.device is not self.cpu:
            self.device[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.view(n)


@dataclass(frozen=True)
class StepShape:
    """The sizes of a step as scheduled, before padding."""

    num_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    num_samples: int  # rows whose tokens are picked: one a sampling request, and one a draft

    @property
    def uniform_decode(self) -> bool:
        return self.max_query_len == 1


class InputBatch:
    def __init__(self, *, max_num_batched_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                 block_size: int, device: torch.device) -> None:
        t, r = max_num_batched_tokens, max_num_seqs
        self.max_num_batched_tokens, self.max_num_seqs = t, r
        self.block_size = block_size
        self.input_ids = _Buffer((t,), torch.int64, device)
        self.positions = _Buffer((t,), torch.int64, device)
        self.slot_mapping = _Buffer((t,), torch.int64, device)
        self.query_start_loc = _Buffer((r + 1,), torch.int32, device)
        self.seq_lens = _Buffer((r,), torch.int32, device)
        self.block_table = _Buffer((r, max_blocks_per_seq), torch.int32, device)
        self.logits_indices = _Buffer((t,), torch.int64, device)  # a request's drafts add rows (speculation)

    def stage(self, sched: SchedulerOutput) -> StepShape:
        """Write the scheduled step into the host buffers."""
        if self._drafts_as_rows(sched):
            return self._stage_rows(sched)
        num_reqs = len(sched.scheduled)
        if num_reqs > self.max_num_seqs:
            raise RuntimeError(f"{num_reqs} requests scheduled, buffers hold {self.max_num_seqs}")
        if sched.total_tokens > self.max_num_batched_tokens:
            raise RuntimeError(f"{sched.total_tokens} tokens scheduled, buffers hold {self.max_num_batched_tokens}")
        bs = self.block_size
        offset = num_samples = max_q = max_seq = 0
        for i, s in enumerate(sched.scheduled):
            n, end = s.num_tokens, offset + s.num_tokens
            if n == 1:
                # A decode's one token in plain ints: the array form below costs
                # its numpy calls on every request of every step (a batch-1
                # Q8_0 CPU step's stage took 69 us, between kernels that leave
                # the caches cold, against 14-17 us this way; scratch timing)
                p = s.start
                self.input_ids.np[offset] = s.token_ids[0]
                self.positions.np[offset] = p
                self.slot_mapping.np[offset] = s.block_ids[p // bs] * bs + p % bs
            else:
                self.input_ids.np[offset:end] = s.token_ids
                pos = np.arange(s.start, s.start + n)
                self.positions.np[offset:end] = pos
                blocks = np.asarray(s.block_ids, dtype=np.int64)
                self.slot_mapping.np[offset:end] = blocks[pos // bs] * bs + pos % bs
            self.block_table.np[i, : len(s.block_ids)] = s.block_ids
            self.seq_lens.np[i] = seq = s.start + n
            max_seq = max(max_seq, seq)
            self.query_start_loc.np[i + 1] = end
            max_q = max(max_q, n)
            if s.sampling is not None:  # the last token's row, after its drafts' rows when it has some
                rows = 1 + len(s.draft_token_ids)
                if rows == 1:
                    self.logits_indices.np[num_samples] = end - 1
                else:
                    self.logits_indices.np[num_samples:num_samples + rows] = np.arange(end - rows, end)
                num_samples += rows
            offset = end
        self.query_start_loc.np[0] = 0
        return StepShape(offset, num_reqs, max_q, max_seq, num_samples)

    def _drafts_as_rows(self, sched: SchedulerOutput) -> bool:
        """Whether a step of decodes, some with drafts (speculative decoding),
        runs as a uniform decode step: each draft a row of its own."""
        scheduled = sched.scheduled
        return (any(s.draft_token_ids for s in scheduled) and sched.total_tokens <= self.max_num_seqs
                and all(s.num_tokens == 1 + len(s.draft_token_ids) for s in scheduled))

    def _stage_rows(self, sched: SchedulerOutput) -> StepShape:
        """A decode step with drafts, each token a request row of its own: the
        request's block table, its position, and as context the positions up
        to it. That is the causal attention of the request's chunk (the
        step's keys and values are all written before any row attends), and
        the step is then a uniform decode step, which CPU call graphs and
        FULL CUDA graphs replay: at one request of the demo model, a step with
        4 drafts took 27 ms as a chunk against 21 ms for a plain decode step
        (scratch, -O2, 2 cores)."""
        bs = self.block_size
        row = 0
        for s in sched.scheduled:
            for j, token in enumerate(s.token_ids):
                p = s.start + j
                self.input_ids.np[row] = token
                self.positions.np[row] = p
                self.slot_mapping.np[row] = s.block_ids[p // bs] * bs + p % bs
                self.block_table.np[row, : len(s.block_ids)] = s.block_ids
                self.seq_lens.np[row] = p + 1
                row += 1
                self.query_start_loc.np[row] = row
                self.logits_indices.np[row - 1] = row - 1  # every row samples: a decode's token, or a draft's
        self.query_start_loc.np[0] = 0
        max_seq = max(s.start + s.num_tokens for s in sched.scheduled)
        return StepShape(row, row, 1, max_seq, row)

    def pad(self, shape: StepShape, num_tokens: int, num_reqs: int) -> None:
        """Make tokens ``[shape.num_tokens, num_tokens)`` and request rows
        ``[shape.num_reqs, num_reqs)`` inert padding."""
        n, r = shape.num_tokens, shape.num_reqs
        self.input_ids.np[n:num_tokens] = 0
        self.positions.np[n:num_tokens] = 0
        self.slot_mapping.np[n:num_tokens] = -1
        self.query_start_loc.np[r + 1 : num_reqs + 1] = n
        self.seq_lens.np[r:num_reqs] = 0
        self.block_table.np[r:num_reqs] = 0

    def upload(self, shape: StepShape, num_tokens: int, num_reqs: int) -> CommonAttentionMetadata:
        """Move the (padded) step to the device; the metadata every backend reads."""
        self.input_ids.upload(num_tokens)
        self.positions.upload(num_tokens)
        self.logits_indices.upload(shape.num_samples)
        return CommonAttentionMetadata(
            num_actual_tokens=shape.num_tokens,
            num_reqs=num_reqs,
            max_query_len=shape.max_query_len,
            max_seq_len=shape.max_seq_len,
            query_start_loc=self.query_start_loc.upload(num_reqs + 1),
            seq_lens=self.seq_lens.upload(num_reqs),
            block_table=self.block_table.upload(num_reqs),
            slot_mapping=self.slot_mapping.upload(num_tokens),
            query_start_loc_cpu=self.query_start_loc.np[: num_reqs + 1],
            seq_lens_cpu=self.seq_lens.np[:num_reqs],
            block_size=self.block_size,
        )
