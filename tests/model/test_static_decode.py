"""Fixed-shape decode attention (model/static_decode.py, what CUDA graphs capture) against
naive_attention: block tables padded to a budget, padding rows over a scratch block, sliding
windows."""

from __future__ import annotations

import pytest
import torch

from backfill.model.attention import naive_attention, paged_attention, write_kv
from backfill.model.static_decode import build_static_decode_metadata, varlen_supported
from tests.model.test_attention import CASES, TOLERANCE, make_step

CPU = torch.device("cpu")
DECODE_CASES = ["decode_only", "ragged_decodes_decodes"]


def decode_case(name: str) -> tuple[list[int], list[int]]:
    if name == "ragged_decodes_decodes":  # the ragged case without its one prompt
        computed, lens = CASES["ragged_decodes"]
        return [c for c, q in zip(computed, lens) if q == 1], [1] * sum(q == 1 for q in lens)
    return CASES[name]


def static_inputs(tables: list[list[int]], num_computed: list[int], block_size: int, budget: int,
                  num_padding: int, scratch_block: int, device: torch.device = CPU
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slot_mapping [B], block_tables [B, budget] int32, seq_lens [B] int32) as the graph
    runner fills them: real rows, then `num_padding` rows over the scratch block."""
    rows = [t + [scratch_block] * (budget - len(t)) for t in tables] + [[scratch_block] * budget] * num_padding
    positions = num_computed + [0] * num_padding
    slots = [row[p // block_size] * block_size + p % block_size for row, p in zip(rows, positions)]
    return (torch.tensor(slots, device=device), torch.tensor(rows, dtype=torch.int32, device=device),
            torch.tensor([p + 1 for p in positions], dtype=torch.int32, device=device))


def check_static_matches_naive(case: str, dtype: torch.dtype, sliding_window: int | None, backend: str,
                               device: torch.device) -> None:
    num_computed, query_lens = decode_case(case)
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 9, 3, 64, 16, 800
    _, meta, tables = make_step(num_computed, query_lens, block_size, num_blocks - 1, seed=3,
                                sliding_window=sliding_window, device=device)
    scratch = num_blocks - 1  # never in a table
    gen = torch.Generator().manual_seed(7)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device, dtype)
    v_cache = torch.randn(shape, generator=gen).to(device, dtype)
    n = len(query_lens)
    num_padding = 3
    q = (2 * torch.randn(n + num_padding, num_heads, head_dim, generator=gen)).to(device, dtype)
    k = torch.randn(n + num_padding, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    budget = max(len(t) for t in tables) + 2  # the graph's budget exceeds every table
    slots, block_tables, seq_lens = static_inputs(tables, num_computed, block_size, budget, num_padding, scratch, device)
    write_kv(k_cache, v_cache, k, -k, slots)  # padding rows write the scratch block only
    static = build_static_decode_metadata(slots, block_tables, seq_lens, block_size, sliding_window, backend)
    got = paged_attention(q, k_cache, v_cache, static, head_dim**-0.5)  # [B, H, D]
    ref = naive_attention(q[:n], k_cache, v_cache, meta, head_dim**-0.5)  # [n, H, D]
    assert got.shape == (n + num_padding, num_heads, head_dim)
    torch.testing.assert_close(got[:n].float(), ref.float(), **TOLERANCE[dtype])
    # Padding rows all write the scratch block's slot 0 and attend to it alone: their output is
    # the V stored there, and no real row's slot was touched (checked above by the real rows).
    scratch_v = v_cache[scratch, 0].repeat_interleave(num_heads // num_kv_heads, dim=0)  # [H, D]
    torch.testing.assert_close(got[n:].float(), scratch_v.float().expand(num_padding, -1, -1), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", DECODE_CASES)
@pytest.mark.parametrize("sliding_window", [None, 24])
def test_gather_decode_matches_naive(case: str, dtype: torch.dtype, sliding_window: int | None) -> None:
    check_static_matches_naive(case, dtype, sliding_window, "gather", CPU)


def test_varlen_kernel_is_refused_off_cuda() -> None:
    reason = varlen_supported(CPU, torch.bfloat16, 16, 9, 3, 64)
    assert reason is not None and "CUDA" in reason
    with pytest.raises(ValueError, match="backend"):
        build_static_decode_metadata(torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.int32),
                                     torch.ones(1, dtype=torch.int32), 16, None, "flash")
