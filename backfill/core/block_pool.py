"""BlockPool: the physical KV blocks, their reference counts, the free queue and the prefix
cache (block hash -> block).

Pure bookkeeping: a block is an index into the model runner's KV tensors
(`[num_blocks, block_size, num_kv_heads, head_dim]` per layer); nothing here touches them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

BlockHash = bytes  # 32 bytes of sha256

_NO_PARENT = bytes(32)


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """The prefix-cache key of one full block: sha256 over its parent's key, `extra` (anything
    else that changes the block's K/V; nothing today) and its token ids.

    NOTE: a cryptographic hash, not Python's `hash()`: a client must not be able to craft a
    prompt whose blocks collide with another client's and so read that client's K/V. Every
    field has a fixed width or a length prefix, so two different inputs never serialize alike.
    """
    digest = hashlib.sha256(parent_hash if parent_hash is not None else _NO_PARENT)
    digest.update(len(extra).to_bytes(8, "little"))
    digest.update(extra)
    digest.update(b"".join(token_id.to_bytes(8, "little", signed=True) for token_id in token_ids))
    return digest.digest()


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0  # number of requests whose block table holds this block
    # Set once the block is full and its K/V computed (`cache_block`): a later request with the
    # same prefix may then share it. Kept while the block is free, until it is evicted.
    block_hash: BlockHash | None = None


class BlockPool:
    """Owns every block's reference count, the queue of free blocks and the prefix cache.

    Invariants: a block is in the free queue exactly once iff its `ref_cnt` is 0; a block has
    a `block_hash` iff the cache maps that hash to it. Blocks leave the free queue from the
    head. A freed block that holds a cached prefix returns to the tail, so the least recently
    used one is evicted first and stays reusable (`touch`) until then; a freed block with no
    prefix returns to the head, so it is reused before any cached block is evicted.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks: list[Block] = [Block(block_id=i) for i in range(num_blocks)]
        # NOTE: an OrderedDict used as a queue: O(1) removal from the middle when a cached
        # free block is reused.
        self._free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached_block_ids: dict[BlockHash, int] = {}
        self.num_cached_free_blocks = 0  # free blocks that still hold a cached prefix

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (ref_cnt 1 each, no hash), evicting the least recently used.
        Raises NoFreeBlocksError, changing nothing, if fewer than `n` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free_block_ids):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free_block_ids)} free")
        block_ids = [self._free_block_ids.popitem(last=False)[0] for _ in range(n)]
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt == 0, f"free block {block_id} has ref_cnt {block.ref_cnt}"
            block.ref_cnt = 1
            if block.block_hash is not None:  # evict
                del self._cached_block_ids[block.block_hash]
                block.block_hash = None
                self.num_cached_free_blocks -= 1
        return block_ids

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        """The block holding the prefix with this hash, or None."""
        return self._cached_block_ids.get(block_hash)

    def touch(self, block_ids: list[int]) -> None:
        """Add one holder to cached blocks, taking the free ones out of the free queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.block_hash is not None, f"touch of uncached block {block_id}"
            if block.ref_cnt == 0:
                del self._free_block_ids[block_id]
                self.num_cached_free_blocks -= 1
            block.ref_cnt += 1

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a held, full, computed block under `block_hash`. False (and no change) when
        another block already holds that prefix (two requests computed it in the same step)."""
        block = self.blocks[block_id]
        assert block.ref_cnt > 0 and block.block_hash is None, f"cannot cache block {block_id}"
        if block_hash in self._cached_block_ids:
            return False
        self._cached_block_ids[block_hash] = block_id
        block.block_hash = block_hash
        return True

    def incref(self, block_ids: list[int]) -> None:
        """Add one holder to blocks already in use (a shared prefix)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, f"incref of free block {block_id}"
            block.ref_cnt += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one holder from each block. A block whose last holder leaves becomes free: if it
        holds a cached prefix, as the most recently used free block (evicted last); if not, at
        the head of the queue, to be reused before any cached block is evicted."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, f"double free of block {block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_block_ids[block_id] = None
                if block.block_hash is not None:
                    self.num_cached_free_blocks += 1
                else:
                    # NOTE: a block with no hash (a partial last block, or any block with
                    # caching off) holds nothing a later request can reuse: giving it out
                    # first keeps every cached prefix one allocation longer.
                    self._free_block_ids.move_to_end(block_id, last=False)

    def check_integrity(self) -> None:
        """Assert the free queue holds exactly the blocks with ref_cnt 0, and the cache maps
        each hash to the one block that carries it."""
        free_ids = set(self._free_block_ids)
        zero_ref_ids = {block.block_id for block in self.blocks if block.ref_cnt == 0}
        assert free_ids == zero_ref_ids, (
            f"free queue {sorted(free_ids)} != blocks with ref_cnt 0 {sorted(zero_ref_ids)}"
        )
        assert all(block.ref_cnt >= 0 for block in self.blocks), "negative ref_cnt"
        hashed = {block.block_hash: block.block_id for block in self.blocks if block.block_hash is not None}
        assert len(hashed) == sum(block.block_hash is not None for block in self.blocks), "two blocks share a hash"
        assert hashed == self._cached_block_ids, "the hash map disagrees with the blocks' hashes"
        num_cached_free = sum(1 for block_id in free_ids if self.blocks[block_id].block_hash is not None)
        assert num_cached_free == self.num_cached_free_blocks, (
            f"{num_cached_free} cached free blocks, counted {self.num_cached_free_blocks}"
        )
