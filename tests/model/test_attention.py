"""paged_attention (batched decodes + per-sequence prefills) against naive_attention (slot by
slot gather, explicit fp32 softmax), and the metadata / KV-write plumbing they share."""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from backfill.model.attention import (
    as_cache_elements,
    build_attention_metadata,
    naive_attention,
    paged_attention,
    write_kv,
)

CPU = torch.device("cpu")
# |paged - naive| <= atol + rtol * |naive|. fp32: equal up to summation order. bf16: both see
# the same rounded inputs, but SDPA rounds its probabilities and output to bf16 (ulp 2**-8
# relative), the reference rounds only its output; a few ulps apart.
TOLERANCE = {torch.float32: {"atol": 2e-5, "rtol": 0.0}, torch.bfloat16: {"atol": 1e-2, "rtol": 1.6e-2}}


def make_step(
    num_computed: list[int],
    query_lens: list[int],
    block_size: int,
    num_blocks: int,
    seed: int,
    sliding_window: int | None = None,
    device: torch.device = CPU,
) -> tuple[torch.Tensor, object, list[list[int]]]:
    """Random non-contiguous block tables (with spare trailing blocks) for one step."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    for nc, q in zip(num_computed, query_lens):
        needed = -(-(nc + q) // block_size) + rng.randint(0, 2)  # some tables over-allocated
        tables.append([free.pop() for _ in range(needed)])
    positions, meta = build_attention_metadata(num_computed, query_lens, tables, block_size, device, sliding_window)
    return positions, meta, tables


CASES = {
    # name: (num_computed, query_lens)
    "mixed": ([37, 0, 100, 5, 0, 63, 250], [1, 20, 1, 17, 1, 1, 33]),
    "decode_only": ([3, 64, 15, 200, 1, 90], [1, 1, 1, 1, 1, 1]),
    "prefill_only": ([0, 0, 0], [5, 48, 2]),
    "chunked_only": ([16, 7, 120], [16, 9, 40]),
    "one_token_prompt": ([0], [1]),
    # very different lengths: decodes split into length groups (see test_decode_length_groups)
    "ragged_decodes": ([700, 20, 30, 690, 15, 0, 25, 710, 40], [1, 1, 1, 1, 1, 12, 1, 1, 1]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"), [(9, 3, 64, 16), (4, 4, 32, 8), (8, 2, 16, 5)]
)
def test_paged_matches_naive(
    dtype: torch.dtype, case: str, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    check_paged_matches_naive(dtype, case, num_heads, num_kv_heads, head_dim, block_size, CPU)


def random_step_tensors(gen: torch.Generator, shape: tuple[int, int, int, int], num_tokens: int, num_heads: int,
                        device: torch.device, cache_dtype: torch.dtype, dtype: torch.dtype, k_scale: float = 1.0,
                        q_scale: float = 1.0) -> tuple[torch.Tensor, ...]:
    """Random caches of `shape` [blocks, bs, Hkv, D] in cache_dtype, and a step's K, V [T, Hkv, D]
    and Q [T, H, D] in dtype (K and Q scaled), drawn from `gen` in that order, on `device`."""
    num_kv_heads, head_dim = shape[2], shape[3]
    k_cache = torch.randn(shape, generator=gen).to(device, cache_dtype)
    v_cache = torch.randn(shape, generator=gen).to(device, cache_dtype)
    k = (k_scale * torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)).to(device, dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    q = (q_scale * torch.randn(num_tokens, num_heads, head_dim, generator=gen)).to(device, dtype)
    return k_cache, v_cache, k, v, q


def check_paged_matches_naive(dtype: torch.dtype, case: str, num_heads: int, num_kv_heads: int, head_dim: int,
                              block_size: int, device: torch.device) -> None:
    """paged_attention == naive_attention on `device` for one of CASES (tests/gpu reuses it)."""
    num_computed, query_lens = CASES[case]
    num_blocks = 800
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case}-{num_heads}-{block_size}".encode()))
    positions, meta, _ = make_step(num_computed, query_lens, block_size, num_blocks, seed=3, device=device)
    num_tokens = sum(query_lens)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # Every slot holds random data, including slots no sequence owns: reading one would show.
    k_cache, v_cache, k, v, q = random_step_tensors(gen, shape, num_tokens, num_heads, device, dtype, dtype, q_scale=2)
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    scale = head_dim**-0.5

    fast = paged_attention(q, k_cache, v_cache, meta, scale)
    ref = naive_attention(q, k_cache, v_cache, meta, scale)
    assert fast.shape == (num_tokens, num_heads, head_dim) and fast.dtype == dtype
    torch.testing.assert_close(fast.float(), ref.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_narrow_caches_read_as_their_values(case: str, dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    check_narrow_caches(case, dtype, kv_dtype, CPU)


def check_narrow_caches(case: str, dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device) -> None:
    """kv_cache_dtype on the plain-PyTorch path: write_kv stores K and V as as_cache_elements
    gives them (rounded, clamped past the type's range), and paged_attention over those caches
    gives the bits it gives over caches of q's dtype holding the same values (the gathered
    blocks widened exactly), decodes and prompts alike (tests/gpu reuses it)."""
    num_computed, query_lens = CASES[case]
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 8, 2, 16, 5, 800
    gen = torch.Generator().manual_seed(zlib.crc32(f"narrow-{case}".encode()))
    _, meta, _ = make_step(num_computed, query_lens, block_size, num_blocks, seed=7, device=device)
    num_tokens = sum(query_lens)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache, k, v, q = random_step_tensors(gen, shape, num_tokens, num_heads, device, kv_dtype, dtype,
                                                    k_scale=300, q_scale=0.01)  # K: some past 448
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    stored = k_cache.view(-1, num_kv_heads, head_dim)[meta.slot_mapping]  # [T, Hkv, D]
    assert stored.dtype == kv_dtype and torch.equal(stored, as_cache_elements(k, kv_dtype))
    assert stored.float().isfinite().all()
    if kv_dtype in (torch.float8_e4m3fn, torch.float16):
        limit = torch.finfo(kv_dtype).max
        assert torch.equal(stored.float(), k.float().clamp(-limit, limit).to(kv_dtype).float())
    expected = paged_attention(q, k_cache.to(dtype), v_cache.to(dtype), meta, head_dim**-0.5)
    assert torch.equal(paged_attention(q, k_cache, v_cache, meta, head_dim**-0.5), expected)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), [(9, 3, 64, 16), (8, 2, 16, 5)])
def test_sliding_window_matches_naive(case: str, num_heads: int, num_kv_heads: int, head_dim: int,
                                      block_size: int) -> None:
    """Mistral-style window of 24 positions (shorter than most sequences here), fp32."""
    window = 24
    num_computed, query_lens = CASES[case]
    num_blocks = 800
    gen = torch.Generator().manual_seed(zlib.crc32(f"window-{case}-{block_size}".encode()))
    _, meta, tables = make_step(num_computed, query_lens, block_size, num_blocks, seed=5, sliding_window=window)
    num_tokens = sum(query_lens)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    q = 2 * torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    write_kv(k_cache, v_cache, k, -k, meta.slot_mapping)
    fast = paged_attention(q, k_cache, v_cache, meta, head_dim**-0.5)
    ref = naive_attention(q, k_cache, v_cache, meta, head_dim**-0.5)
    torch.testing.assert_close(fast, ref, **TOLERANCE[torch.float32])
    # The window bites wherever a sequence is longer than it.
    if max(nc + ql for nc, ql in zip(num_computed, query_lens)) > window:
        _, full_meta = build_attention_metadata(num_computed, query_lens, tables, block_size, CPU)
        full = naive_attention(q, k_cache, v_cache, full_meta, head_dim**-0.5)
        assert not torch.allclose(full, ref, atol=1e-3)


def test_paged_reads_this_steps_kv_and_non_contiguous_q() -> None:
    """q given as a strided view (as the model passes it), decodes interleaved with prefills
    (non-contiguous decode rows), and a query must see the K/V written in the same step."""
    num_computed, query_lens = [10, 0, 30, 0], [1, 6, 1, 3]
    positions, meta, _ = make_step(num_computed, query_lens, 4, 64, seed=1)
    assert len(meta.decode_groups) == 1 and not isinstance(meta.decode_groups[0].rows, slice)
    gen = torch.Generator().manual_seed(0)
    num_tokens, heads, kv_heads, dim = sum(query_lens), 6, 2, 8
    qk = torch.randn(num_tokens, heads + kv_heads, dim, generator=gen)
    q = qk[:, :heads]  # [T, H, D] strided view
    k_cache = torch.randn(64, 4, kv_heads, dim, generator=gen)
    v_cache = torch.randn(64, 4, kv_heads, dim, generator=gen)
    write_kv(k_cache, v_cache, qk[:, heads:], qk[:, heads:] * 2, meta.slot_mapping)
    fast = paged_attention(q, k_cache, v_cache, meta, 0.3)
    ref = naive_attention(q, k_cache, v_cache, meta, 0.3)
    torch.testing.assert_close(fast, ref, atol=2e-5, rtol=0)
    # The first token of a fresh prompt attends only to itself: output = its own V.
    first_prompt_row = 1
    own_v = (qk[first_prompt_row, heads:] * 2).repeat_interleave(heads // kv_heads, dim=0)  # [H, D]
    torch.testing.assert_close(fast[first_prompt_row], own_v, atol=1e-6, rtol=0)


def test_metadata_positions_slots_and_decode_group() -> None:
    tables = [[7, 2], [5], [9, 4, 1]]
    positions, meta = build_attention_metadata([3, 0, 8], [1, 2, 1], tables, 4, CPU)
    assert positions.tolist() == [3, 0, 1, 8]
    assert meta.slot_mapping.tolist() == [7 * 4 + 3, 5 * 4 + 0, 5 * 4 + 1, 1 * 4 + 0]
    assert meta.query_start.tolist() == [0, 1, 3, 4]
    assert meta.seq_lens.tolist() == [4, 2, 9] and meta.seq_lens_list == [4, 2, 9]
    assert meta.block_tables.tolist() == [[7, 2, 0], [5, 0, 0], [9, 4, 1]]
    assert meta.num_decode == 2 and len(meta.decode_groups) == 1
    group = meta.decode_groups[0]
    assert group.rows.tolist() == [0, 3]  # not consecutive: an index tensor
    # decode blocks padded to the longest decode (9 tokens -> 3 blocks of 4)
    assert group.block_ids.tolist() == [7, 2, 0, 9, 4, 1]
    assert group.mask[:, 0, 0].sum(-1).tolist() == [4, 9]
    assert len(meta.prefills) == 1 and meta.prefills[0].mask is None  # fresh prompt: causal
    assert (meta.prefills[0].token_start, meta.prefills[0].token_end) == (1, 3)


def test_metadata_rejects_short_block_table_and_empty_query() -> None:
    with pytest.raises(ValueError, match="block_tables\\[0\\]"):
        build_attention_metadata([15], [2], [[0]], 16, CPU)
    with pytest.raises(ValueError, match="query_lens\\[1\\]"):
        build_attention_metadata([0, 3], [2, 0], [[0], [1]], 16, CPU)


def test_write_kv_writes_exactly_the_mapped_slots() -> None:
    k_cache = torch.zeros(4, 2, 1, 3)
    v_cache = torch.zeros(4, 2, 1, 3)
    k = torch.arange(1, 7, dtype=torch.float32).view(2, 1, 3)
    write_kv(k_cache, v_cache, k, -k, torch.tensor([5, 2]))
    flat_k = k_cache.view(8, 3)
    assert flat_k[5].tolist() == [1, 2, 3] and flat_k[2].tolist() == [4, 5, 6]
    assert flat_k.abs().sum().item() == 21  # nothing else touched
    assert v_cache.view(8, 3)[5].tolist() == [-1, -2, -3]


def test_decode_length_groups() -> None:
    """Similar lengths share one padded call; a few long sequences among many short ones get
    their own group, and the groups cover every decode exactly once."""
    block_size = 16
    same = [100, 101, 110, 120] * 8
    _, meta = build_attention_metadata(same, [1] * 32, [[0] * 8] * 32, block_size, CPU)
    assert len(meta.decode_groups) == 1 and meta.decode_groups[0].rows == slice(0, 32)

    ragged = [1000 if i % 8 == 0 else 40 + i for i in range(32)]
    tables = [[0] * 64] * 32
    _, meta = build_attention_metadata(ragged, [1] * 32, tables, block_size, CPU)
    groups = meta.decode_groups
    assert 2 <= len(groups) <= 4
    rows = sorted(
        r for g in groups for r in (range(32)[g.rows] if isinstance(g.rows, slice) else g.rows.tolist())
    )
    assert rows == list(range(32))
    long_group = max(groups, key=lambda g: g.mask.shape[-1])
    assert long_group.num_seqs == 4 and long_group.mask.shape[-1] == 1008
    assert sum(g.num_seqs * g.mask.shape[-1] for g in groups) < 32 * 1008 // 3
