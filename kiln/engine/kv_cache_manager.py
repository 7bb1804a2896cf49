"""The paged KV cache's blocks: who owns which, and which full blocks can be
shared across requests (automatic prefix caching).

Each full block of a request is named by a chained hash: sha256 over the parent
block's hash, the block's token ids and the request's extra keys (its cache
salt), so a block's name depends on everything before it and is the same in
every process. A hash -> block map finds them. Blocks carry a reference count;
blocks nobody references sit in a free queue, a doubly linked list with O(1)
removal from the middle. Freed blocks keep their hash and stay findable until
the queue hands them out again (lazy eviction), least recently used first;
blocks without a hash go to the front, to be reused before any cached one.

A waiting request first looks up its prefix: the chain of its full prompt
blocks is walked from the first block and stops at the first miss, capped so
that at least one prompt token is computed (its logits pick the next token).
Blocks become cached as they fill, during prefill and decode.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from kiln.engine.request import Request

__all__ = ["Block", "FreeBlockQueue", "KVCacheManager", "hash_block"]


class Block:
    __slots__ = ("block_id", "ref_cnt", "hash", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.hash: bytes | None = None
        self.prev: Block | None = None
        self.next: Block | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, hashed={self.hash is not None})"


class FreeBlockQueue:
    """Blocks nobody references, front (evicted first) to back, with O(1)
    removal of any block (a cache hit takes a block out of the middle)."""

    def __init__(self, blocks: list[Block]) -> None:
        self.head, self.tail = Block(-1), Block(-1)  # sentinels
        self.head.next, self.tail.prev = self.tail, self.head
        self.size = 0
        for b in blocks:
            self.append(b)

    def _insert(self, block: Block, after: Block) -> None:
        block.prev, block.next = after, after.next
        after.next.prev = block  # type: ignore[union-attr]
        after.next = block
        self.size += 1

    def append(self, block: Block) -> None:
        self._insert(block, self.tail.prev)  # type: ignore[arg-type]

    def appendleft(self, block: Block) -> None:
        self._insert(block, self.head)

    def remove(self, block: Block) -> None:
        block.prev.next, block.next.prev = block.next, block.prev  # type: ignore[union-attr]
        block.prev = block.next = None
        self.size -= 1

    def popleft(self) -> Block:
        if self.size == 0:
            raise RuntimeError("no free KV block")
        block = self.head.next
        self.remove(block)  # type: ignore[arg-type]
        return block  # type: ignore[return-value]

    def __iter__(self):  # noqa: ANN204  (front to back; for tests and stats)
        b = self.head.next
        while b is not self.tail:
            yield b
            b = b.next  # type: ignore[union-attr]


def hash_block(parent: bytes | None, token_ids: list[int], extra: bytes = b"") -> bytes:
    """The name of a full block: stable across processes (sha256, no Python hash)."""
    h = hashlib.sha256(parent or b"\0" * 32)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(extra)
    return h.digest()


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found cached


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of one slot, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, Block] = {}
        self.stats = PrefixCacheStats()
        # request id -> its blocks, in order (the request's block_ids mirror them)
        self._owned: dict[object, list[Block]] = {}

    @property
    def num_free(self) -> int:
        return self.free_queue.size

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ hashing
    def _extend_hashes(self, req: Request, num_tokens: int) -> None:
        """Hash the request's full blocks within its first ``num_tokens`` tokens."""
        salt = (req.cache_salt or "").encode()
        bs = self.block_size
        for i in range(len(req.block_hashes), num_tokens // bs):
            parent = req.block_hashes[-1] if req.block_hashes else None
            req.block_hashes.append(hash_block(parent, req.tokens(i * bs, (i + 1) * bs), salt))

    # ------------------------------------------------------------------ lookup and allocation
    def cached_prefix(self, req: Request) -> list[Block]:
        """The cached blocks that start the request's tokens, leaving at least
        one token to compute; counted in the prefix-cache stats."""
        if not self.enable_caching:
            return []
        limit = (req.num_tokens - 1) // self.block_size
        self._extend_hashes(req, limit * self.block_size)
        hit = []
        for h in req.block_hashes[:limit]:
            block = self.cached.get(h)
            if block is None:
                break
            hit.append(block)
        self.stats.queries += req.num_tokens
        self.stats.hits += len(hit) * self.block_size
        return hit

    def allocate(self, req: Request, prefix: list[Block], num_tokens: int) -> bool:
        """Give a request with no blocks ``prefix`` (shared) and new blocks up to
        ``num_tokens`` slots; False, changing nothing, when they do not fit."""
        new = self.blocks_for(num_tokens) - len(prefix)
        reclaimable = sum(1 for b in prefix if b.ref_cnt == 0)  # hits taken out of the free queue
        if new > self.num_free - reclaimable:
            return False
        for b in prefix:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1
        blocks = prefix + [self._take() for _ in range(max(0, new))]
        self._owned[req.request_id] = blocks
        req.block_ids = [b.block_id for b in blocks]
        return True

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Extend a running request's blocks to hold ``num_tokens`` slots; False,
        allocating nothing, when the cache is short."""
        blocks = self._owned.setdefault(req.request_id, [])
        need = self.blocks_for(num_tokens) - len(blocks)
        if need > self.num_free:
            return False
        for _ in range(need):
            block = self._take()
            blocks.append(block)
            req.block_ids.append(block.block_id)
        return True

    def _take(self) -> Block:
        block = self.free_queue.popleft()
        if block.hash is not None:  # lazy eviction: forget it only now
            if self.cached.get(block.hash) is block:
                del self.cached[block.hash]
            block.hash = None
        block.ref_cnt = 1
        return block

    def cache_full_blocks(self, req: Request) -> None:
        """Name the request's blocks that are full of computed tokens, so later
        requests (and this one, after a preemption) can find them."""
        if not self.enable_caching:
            return
        full = req.num_computed_tokens // self.block_size
        self._extend_hashes(req, full * self.block_size)
        blocks = self._owned.get(req.request_id, [])
        for block, h in zip(blocks[:full], req.block_hashes[:full]):
            if block.hash is None:
                block.hash = h
                self.cached.setdefault(h, block)

    def free(self, req: Request) -> None:
        """Release the request's blocks, last first: cached ones go to the back
        of the free queue (still findable), the others to the front."""
        for block in reversed(self._owned.pop(req.request_id, [])):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.hash is not None:
                    self.free_queue.append(block)
                else:
                    self.free_queue.appendleft(block)
        req.block_ids = []
