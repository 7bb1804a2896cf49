"""Host memory for the KV cache and the weights (kiln/models/memory.py)."""

from __future__ import annotations

import errno

import torch

from kiln.models.memory import zeroed_host_memory


def test_zeroed_memory_reads_zero_and_is_writable() -> None:
    memory = zeroed_host_memory(3 << 20)
    assert memory.shape == (3 << 20,) and memory.dtype == torch.uint8
    assert int(memory.count_nonzero()) == 0
    memory[123] = 7
    assert int(memory.sum()) == 7
    assert zeroed_host_memory(10).tolist() == [0] * 10


def _huge_kb(address: int) -> int | None:
    """AnonHugePages of the mapping holding ``address`` (None off Linux)."""
    import re

    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    inside, total = False, 0
    for line in lines:
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) <= address < int(m.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


def test_the_weights_block_moves_into_huge_pages_with_its_values() -> None:
    import os
    import platform

    from torch import nn

    from kiln.models.memory import collapse_to_huge_pages, materialize

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 1024))  # 16 MiB of fp32
    model = materialize(model, torch.device("cpu"), torch.float32)
    params = list(model.parameters())
    assert len({p.untyped_storage().data_ptr() for p in params}) == 1  # one block
    for i, p in enumerate(params):
        p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    before = [p.clone() for p in params]
    thread = collapse_to_huge_pages(model)
    assert thread is not None and thread.name == "kiln-huge-pages"
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    release = tuple(int(x) for x in platform.release().split(".")[:2] if x.isdigit())
    enabled = open("/sys/kernel/mm/transparent_hugepage/enabled").read() if os.path.exists(
        "/sys/kernel/mm/transparent_hugepage/enabled") else "[never]"
    if release >= (6, 1) and "[never]" not in enabled:  # MADV_COLLAPSE's kernels
        # the kernel makes huge pages when it has them: the thread says whether it did
        assert thread.errno in (0, errno.EAGAIN, errno.ENOMEM, errno.EBUSY)
        if thread.errno == 0:
            assert _huge_kb(params[0].data_ptr()) >= 2048


def test_no_thread_for_parameters_outside_one_block() -> None:
    from torch import nn

    from kiln.models.memory import collapse_to_huge_pages

    assert collapse_to_huge_pages(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))) is None  # separate tensors
    assert collapse_to_huge_pages(nn.Sequential()) is None
