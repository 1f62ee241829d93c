"""BlockPool: the physical KV blocks, their reference counts and the free queue.

Pure bookkeeping: a block is an index into the model runner's KV tensors
(`[num_blocks, block_size, num_kv_heads, head_dim]` per layer); nothing here touches them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0  # number of requests whose block table holds this block
    # NOTE: room for prefix caching: a full block's content hash, so a later request with the
    # same prefix can share the block (ref_cnt > 1). Unused until prefix caching lands.
    block_hash: int | None = None


class BlockPool:
    """Owns every block's reference count and the queue of free blocks.

    Invariant: a block is in the free queue exactly once iff its `ref_cnt` is 0.
    Blocks leave the free queue from the head and return to the tail, so the longest-free block
    is reused first (what an LRU prefix cache will want).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks: list[Block] = [Block(block_id=i) for i in range(num_blocks)]
        self._free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (ref_cnt 1 each). Raises NoFreeBlocksError, changing nothing,
        if fewer than `n` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free_block_ids):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free_block_ids)} free")
        block_ids = [self._free_block_ids.popleft() for _ in range(n)]
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt == 0, f"free block {block_id} has ref_cnt {block.ref_cnt}"
            block.ref_cnt = 1
            block.block_hash = None
        return block_ids

    def incref(self, block_ids: list[int]) -> None:
        """Add one holder to blocks already in use (a shared prefix)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, f"incref of free block {block_id}"
            block.ref_cnt += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one holder from each block; a block whose last holder leaves becomes free."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, f"double free of block {block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_block_ids.append(block_id)

    def check_integrity(self) -> None:
        """Assert the free queue holds exactly the blocks with ref_cnt 0, each once."""
        free_ids = list(self._free_block_ids)
        assert len(set(free_ids)) == len(free_ids), "a block is in the free queue twice"
        zero_ref_ids = {block.block_id for block in self.blocks if block.ref_cnt == 0}
        assert set(free_ids) == zero_ref_ids, (
            f"free queue {sorted(free_ids)} != blocks with ref_cnt 0 {sorted(zero_ref_ids)}"
        )
        assert all(block.ref_cnt >= 0 for block in self.blocks), "negative ref_cnt"
