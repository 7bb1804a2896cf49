"""The paged KV cache's bookkeeping: which blocks are free."""

from __future__ import annotations

from collections import deque

__all__ = ["BlockPool"]


class BlockPool:
    """A free list over ``num_blocks`` KV-cache blocks of ``block_size`` slots.

    Blocks are handed out and taken back whole; a request owns a list of block ids
    (its block table row) that grows as its sequence does.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of one slot, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """How many blocks hold ``num_tokens`` slots."""
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        # Most recently used blocks go to the back: the front stays cold, which keeps
        # allocation order stable across runs.
        self._free.extend(blocks)

    def grow(self, block_ids: list[int], num_tokens: int) -> bool:
        """Extend ``block_ids`` in place so it holds ``num_tokens`` slots.

        Returns False, allocating nothing, when the pool is short."""
        need = self.blocks_for(num_tokens) - len(block_ids)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        block_ids.extend(self.allocate(need))
        return True
