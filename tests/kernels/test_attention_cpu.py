"""The fused decoder's paged attention kernel (ext.paged_attention) against naive_attention on
ragged steps, every SIMD variant (picked by head_dim), sliding windows, batch invariance, and
chunking invariance (a row's bits depend on its position alone, not on how its query arrived)."""

from __future__ import annotations

import os
import subprocess
import sys
import zlib

import pytest
import torch

from backfill import kernels
from backfill.model.attention import naive_attention, write_kv
from backfill.model.cpu_decoder import CpuDecoder
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
    """The kernel over the caches [blocks, bs, Hkv, D] moved into its layout (K [blocks, Hkv, D, bs],
    V [blocks, Hkv, bs, D])."""
    ext = kernels.extension()
    scale = q.shape[-1] ** -0.5
    k_panels, v_panels = CpuDecoder.kv_panels(k_cache, v_cache)
    return ext.paged_attention(q, k_panels, v_panels, meta.block_tables, meta.seq_lens, meta.query_start, scale,
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (8, 2, 16, 5), (6, 2, 24, 16), (4, 1, 12, 7), (8, 2, 128, 16)],
)
def test_narrow_caches_read_as_their_fp32_values(case: str, num_heads: int, num_kv_heads: int, head_dim: int,
                                                 block_size: int, window: int | None, dtype: torch.dtype) -> None:
    """bf16 / fp16 / fp8 caches (kv_cache_dtype) give the bits fp32 caches holding the same
    rounded values give, in every layout (decodes, chunks, a block size the SIMD width does not
    divide) and SIMD variant: the kernels widen each element exactly, nothing else changes."""
    q, k_cache, v_cache, meta = random_step(case, num_heads, num_kv_heads, head_dim, block_size, window)
    k_narrow, v_narrow = k_cache.to(dtype), v_cache.to(dtype)  # [blocks, bs, Hkv, D]
    expected = fused(q, k_narrow.float(), v_narrow.float(), meta, window)  # [T, H, D]
    assert torch.equal(fused(q, k_narrow, v_narrow, meta, window), expected)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("head_dim", [16, 24, 12])  # the widest kernels; AVX2's on an AVX-512 CPU; the baseline's
@pytest.mark.parametrize(("case", "block_size"), [("mixed", 16), ("chunked_only", 16), ("mixed", 7)])
def test_fp8_caches_holding_every_code(case: str, block_size: int, head_dim: int, dtype: torch.dtype) -> None:
    """Caches whose elements run through the codes (K: every one of magnitude <= 4, so that every
    key keeps some weight; V: every finite one) give the fp32 caches' bits, and a NaN code a row
    sees makes that row NaN on both: each code widened exactly by every path that reads K or V
    (a register at a time, one element at a time for prompt chunks' broadcasts, the K^T copy of
    a block size the SIMD width does not divide)."""
    q, k_cache, v_cache, meta = random_step(case, 8, 2, head_dim, block_size)
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)  # every code
    small, finite = values[values.float().abs() <= 4], values[values.float().isfinite()]
    k8 = small[torch.arange(k_cache.numel()) % small.numel()].view(k_cache.shape)
    v8 = finite[torch.arange(v_cache.numel()) % finite.numel()].view(v_cache.shape)
    expected = fused(q, k8.float(), v8.float(), meta)  # [T, H, D]
    assert expected.isfinite().all()
    assert torch.equal(fused(q, k8, v8, meta), expected)
    nan = values[values.float().isnan()][0]
    k8.view(-1, k8.shape[-1])[int(meta.slot_mapping[0]) * k8.shape[2], 3] = nan  # the step's first key, head 0
    expected = fused(q, k8.float(), v8.float(), meta)
    assert expected.isnan().any() and not expected.isnan().all()
    torch.testing.assert_close(fused(q, k8, v8, meta), expected, rtol=0, atol=0, equal_nan=True)


def test_widening_is_exact_for_every_code() -> None:
    """Every one of the 65,536 halves and of the 256 codes of each fp8 type (normals,
    subnormals, zeros, infinities, NaNs) read from a V cache as torch widens it: one key of
    weight 1, so the output row is its V row."""
    check_widening()


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_widening_lower_isa(isa: str) -> None:
    """The same on the AVX2 kernels and on the baseline's (no F16C: a conversion of its own)."""
    code = ("from tests.kernels.test_attention_cpu import check_widening; check_widening(); "
            "from backfill import kernels; print(kernels.extension().isa())")
    assert run_under_isa(isa, code, timeout=300) == isa


def check_widening() -> None:
    halves = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)  # every bit pattern
    check_v_rows(halves)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)  # every bit pattern
        check_v_rows(codes.repeat(4))  # (whole blocks of V rows)


def check_v_rows(values: torch.Tensor) -> None:
    """values [n] (a cache dtype, n a multiple of 1,024) as the V rows of one-key sequences,
    read back as torch widens them."""
    from backfill.model.attention import build_attention_metadata

    head_dim, block_size = 64, 16
    num_blocks = values.numel() // (head_dim * block_size)  # one V row per key, each key its own sequence
    v = values.view(num_blocks, 1, block_size, head_dim)  # [blocks, Hkv, bs, D]
    k = torch.zeros(num_blocks, 1, head_dim, block_size, dtype=values.dtype)  # scores all 0
    num_seqs = num_blocks * block_size
    # sequence s: one key, at block s // bs, slot s % bs (a table whose first block is that one,
    # its first slot s % bs keys ahead: a window of 1 sees only the last key)
    tables = [[s // block_size] for s in range(num_seqs)]
    lens = [s % block_size + 1 for s in range(num_seqs)]
    _, meta = build_attention_metadata([n - 1 for n in lens], [1] * num_seqs, tables, block_size,
                                       torch.device("cpu"))
    q = torch.zeros(num_seqs, 1, head_dim)
    out = kernels.extension().paged_attention(q, k, v, meta.block_tables, meta.seq_lens, meta.query_start, 1.0, 1)
    expected = v.float().reshape(num_seqs, 1, head_dim)  # [S, 1, D]
    got = out.reshape(num_seqs, 1, head_dim)
    nan = expected.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan], expected[~nan] + 0.0)  # (-0 rows come out +0: see write_row)


def test_rejects_mixed_cache_dtypes() -> None:
    q, k_cache, v_cache, meta = random_step("decode_only", 4, 2, 16, 16)
    with pytest.raises(RuntimeError, match="of one element type"):
        fused(q, k_cache.to(torch.bfloat16), v_cache, meta)


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


# --- chunking invariance: a row's output is a function of its position and the cache alone ---

CHUNK_LEN = 1200  # crosses key tiles (64) and partitions (256) many times
# How one sequence's CHUNK_LEN queries arrive, as query lengths per step (1: a decode). Every
# chunking must give each position the rows the whole prompt gives it, bit for bit.
CHUNKINGS = {
    "cycle": [1, 2, 3, 7, 16, 64, 200],  # patterns repeat until the sequence ends (split)
    "cycle_shifted": [5, 200, 64, 16, 7, 3, 2, 1],
    "sixteens": [16],
    "prompt_then_decodes": [1000] + [1] * 200,
    "decodes_from_70": [70] + [1] * 250 + [880],  # decodes across tiles 128, 192, 256 (a partition), 320
}


def split(total: int, pattern: list[int]) -> list[int]:
    """Step sizes covering `total` tokens: `pattern` repeated, the last step cut to fit."""
    sizes: list[int] = []
    while sum(sizes) < total:
        sizes.append(min(pattern[len(sizes) % len(pattern)], total - sum(sizes)))
    return sizes


def chunked_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: list[int], block_size: int,
                 sizes: list[int], window: int | None, companion: tuple[torch.Tensor, list[int], int] | None = None
                 ) -> torch.Tensor:
    """The sequence's rows [L, H, D] computed chunk by chunk (the caches already hold every K/V:
    a query never reads past its own position). `companion` (q_row [1, H, D], block table,
    context): a decode of another sequence beside every chunk, placed first."""
    from backfill.model.attention import build_attention_metadata

    rows, offset = [], 0
    for n in sizes:
        computed, lens, tables, qs = [offset], [n], [table], [q[offset:offset + n]]
        if companion is not None:
            computed, lens, tables, qs = [companion[2]] + computed, [1] + lens, [companion[1]] + tables, \
                [companion[0]] + qs
        _, meta = build_attention_metadata(computed, lens, tables, block_size, torch.device("cpu"), window,
                                           plan_torch_attention=False)
        out = fused(torch.cat(qs), k_cache, v_cache, meta, window)  # [T, H, D]
        rows.append(out[-n:])
        offset += n
    return torch.cat(rows)  # [L, H, D]


def chunking_case(num_heads: int, num_kv_heads: int, head_dim: int, window: int | None, seed: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], int, tuple[torch.Tensor, list[int], int]]:
    """q [L, H, D] of one CHUNK_LEN sequence, caches holding all its K/V (and a companion's):
    (q, k_cache, v_cache, block table, block size, companion as chunked_rows takes it)."""
    block_size = 16
    num_blocks = 2 * -(-CHUNK_LEN // block_size) + 4
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)  # [blocks, bs, Hkv, D]
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # scattered blocks
    table, other = perm[:num_blocks // 2], perm[num_blocks // 2:]
    q = 2 * torch.randn(CHUNK_LEN, num_heads, head_dim, generator=gen)  # [L, H, D]
    companion = (torch.randn(1, num_heads, head_dim, generator=gen), other, 777)
    return q, k_cache, v_cache, table, block_size, companion


CHUNK_SHAPES = [(4, 4, 16), (9, 3, 64), (8, 1, 64), (6, 2, 128)]  # (H, Hkv, D): MHA, the default model's, MQA, wide


@pytest.mark.parametrize("window", [None, 100, 300])  # 100: not tile-aligned; 300: longer than a partition
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), CHUNK_SHAPES)
def test_chunking_invariant(num_heads: int, num_kv_heads: int, head_dim: int, window: int | None) -> None:
    """Whole prompt (one thread) vs chunks of 1..200 tokens at shifting offsets vs
    prompt-then-decodes (every thread), with and without a companion decode: every position's
    rows are bit-identical."""
    q, k_cache, v_cache, table, block_size, companion = chunking_case(num_heads, num_kv_heads, head_dim, window)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = chunked_rows(q, k_cache, v_cache, table, block_size, [CHUNK_LEN], window)  # [L, H, D]
    finally:
        torch.set_num_threads(threads)
    for i, name in enumerate(sorted(CHUNKINGS)):
        got = chunked_rows(q, k_cache, v_cache, table, block_size, split(CHUNK_LEN, CHUNKINGS[name]), window,
                           companion if i % 2 else None)
        differ = (got != whole).any(dim=2).any(dim=1).nonzero().flatten().tolist()  # positions
        assert not differ, f"{name}: {len(differ)} positions differ from the whole prompt, first {differ[:8]}"


def test_chunked_matches_naive() -> None:
    """The invariant arithmetic is still attention: the whole prompt and the decodes against naive."""
    from backfill.model.attention import build_attention_metadata

    q, k_cache, v_cache, table, block_size, _ = chunking_case(9, 3, 64, 300)
    for computed, n in ((0, CHUNK_LEN), (CHUNK_LEN - 1, 1)):
        _, meta = build_attention_metadata([computed], [n], [table], block_size, torch.device("cpu"), 300)
        rows = q[computed:computed + n]  # [n, H, D]
        expected = naive_attention(rows, k_cache, v_cache, meta, 64**-0.5)  # [n, H, D]
        torch.testing.assert_close(fused(rows, k_cache, v_cache, meta, 300), expected, atol=ATOL, rtol=0)


def check_chunking_lower_isa() -> None:
    """Run by test_chunking_invariant_lower_isa in a subprocess with BACKFILL_ISA set."""
    for shape in CHUNK_SHAPES[:2]:
        for window in (None, 100):
            test_chunking_invariant(*shape, window)
    test_chunked_matches_naive()  # the default model's head_dim on these kernels' own blocking
    print(kernels.extension().isa())


def run_under_isa(isa: str, code: str, timeout: int) -> str:
    """Runs `code` in a subprocess whose kernels are lowered to `isa` (BACKFILL_ISA: "avx2",
    "scalar"); asserts it succeeded and returns its last line of output. Skips the test where
    this CPU lacks the ISA."""
    if isa == "avx2" and kernels.extension().isa() == "scalar":
        pytest.skip("this CPU has no AVX2")
    env = {**os.environ, "BACKFILL_ISA": isa}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_chunking_invariant_lower_isa(isa: str) -> None:
    """The AVX2 and baseline kernels (an AVX2-only EPYC, an old CPU) are chunking-invariant too, and
    match naive attention."""
    code = "from tests.kernels.test_attention_cpu import check_chunking_lower_isa; check_chunking_lower_isa()"
    assert run_under_isa(isa, code, timeout=300) == isa
