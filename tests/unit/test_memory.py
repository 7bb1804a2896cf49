"""Host memory for the KV cache and the weights (kiln/models/memory.py)."""

from __future__ import annotations

import torch

from kiln.models.memory import zeroed_host_memory


def test_zeroed_memory_reads_zero_and_is_writable() -> None:
    memory = zeroed_host_memory(3 << 20)
    assert memory.shape == (3 << 20,) and memory.dtype == torch.uint8
    assert int(memory.count_nonzero()) == 0
    memory[123] = 7
    assert int(memory.sum()) == 7
    assert zeroed_host_memory(10).tolist() == [0] * 10
