"""Host memory for the model: its parameters in one block, moved into
transparent huge pages after loading, and zeroed memory that costs nothing
until touched (the KV cache).

A CPU decode step streams every weight from memory, 540 MB a token for
SmolLM2-135M in fp32. In 4 KiB pages that is some 135,000 TLB entries a step; in
2 MiB pages 512 times fewer, and reading them is faster (18.9 against 17.7 GB/s
here; decode 48.7 against 45.5 tok/s in a scratch run). Faulting fresh huge
pages in at load cost more and varied with the machine (0.61-1.71 s against
0.39-0.58 s for 540 MB: zeroing and compacting 2 MiB pages,
bench/results/huge-pages-cpu-20261201-095344.json), and that was most of a warm
start. So the weights load into ordinary pages, and a thread at the lowest
priority then asks the kernel to collapse them into huge pages
(``MADV_COLLAPSE``, Linux 6.1+: 1.5 s for 540 MB here) while the engine
serves. On an older kernel the block is only advised (``MADV_HUGEPAGE``), for
the kernel's own collapsing thread. On a GPU the parameters are ordinary
allocations.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import logging
import mmap
import os
import threading
import time

import torch
from torch import nn

__all__ = ["collapse_to_huge_pages", "lowest_priority", "materialize", "zeroed_host_memory"]

logger = logging.getLogger(__name__)

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h
_MADV_COLLAPSE = 25  # Linux 6.1+: make huge pages of these pages now
_COLLAPSE_CHUNK = 32 << 20  # one madvise call: the engine's page faults wait for at most this much
_ALIGN = 64  # every parameter starts on a cache line


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name, use_errno=True) if name else None
    except OSError:
        return None


def _madvise(address: int, length: int, advice: int) -> int:
    """0, or the errno of ``madvise`` (-1 without libc)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "madvise"):
        return -1
    if libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), advice) == 0:
        return 0
    return ctypes.get_errno()


def lowest_priority() -> None:
    """The calling thread (and the OpenMP threads it starts) at the lowest CPU
    priority, where Linux lets a thread have its own: the engine's steps win
    the cores from background work."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not allowed: the same work at the same priority
        pass


def collapse_to_huge_pages(model: nn.Module) -> threading.Thread | None:
    """Start moving the parameters' block (``materialize``) into huge pages, in
    a thread at the lowest priority, 32 MiB a call; the thread, or None where
    there is nothing to do (not CPU, no block). The values do not change."""
    params = list(model.parameters())
    if not params or params[0].device.type != "cpu":
        return None
    storage = params[0].untyped_storage()
    if any(p.untyped_storage().data_ptr() != storage.data_ptr() for p in params):
        return None  # not one block: parameters replaced after materialize
    start = storage.data_ptr() + (-storage.data_ptr() % _HUGE_PAGE)
    end = storage.data_ptr() + storage.nbytes()
    length = (end - start) // _HUGE_PAGE * _HUGE_PAGE
    if length <= 0:
        return None

    def run() -> None:
        lowest_priority()
        for offset in range(0, length, _COLLAPSE_CHUNK):
            error = _collapse(start + offset, min(_COLLAPSE_CHUNK, length - offset))
            if error:  # an older kernel (EINVAL), or no huge page to be had: leave it to khugepaged
                logger.debug("madvise(MADV_COLLAPSE) failed: errno %d; advising MADV_HUGEPAGE", error)
                _madvise(start, length, _MADV_HUGEPAGE)
                thread.errno = error  # type: ignore[attr-defined]
                return
        thread.errno = 0  # type: ignore[attr-defined]

    # a daemon: collapsing changes no value, and an exit need not wait for it. ``errno``: the collapse's
    # outcome once the thread ends (0: every chunk in huge pages), None before
    thread = threading.Thread(target=run, name="kiln-huge-pages", daemon=True)
    thread.errno = None  # type: ignore[attr-defined]
    thread.start()
    return thread


def _collapse(address: int, length: int, tries: int = 3) -> int:
    """``madvise(MADV_COLLAPSE)``, again after a transient failure (EAGAIN: the
    kernel could not take the pages' locks or a huge page at that moment, as
    under another process's allocations); 0 or the last errno."""
    for attempt in range(tries):
        error = _madvise(address, length, _MADV_COLLAPSE)
        if error != errno.EAGAIN:
            return error
        time.sleep(0.05 * (attempt + 1))
    return error


def zeroed_host_memory(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeroed CPU memory that costs nothing until touched: an
    anonymous mapping, whose pages the kernel hands out zero-filled on first
    write. ``torch.zeros`` would write every byte up front (seconds for
    gigabytes); ``torch.empty`` may return a reused heap block holding garbage,
    NaN bit patterns included."""
    region = mmap.mmap(-1, max(nbytes, 1))
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes)  # the tensor keeps the mapping alive


def _huge_page_block(nbytes: int) -> torch.Tensor:
    """``nbytes`` of uninitialised CPU memory starting on a huge page boundary."""
    raw = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % _HUGE_PAGE
    return raw[start: start + nbytes]


def materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Give a model built on the meta device real, uninitialised parameters in
    ``dtype`` (floating point ones; others keep theirs) on ``device``, and its
    buffers storage there. Nothing is copied or initialised."""
    if device.type != "cpu":
        model = model.to_empty(device=device)
        cast: dict[int, nn.Parameter] = {}  # shared parameters stay shared
        for module in model.modules():  # parameters only: packed weights and fp32 tables keep their dtype
            for name, p in module._parameters.items():
                if p is not None and p.is_floating_point():
                    if id(p) not in cast:
                        cast[id(p)] = nn.Parameter(p.to(dtype), requires_grad=False)
                    module._parameters[name] = cast[id(p)]
        return model
    params = list(model.parameters())  # each shared parameter once
    kinds = [dtype if p.is_floating_point() else p.dtype for p in params]
    sizes = [p.numel() * torch.empty((), dtype=k).element_size() for p, k in zip(params, kinds)]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // _ALIGN) * _ALIGN
    block = _huge_page_block(max(total, 1))
    placed = {id(p): nn.Parameter(block[offset: offset + size].view(kind).view(p.shape), requires_grad=False)
              for p, kind, size, offset in zip(params, kinds, sizes, offsets)}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = placed[id(p)]
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = torch.empty(buf.shape, dtype=buf.dtype, device=device)
    return model
