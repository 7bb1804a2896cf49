"""The runner's input buffers: a scheduled step written into them, the
decodes' one-token path equal to what the step's tokens and blocks say."""

from __future__ import annotations

import torch

from kiln.engine.input_batch import InputBatch
from kiln.engine.request import SamplingParams
from kiln.engine.scheduler import ScheduledRequest, SchedulerOutput

BLOCK_SIZE = 4


def _batch() -> InputBatch:
    return InputBatch(max_num_batched_tokens=32, max_num_seqs=6, max_blocks_per_seq=8, block_size=BLOCK_SIZE,
                      device=torch.device("cpu"))


def _expected(step: list[ScheduledRequest]) -> dict[str, list[int]]:
    """Each buffer's values as the scheduled requests define them."""
    ids, positions, slots, seq_lens, qsl, logits = [], [], [], [], [0], []
    for s in step:
        for t, token in enumerate(s.token_ids):
            p = s.start + t
            ids.append(token)
            positions.append(p)
            slots.append(s.block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
        seq_lens.append(s.start + s.num_tokens)
        qsl.append(qsl[-1] + s.num_tokens)
        if s.sampling is not None:
            logits.append(qsl[-1] - 1)
    return {"input_ids": ids, "positions": positions, "slot_mapping": slots, "seq_lens": seq_lens,
            "query_start_loc": qsl, "logits_indices": logits}


def test_a_mixed_step_is_staged_as_its_requests_say() -> None:
    """Decodes (one token, the plain-int path) around a prefill chunk that
    crosses blocks and does not sample."""
    greedy = SamplingParams(temperature=0)
    step = [
        ScheduledRequest("a", [11], 9, [5, 2, 7], greedy, 3),  # a decode in its third block
        ScheduledRequest("b", [21, 22, 23, 24, 25], 2, [1, 4], None, 0),  # a chunk from block 0 into 1
        ScheduledRequest("c", [31], 0, [6], greedy, 0),  # the first position of a block
        ScheduledRequest("d", [41, 42], 6, [3, 0, 8], greedy, 0),  # a chunk's last two tokens, sampled
    ]
    inputs = _batch()
    shape = inputs.stage(SchedulerOutput(step))
    want = _expected(step)
    assert (shape.num_tokens, shape.num_reqs, shape.max_query_len, shape.max_seq_len, shape.num_samples) == (
        9, 4, 5, 10, 3)
    assert inputs.input_ids.np[:9].tolist() == want["input_ids"]
    assert inputs.positions.np[:9].tolist() == want["positions"]
    assert inputs.slot_mapping.np[:9].tolist() == want["slot_mapping"]
    assert inputs.seq_lens.np[:4].tolist() == want["seq_lens"]
    assert inputs.query_start_loc.np[:5].tolist() == want["query_start_loc"]
    assert inputs.logits_indices.np[:3].tolist() == want["logits_indices"]
    for i, s in enumerate(step):
        assert inputs.block_table.np[i, : len(s.block_ids)].tolist() == s.block_ids


def test_the_device_views_are_made_once_and_follow_the_buffers() -> None:
    """``upload`` hands back the same view for the same size (a step's inputs are
    then the same tensors each step), and each view reads what was staged last."""
    inputs = _batch()
    greedy = SamplingParams(temperature=0)
    first = inputs.upload(inputs.stage(SchedulerOutput([ScheduledRequest("a", [7], 4, [2, 3], greedy, 0)])), 1, 1)
    second = inputs.upload(inputs.stage(SchedulerOutput([ScheduledRequest("a", [8], 5, [2, 3], greedy, 1)])), 1, 1)
    assert second.seq_lens is first.seq_lens and second.block_table is first.block_table
    assert second.slot_mapping is first.slot_mapping
    assert first.seq_lens.tolist() == [6] and first.slot_mapping.tolist() == [3 * BLOCK_SIZE + 1]
    assert inputs.input_ids.view(1).tolist() == [8]
    assert inputs.upload(inputs.stage(SchedulerOutput([])), 2, 2).seq_lens is not first.seq_lens


def test_decodes_with_drafts_are_staged_as_one_row_a_token() -> None:
    """A decode step whose requests carry drafts (speculative decoding) runs as
    a uniform decode step: each token a row with its request's blocks and the
    positions up to it as context; every row samples. With a prefill chunk in
    the step, or more tokens than request rows, the drafts stay a chunk."""
    greedy = SamplingParams(temperature=0)
    step = [ScheduledRequest("a", [11, 12, 13], 7, [5, 2, 7], greedy, 3, draft_token_ids=(12, 13)),
            ScheduledRequest("b", [21], 2, [1], greedy, 0)]
    inputs = _batch()
    shape = inputs.stage(SchedulerOutput(step))
    assert (shape.num_tokens, shape.num_reqs, shape.max_query_len, shape.max_seq_len, shape.num_samples) == (
        4, 4, 1, 10, 4)
    assert shape.uniform_decode
    assert inputs.input_ids.np[:4].tolist() == [11, 12, 13, 21]
    assert inputs.positions.np[:4].tolist() == [7, 8, 9, 2]
    assert inputs.seq_lens.np[:4].tolist() == [8, 9, 10, 3]
    assert inputs.slot_mapping.np[:4].tolist() == [2 * 4 + 3, 7 * 4 + 0, 7 * 4 + 1, 1 * 4 + 2]
    assert inputs.query_start_loc.np[:5].tolist() == [0, 1, 2, 3, 4]
    assert inputs.logits_indices.np[:4].tolist() == [0, 1, 2, 3]
    for row, blocks in enumerate([[5, 2, 7]] * 3 + [[1]]):
        assert inputs.block_table.np[row, : len(blocks)].tolist() == blocks
    chunked = [*step, ScheduledRequest("c", [31, 32, 33], 0, [6], greedy, 0)]  # a prompt: the drafts stay a chunk
    shape = inputs.stage(SchedulerOutput(chunked))
    assert (shape.num_reqs, shape.max_query_len, shape.num_samples) == (3, 3, 5)
    assert inputs.logits_indices.np[:5].tolist() == [0, 1, 2, 3, 6]
