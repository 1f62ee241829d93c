"""BlockPool: allocation, reference counts, free queue order, integrity checks."""

from __future__ import annotations

import pytest

from backfill.core.block_pool import BlockPool, NoFreeBlocksError, hash_block_tokens


def test_allocate_and_free_round_trip() -> None:
    pool = BlockPool(8)
    assert pool.num_blocks == 8 and pool.num_free_blocks == 8
    first = pool.allocate(3)
    second = pool.allocate(5)
    assert len(set(first + second)) == 8 and pool.num_free_blocks == 0
    assert all(pool.blocks[b].ref_cnt == 1 for b in first + second)
    pool.check_integrity()
    pool.free(first)
    assert pool.num_free_blocks == 3
    pool.check_integrity()
    pool.free(second)
    assert pool.num_free_blocks == 8
    pool.check_integrity()


def test_allocate_too_many_raises_and_changes_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    pool.check_integrity()
    with pytest.raises(ValueError):
        pool.allocate(-1)
    assert pool.allocate(0) == []


def test_freed_cached_blocks_are_reused_last() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    for i, block_id in enumerate(a):
        assert pool.cache_block(block_id, hash_block_tokens(None, [i]))
    pool.free(a)
    # The two never-used blocks come out before the two cached ones just freed.
    assert pool.allocate(4) == [2, 3, *a]


def test_freed_uncached_blocks_are_reused_before_any_cached_block_is_evicted() -> None:
    pool = BlockPool(4)
    cached, partial = pool.allocate(1), pool.allocate(1)  # [0], [1]; 2 and 3 never used
    assert pool.cache_block(cached[0], hash_block_tokens(None, [7]))
    pool.free(cached)
    pool.free(partial)  # freed last, but it holds no prefix: it goes out first
    assert pool.allocate(2) == [*partial, 2]
    assert pool.num_cached_free_blocks == 1
    assert pool.get_cached_block(hash_block_tokens(None, [7])) == cached[0]
    pool.check_integrity()
    assert pool.allocate(2) == [3, *cached] and pool.num_cached_free_blocks == 0
    pool.check_integrity()


def test_shared_block_is_free_only_after_last_holder() -> None:
    pool = BlockPool(2)
    (block_id,) = pool.allocate(1)
    pool.incref([block_id])
    assert pool.blocks[block_id].ref_cnt == 2
    pool.free([block_id])
    assert pool.num_free_blocks == 1
    pool.free([block_id])
    assert pool.num_free_blocks == 2
    pool.check_integrity()


def test_double_free_and_incref_of_free_block_are_caught() -> None:
    pool = BlockPool(2)
    block_ids = pool.allocate(1)
    pool.free(block_ids)
    with pytest.raises(AssertionError):
        pool.free(block_ids)
    with pytest.raises(AssertionError):
        pool.incref([1])


def test_check_integrity_detects_corruption() -> None:
    pool = BlockPool(3)
    pool.allocate(1)
    pool.blocks[0].ref_cnt = 0  # leaked: ref_cnt 0 but not in the free queue
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_rejects_empty_pool() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)
