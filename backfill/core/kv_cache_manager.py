"""KVCacheManager: which KV blocks each request holds, and the prefix cache lookups."""

from __future__ import annotations

from collections import Counter

from backfill.core.block_pool import BlockHash, BlockPool, NoFreeBlocksError, hash_block_tokens
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

    Prefix caching (`enable_prefix_caching`): once a step has computed a full block, the block
    is registered under a hash chained from its parent block's (`cache_computed_blocks`); a
    request being admitted starts its table with the longest run of registered blocks that
    match its tokens (`find_cached_blocks`, `take_cached_blocks`), sharing them read-only.
    ```
    tokens  | b0 full | b1 full | b2 full | b3 partial |
    cached  |  hit    |  hit    |  miss   |            |   -> num_computed_tokens = 2 * block_size
    ```
    NOTE: hits are whole blocks and stop before the last token, so a request never writes
    into a shared block, and its last token is always computed (its logits are sampled).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        self._block_tables: dict[str, list[int]] = {}  # request_id -> block ids, in position order
        self._block_hashes: dict[str, list[BlockHash]] = {}  # request_id -> hashes of its full blocks so far
        self._num_cached_blocks: dict[str, int] = {}  # request_id -> leading blocks registered or hit

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached ones included (they are evicted on demand)."""
        return self.block_pool.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a reusable prefix."""
        return self.block_pool.num_cached_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests, in [0, 1] (cached free blocks not counted)."""
        return self.num_used_blocks / self.num_blocks

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ------------------------------------------------------------ prefix cache

    def find_cached_blocks(self, request: Request) -> list[int]:
        """The longest run of cached blocks matching the request's leading full blocks, capped
        so at least its last token remains to compute. Changes nothing but memoized hashes.
        None for a request that wants its prompt's logprobs: every position must be computed."""
        if not self.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return []
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        block_hashes = self._hashes(request, max_num_blocks)
        block_ids: list[int] = []
        for block_hash in block_hashes[:max_num_blocks]:
            block_id = self.block_pool.get_cached_block(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def take_cached_blocks(self, request: Request, cached_block_ids: list[int]) -> None:
        """Start the table of a request that holds no blocks with `cached_block_ids` (from
        `find_cached_blocks` in the same step); the caller sets its computed tokens to match."""
        assert not self._block_tables.get(request.request_id), f"{request.request_id!r} already holds blocks"
        self.block_pool.touch(cached_block_ids)
        self._block_tables[request.request_id] = list(cached_block_ids)
        self._num_cached_blocks[request.request_id] = len(cached_block_ids)

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's blocks that its computed tokens have filled since the last
        call. Call after a step's K/V are written (never at schedule time: a request scheduled
        and then preempted in the same step would leave registered blocks holding nothing)."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        block_table = self._block_tables[request.request_id]
        block_hashes = self._hashes(request, num_full)
        for index in range(start, num_full):
            self.block_pool.cache_block(block_table[index], block_hashes[index])
        self._num_cached_blocks[request.request_id] = num_full

    def _hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The request's first `num_blocks` full-block hashes (memoized until `free`)."""
        block_hashes = self._block_hashes.setdefault(request.request_id, [])
        size, num_prompt = self.block_size, request.num_prompt_tokens
        for index in range(len(block_hashes), num_blocks):
            start, end = index * size, (index + 1) * size
            token_ids = request.prompt_token_ids[start:end] + request.output_token_ids[
                max(start - num_prompt, 0) : max(end - num_prompt, 0)
            ]
            block_hashes.append(hash_block_tokens(block_hashes[-1] if block_hashes else None, token_ids))
        return block_hashes

    # -------------------------------------------------------------- allocation

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Blocks to add so the request's table covers its computed tokens plus `num_new_tokens`."""
        num_held = len(self._block_tables.get(request.request_id, ()))
        total = self.num_blocks_for_tokens(request.num_computed_tokens + num_new_tokens)
        return max(total - num_held, 0)

    def can_allocate(self, request: Request, num_new_tokens: int, cached_block_ids: list[int] | None = None) -> bool:
        """Whether `allocate` would succeed; with `cached_block_ids`, after `take_cached_blocks`
        (the free ones among them leave the free queue, the rest are held already)."""
        if not cached_block_ids:
            return self.num_blocks_needed(request, num_new_tokens) <= self.num_free_blocks
        total = self.num_blocks_for_tokens(request.num_computed_tokens + num_new_tokens)
        num_cached_free = sum(1 for block_id in cached_block_ids if self.block_pool.blocks[block_id].ref_cnt == 0)
        return max(total - len(cached_block_ids), 0) <= self.num_free_blocks - num_cached_free

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
        """Return all of the request's blocks to the pool (cached ones stay reusable until
        evicted); a no-op if it holds none."""
        block_table = self._block_tables.pop(request.request_id, None)
        self._block_hashes.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if block_table:
            # NOTE: tail first, so the end of a sequence (the least likely to be shared) is
            # evicted before its prefix.
            self.block_pool.free(block_table[::-1])

    def get_block_ids(self, request_id: str) -> list[int]:
        return list(self._block_tables.get(request_id, ()))

    def check_integrity(self) -> None:
        """Assert free + used == total, each block's ref_cnt equals the number of tables that
        hold it, only cached blocks are shared, and the hash map agrees with the blocks."""
        pool = self.block_pool
        pool.check_integrity()
        holders: Counter[int] = Counter()
        for request_id, block_table in self._block_tables.items():
            assert len(set(block_table)) == len(block_table), f"{request_id!r} holds a block twice"
            holders.update(block_table)
            num_cached = self._num_cached_blocks.get(request_id, 0)
            assert num_cached <= len(block_table), f"{request_id!r}: {num_cached} cached of {len(block_table)}"
        for block in pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {holders[block.block_id]}"
            )
        shared = [block_id for block_id, count in holders.items() if count > 1]
        assert all(pool.blocks[block_id].block_hash is not None for block_id in shared), (
            f"blocks shared without being cached: {shared}"
        )
        if not self.enable_prefix_caching:
            assert not shared and pool.num_cached_free_blocks == 0, "sharing with prefix caching off"
        assert self.num_free_blocks + len(holders) == self.num_blocks, (
            f"free {self.num_free_blocks} + used {len(holders)} != total {self.num_blocks}"
        )
