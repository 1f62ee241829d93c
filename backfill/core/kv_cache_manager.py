"""KVCacheManager: which KV blocks each request holds."""

from __future__ import annotations

from collections import Counter

from backfill.core.block_pool import BlockPool, NoFreeBlocksError
from backfill.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps each request to its block table: block `i` holds the K/V of token positions
    `i * block_size .. (i + 1) * block_size - 1`.

    Blocks are allocated lazily, a step at a time, to cover exactly the tokens computed so far
    plus the tokens scheduled this step; they are all returned when the request finishes or is
    preempted. The block tables returned are copies: a `SchedulerOutput` holding one stays
    valid after later allocations.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self._block_tables: dict[str, list[int]] = {}  # request_id -> block ids, in position order

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the pool in use, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Blocks to add so the request's table covers its computed tokens plus `num_new_tokens`."""
        num_held = len(self._block_tables.get(request.request_id, ()))
        total = self.num_blocks_for_tokens(request.num_computed_tokens + num_new_tokens)
        return max(total - num_held, 0)

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self.num_blocks_needed(request, num_new_tokens) <= self.num_free_blocks

    def allocate(self, request: Request, num_new_tokens: int) -> list[int]:
        """Grow the request's table to cover `num_new_tokens` more tokens; return a copy of it.

        Raises NoFreeBlocksError, changing nothing, when the pool is short; check
        `can_allocate` first.
        """
        num_needed = self.num_blocks_needed(request, num_new_tokens)
        if num_needed > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"request {request.request_id!r} needs {num_needed} more blocks, "
                f"{self.num_free_blocks} free"
            )
        block_table = self._block_tables.setdefault(request.request_id, [])
        block_table.extend(self.block_pool.allocate(num_needed))
        return list(block_table)

    def free(self, request: Request) -> None:
        """Return all of the request's blocks to the pool; a no-op if it holds none."""
        block_table = self._block_tables.pop(request.request_id, None)
        if block_table:
            # NOTE: tail first, so with prefix caching the end of a sequence (the least likely
            # to be shared) is the first to be evicted.
            self.block_pool.free(block_table[::-1])

    def get_block_ids(self, request_id: str) -> list[int]:
        return list(self._block_tables.get(request_id, ()))

    def check_integrity(self) -> None:
        """Assert free + used == total, each block's ref_cnt equals the number of tables that
        hold it, and no block is owned twice."""
        pool = self.block_pool
        pool.check_integrity()
        holders: Counter[int] = Counter()
        for request_id, block_table in self._block_tables.items():
            assert len(set(block_table)) == len(block_table), f"{request_id!r} holds a block twice"
            holders.update(block_table)
        for block in pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {holders[block.block_id]}"
            )
        # NOTE: without prefix caching no block is shared; relax this when sharing lands.
        shared = [block_id for block_id, count in holders.items() if count > 1]
        assert not shared, f"blocks owned by more than one request: {shared}"
        assert self.num_free_blocks + len(holders) == self.num_blocks, (
            f"free {self.num_free_blocks} + used {len(holders)} != total {self.num_blocks}"
        )
