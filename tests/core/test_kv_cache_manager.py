"""KVCacheManager: lazy block growth, copies of block tables, free, integrity."""

from __future__ import annotations

import pytest

from backfill.core.block_pool import NoFreeBlocksError
from backfill.core.kv_cache_manager import KVCacheManager
from tests.core.core_factories import make_request


def test_blocks_needed_grows_with_computed_plus_new_tokens() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    request = make_request("a", prompt_len=10)
    assert kv.num_blocks_needed(request, 10) == 3
    assert kv.num_blocks_needed(request, 4) == 1
    table = kv.allocate(request, 4)
    assert len(table) == 1
    request.num_computed_tokens = 4
    assert kv.num_blocks_needed(request, 4) == 1  # positions 4..7: one more block
    assert kv.num_blocks_needed(request, 0) == 0
    table = kv.allocate(request, 6)  # up to position 9: three blocks in all
    assert len(table) == 3 and kv.get_block_ids("a") == table
    assert kv.num_used_blocks == 3 and kv.num_free_blocks == 7 and kv.usage == pytest.approx(0.3)
    kv.check_integrity()


def test_block_table_grows_by_appending_and_returns_copies() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=2)
    request = make_request("a", prompt_len=3)
    first = kv.allocate(request, 3)
    request.num_computed_tokens = 3
    second = kv.allocate(request, 1)  # position 3 still fits in block 1
    assert second == first
    request.num_computed_tokens = 4
    third = kv.allocate(request, 1)
    assert third[:2] == first and len(third) == 3
    assert len(first) == 2  # the earlier table was not mutated


def test_allocate_raises_when_short_and_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a, b = make_request("a", prompt_len=8), make_request("b", prompt_len=8)
    kv.allocate(a, 8)
    assert not kv.can_allocate(b, 8) and kv.can_allocate(b, 4)
    with pytest.raises(NoFreeBlocksError):
        kv.allocate(b, 8)
    assert kv.get_block_ids("b") == [] and kv.num_free_blocks == 1
    kv.check_integrity()


def test_free_returns_every_block_and_is_idempotent() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a, b = make_request("a", prompt_len=9), make_request("b", prompt_len=5)
    kv.allocate(a, 9)
    kv.allocate(b, 5)
    assert kv.num_used_blocks == 5
    kv.free(a)
    kv.free(a)
    assert kv.num_used_blocks == 2 and kv.get_block_ids("a") == []
    kv.check_integrity()
    kv.free(b)
    assert kv.num_free_blocks == kv.num_blocks == 6
    kv.check_integrity()


def test_check_integrity_detects_a_block_owned_twice() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.allocate(make_request("a"), 4)
    kv.allocate(make_request("b"), 4)
    kv._block_tables["b"] = kv.get_block_ids("a")  # corrupt: b now claims a's block
    with pytest.raises(AssertionError):
        kv.check_integrity()


def test_check_integrity_detects_a_leaked_block() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.allocate(make_request("a"), 4)
    del kv._block_tables["a"]  # corrupt: the block is in use but nobody holds it
    with pytest.raises(AssertionError):
        kv.check_integrity()
