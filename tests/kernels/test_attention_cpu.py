"""The fused decoder's paged attention kernel (ext.paged_attention) against naive_attention on
ragged steps, every SIMD variant (picked by head_dim), sliding windows, and batch invariance."""

from __future__ import annotations

import zlib

import pytest
import torch

from backfill import kernels
from backfill.model.attention import naive_attention, write_kv
from tests.model.test_attention import CASES, make_step

pytestmark = pytest.mark.skipif(not kernels.available(), reason="CPU kernels extension unavailable")

ATOL = 2e-5  # fp32, same inputs: equal up to summation order and the exp polynomial (~1 ulp)


def random_step(case: str, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                window: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, object]:
    """q [T, H, D] and caches holding random data in every slot (owned or not), the step's K/V written."""
    num_computed, query_lens = CASES[case]
    num_blocks = 800
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case}-{num_heads}-{head_dim}-{block_size}".encode()))
    _, meta, _ = make_step(num_computed, query_lens, block_size, num_blocks, seed=3, sliding_window=window)
    num_tokens = sum(query_lens)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)  # [blocks, bs, Hkv, D]
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)  # [T, Hkv, D]
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)  # [T, Hkv, D]
    q = 2 * torch.randn(num_tokens, num_heads, head_dim, generator=gen)  # [T, H, D]
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    return q, k_cache, v_cache, meta


def fused(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, window: int | None = None) -> torch.Tensor:
    ext = kernels.extension()
    scale = q.shape[-1] ** -0.5
    return ext.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start, scale,
                               window or 0)  # [T, H, D]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    # head_dim 64 / 32: the widest kernels; 24: the AVX2 one on an AVX-512 CPU; 12: the SSE one
    [(9, 3, 64, 16), (4, 4, 32, 8), (8, 2, 16, 5), (6, 2, 24, 16), (4, 1, 12, 7)],
)
def test_matches_naive(case: str, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    q, k_cache, v_cache, meta = random_step(case, num_heads, num_kv_heads, head_dim, block_size)
    expected = naive_attention(q, k_cache, v_cache, meta, head_dim**-0.5)  # [T, H, D]
    torch.testing.assert_close(fused(q, k_cache, v_cache, meta), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", ["mixed", "ragged_decodes"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(8, 2, 128), (4, 1, 256), (2, 2, 80)])
def test_wide_heads_match_naive(case: str, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """head_dim 128 / 256 (P.V in slices of 8 registers), 80 (5 AVX-512 registers)."""
    q, k_cache, v_cache, meta = random_step(case, num_heads, num_kv_heads, head_dim, 16)
    expected = naive_attention(q, k_cache, v_cache, meta, head_dim**-0.5)  # [T, H, D]
    torch.testing.assert_close(fused(q, k_cache, v_cache, meta), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("window", [1, 5, 16, 40, 100, 300])  # 300: split decodes with a window
@pytest.mark.parametrize("case", ["mixed", "ragged_decodes", "chunked_only"])
def test_sliding_window_matches_naive(case: str, window: int) -> None:
    q, k_cache, v_cache, meta = random_step(case, 8, 2, 32, 16, window)
    expected = naive_attention(q, k_cache, v_cache, meta, 32**-0.5)  # [T, H, D]
    torch.testing.assert_close(fused(q, k_cache, v_cache, meta, window), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", ["mixed", "ragged_decodes"])  # ragged: decodes split into key partitions
def test_batch_invariant(case: str) -> None:
    """Each sequence's rows are bit-identical alone, in the batch, and in a reordered batch."""
    from backfill.model.attention import build_attention_metadata

    num_computed, query_lens = CASES[case]
    block_size, num_blocks, heads, kv_heads, head_dim = 16, 64, 9, 3, 64
    gen = torch.Generator().manual_seed(7)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)  # [blocks, bs, Hkv, D]
    tables = [[(5 * i + 3 * b) % num_blocks for b in range(-(-(nc + q) // block_size))]
              for i, (nc, q) in enumerate(zip(num_computed, query_lens))]
    qs = [torch.randn(q, heads, head_dim, generator=gen) for q in query_lens]  # each [q, H, D]

    def run(order: list[int]) -> list[torch.Tensor]:
        _, meta = build_attention_metadata([num_computed[i] for i in order], [query_lens[i] for i in order],
                                           [tables[i] for i in order], block_size, torch.device("cpu"))
        out = fused(torch.cat([qs[i] for i in order]), k_cache, v_cache, meta)  # [T, H, D]
        rows = out.split([query_lens[i] for i in order])
        return [rows[order.index(i)] for i in sorted(order)]

    batched = run(list(range(len(query_lens))))
    reordered = run(list(reversed(range(len(query_lens)))))
    for i in range(len(query_lens)):
        alone = run([i])[0]
        assert torch.equal(batched[i], alone), f"sequence {i} differs batched vs alone"
        assert torch.equal(reordered[i], alone), f"sequence {i} differs reordered vs alone"


@pytest.mark.parametrize("case", ["mixed", "ragged_decodes"])
def test_thread_count_invariant(case: str) -> None:
    q, k_cache, v_cache, meta = random_step(case, 9, 3, 64, 16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fused(q, k_cache, v_cache, meta)
        torch.set_num_threads(max(2, threads))
        many = fused(q, k_cache, v_cache, meta)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_rejects_out_of_range_block() -> None:
    q, k_cache, v_cache, meta = random_step("decode_only", 4, 2, 16, 16)
    meta.block_tables[0, 0] = k_cache.shape[0]  # one past the last block
    with pytest.raises(RuntimeError, match="out of range"):
        fused(q, k_cache, v_cache, meta)


@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (8, 1)])
def test_long_chunk_spans_tiles(num_heads: int, num_kv_heads: int, window: int | None) -> None:
    """A 300-token chunk after 290 cached tokens: several query tiles (128 tokens at G = 3, 64
    at G = 8) and ~10 key tiles each, beside two decodes."""
    from backfill.model.attention import build_attention_metadata

    num_computed, query_lens, block_size, head_dim = [290, 40, 7], [300, 1, 1], 16, 32
    gen = torch.Generator().manual_seed(11)
    tables, next_block = [], 0
    for nc, q in zip(num_computed, query_lens):
        n = -(-(nc + q) // block_size)
        tables.append(list(range(next_block + n - 1, next_block - 1, -1)))  # reversed: non-contiguous reads
        next_block += n
    _, meta = build_attention_metadata(num_computed, query_lens, tables, block_size, torch.device("cpu"), window)
    shape = (next_block, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)  # [blocks, bs, Hkv, D]
    q = 2 * torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)  # [T, H, D]
    expected = naive_attention(q, k_cache, v_cache, meta, head_dim**-0.5)  # [T, H, D]
    torch.testing.assert_close(fused(q, k_cache, v_cache, meta, window), expected, atol=ATOL, rtol=0)
