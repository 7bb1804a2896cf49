"""Prefix caching in the KV cache manager: chained hashes, the hit cap, ref
counts, LRU and lazy eviction, and no block lost or freed twice."""

from __future__ import annotations

import pytest

from kiln.engine.kv_cache_manager import KVCacheManager, hash_block
from kiln.engine.request import Request, SamplingParams

BS = 4


def _req(rid: int, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), cache_salt=salt)


def _run(kv: KVCacheManager, req: Request) -> list[int]:
    """Admit ``req`` as the scheduler does, compute its whole prompt, cache its
    full blocks; returns the block ids it got."""
    prefix = kv.cached_prefix(req)
    assert kv.allocate(req, prefix, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)
    return list(req.block_ids)


def test_hashes_chain_the_parent() -> None:
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, [1, 2, 3, 4])  # stable, not Python's salted hash
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(hash_block(None, [9, 9, 9, 9]), [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4], b"salt") != a


def test_same_block_after_a_different_prefix_is_a_miss() -> None:
    kv = KVCacheManager(16, BS)
    _run(kv, _req(0, [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert kv.cached_prefix(_req(1, [9, 9, 9, 9, 5, 6, 7, 8, 9])) == []
    assert len(kv.cached_prefix(_req(2, [1, 2, 3, 4, 5, 6, 7, 8, 9]))) == 2


def test_the_hit_leaves_one_token_to_compute() -> None:
    kv = KVCacheManager(16, BS)
    _run(kv, _req(0, list(range(1, 9))))  # two full blocks
    same = _req(1, list(range(1, 9)))  # the same 8 tokens: only the first block may hit
    assert len(kv.cached_prefix(same)) == 1
    longer = _req(2, list(range(1, 10)))
    assert len(kv.cached_prefix(longer)) == 2


def test_a_salt_that_differs_gives_no_hit() -> None:
    kv = KVCacheManager(16, BS)
    _run(kv, _req(0, list(range(1, 10)), salt="tenant-a"))
    assert kv.cached_prefix(_req(1, list(range(1, 10)), salt="tenant-b")) == []
    assert kv.cached_prefix(_req(2, list(range(1, 10)))) == []
    assert len(kv.cached_prefix(_req(3, list(range(1, 10)), salt="tenant-a"))) == 2


def test_ref_counts_and_sharing() -> None:
    kv = KVCacheManager(16, BS)
    a = _req(0, list(range(1, 10)))
    b = _req(1, list(range(1, 10)) + [50, 51])
    blocks_a, blocks_b = _run(kv, a), _run(kv, b)
    assert blocks_b[:2] == blocks_a[:2]
    shared = kv.blocks[blocks_a[0]]
    assert shared.ref_cnt == 2
    kv.free(a)
    assert shared.ref_cnt == 1 and kv.num_free == 16 - 3  # a's own third block is free; b keeps its 3
    kv.free(b)
    assert kv.num_free == 16 and all(blk.ref_cnt == 0 for blk in kv.blocks)


def test_freed_blocks_stay_findable_until_reused_lru_first() -> None:
    kv = KVCacheManager(6, BS)
    old = _req(0, [1] * 8 + [2])
    new = _req(1, [3] * 8 + [4])
    old_blocks = _run(kv, old)
    kv.free(old)
    new_blocks = _run(kv, new)
    kv.free(new)
    # lazy eviction: freed, but both chains still hit
    assert len(kv.cached_prefix(_req(2, [1] * 8 + [2]))) == 2
    assert len(kv.cached_prefix(_req(3, [3] * 8 + [4]))) == 2
    # the free queue, front first: blocks without a hash, then the cached ones least
    # recently used first, each request's last block before its first
    queue = list(kv.free_queue)
    unhashed = [b for b in queue if b.hash is None]
    assert queue[: len(unhashed)] == unhashed
    assert [b.block_id for b in queue[len(unhashed):]] == [old_blocks[1], old_blocks[0], new_blocks[1], new_blocks[0]]
    filler = _req(4, list(range(100, 109)))
    assert kv.allocate(filler, [], 9)  # 3 blocks: the 2 unhashed, then old's second (least recent)
    assert [b.block_id for b in kv.cached_prefix(_req(5, [1] * 8 + [2]))] == [old_blocks[0]]
    assert len(kv.cached_prefix(_req(6, [3] * 8 + [4]))) == 2


def test_no_block_is_freed_twice_or_lost() -> None:
    kv = KVCacheManager(8, BS)
    reqs = [_req(i, [i % 2] * 10) for i in range(4)]
    for r in reqs:
        prefix = kv.cached_prefix(r)
        if kv.allocate(r, prefix, r.num_tokens):
            r.num_computed_tokens = r.num_tokens
            kv.cache_full_blocks(r)
    for r in reqs:
        kv.free(r)
        kv.free(r)  # a second free of the same request releases nothing
    assert kv.num_free == 8 and all(b.ref_cnt == 0 for b in kv.blocks)
    assert len({b.block_id for b in kv.free_queue}) == 8


def test_allocation_counts_hits_taken_from_the_free_queue() -> None:
    kv = KVCacheManager(3, BS)
    a = _req(0, [7] * 9)
    _run(kv, a)
    kv.free(a)  # all 3 free; 2 of them cached
    b = _req(1, [7] * 8 + [1, 2, 3, 4, 5])  # hits 2 blocks, needs 2 more: only 1 is really free
    prefix = kv.cached_prefix(b)
    assert len(prefix) == 2 and not kv.allocate(b, prefix, b.num_tokens)
    assert kv.num_free == 3 and all(blk.ref_cnt == 0 for blk in kv.blocks)  # nothing changed
    for _ in range(3):
        kv.free_queue.popleft()
    with pytest.raises(RuntimeError, match="no free KV block"):
        kv.free_queue.popleft()
