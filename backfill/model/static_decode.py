"""Decode attention over fixed-shape metadata: the part of a step a CUDA graph can capture.

`build_attention_metadata` (attention.py) plans every step on the host: decode groups cut to
the step's longest sequence, one span per prompt, Python lists of lengths. A captured graph
replays fixed shapes at fixed addresses and runs no Python, so a graphed decode step reads
only these device tensors, which the caller refills in place before each replay:

    slot_mapping [B]      int64, the KV slot each row's new token is written to
    block_tables [B, M]   int32, each row's blocks; entries past its length are never read
    seq_lens     [B]      int32, tokens in the cache after the step (the query sits at seq_len - 1)

B and M are the graph's (worker/cuda_graph.py pads a step up to them); every row is one query.

Two kernels read them:
- "gather" (portable, any device and dtype): each row's M blocks are gathered and attended in
  one SDPA call, keys past seq_len masked: the same arithmetic as paged_attention's decode
  path (one group), reading B * M blocks per layer whatever the lengths.
- "varlen": torch.nn.attention.varlen.varlen_attn with `block_table` and `seqused_k`, flash
  attention reading the paged cache in place (CUDA, fp16/bf16, a torch that has those
  arguments and a flash kernel that takes the block size). `varlen_supported` tries it once
  against "gather" before a runner relies on it.
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from backfill.model.attention import AttentionMetadata, DecodeGroup, decode_visible, paged_attention

logger = logging.getLogger(__name__)

BACKENDS: tuple[str, ...] = ("gather", "varlen")


def build_static_decode_metadata(
    slot_mapping: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    block_size: int,
    sliding_window: int | None,
    backend: str = "gather",
) -> AttentionMetadata:
    """The metadata of a decode step of B = len(slot_mapping) rows over fixed buffers, built
    with device ops only (safe inside a CUDA graph capture; the buffers are read, not copied,
    so refilling them before a replay changes what the captured step computes).

    slot_mapping [B] int64, block_tables [B, M] int32 (contiguous), seq_lens [B] int32.
    The host-side lists (`seq_lens_list`) stay empty: the lengths are known on the device only.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    num_seqs, max_blocks = block_tables.shape
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,  # [B]
        block_tables=block_tables,  # [B, M]
        seq_lens=seq_lens,  # [B]
        query_start=torch.arange(num_seqs + 1, device=seq_lens.device),  # [B + 1]
        query_lens_list=[1] * num_seqs,
        seq_lens_list=[],
        block_size=block_size,
        sliding_window=sliding_window,
        num_decode=num_seqs,
    )
    if backend == "varlen":
        cu_seq_q = torch.arange(num_seqs + 1, dtype=torch.int32, device=seq_lens.device)  # [B + 1]
        cu_seq_k = F.pad(seq_lens.cumsum(0, dtype=torch.int32), (1, 0))  # [B + 1]
        meta.decode_fn = functools.partial(
            _varlen_decode, cu_seq_q=cu_seq_q, cu_seq_k=cu_seq_k, seq_lens=seq_lens,
            block_tables=block_tables, max_len=max_blocks * block_size, sliding_window=sliding_window,
        )
        return meta
    meta.decode_groups.append(
        DecodeGroup(
            num_seqs=num_seqs,
            rows=slice(0, num_seqs),
            block_ids=block_tables.reshape(-1),  # [B * M]
            mask=decode_visible(seq_lens, max_blocks * block_size, sliding_window)[:, None, None, :],  # [B, 1, 1, L]
        )
    )
    return meta


def _varlen_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    scale: float,
    *,
    cu_seq_q: Tensor,
    cu_seq_k: Tensor,
    seq_lens: Tensor,
    block_tables: Tensor,
    max_len: int,
    sliding_window: int | None,
) -> Tensor:
    """q [B, H, D] -> [B, H, D], flash attention over the paged caches [blocks, bs, Hkv, D]."""
    from torch.nn.attention.varlen import varlen_attn

    # One query per row at the end of its sequence: causal is the whole prefix; a window keeps
    # the query and the W - 1 keys before it.
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
    out = varlen_attn(
        q, k_cache, v_cache, cu_seq_q, cu_seq_k, 1, max_len, scale=scale, window_size=window,
        enable_gqa=q.shape[1] != k_cache.shape[2], seqused_k=seq_lens, block_table=block_tables,
        num_splits=1,  # no split-KV: a row's reduction order does not depend on its batch
    )
    assert isinstance(out, Tensor)
    return out  # [B, H, D]


def varlen_signature_ok() -> bool:
    """Whether this torch's varlen_attn takes a paged cache (`block_table`, `seqused_k`)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    params = inspect.signature(varlen_attn).parameters
    return all(name in params for name in ("block_table", "seqused_k", "window_size", "num_splits"))


@torch.inference_mode()
def varlen_supported(
    device: torch.device, dtype: torch.dtype, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> str | None:
    """None when the "varlen" kernel runs here and agrees with "gather" on a small random
    paged cache, else why not. Called once per runner; costs a few small kernels."""
    if device.type != "cuda":
        return "varlen attention needs CUDA"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash attention does not compute {dtype}"
    if not varlen_signature_ok():
        return f"torch {torch.__version__}'s varlen_attn has no block_table/seqused_k"
    gen = torch.Generator(device="cpu").manual_seed(0)
    num_blocks, num_seqs, max_blocks = 12, 3, 4
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device, dtype)  # [blocks, bs, Hkv, D]
    v_cache = torch.randn(shape, generator=gen).to(device, dtype)  # [blocks, bs, Hkv, D]
    q = torch.randn(num_seqs, num_heads, head_dim, generator=gen).to(device, dtype)  # [B, H, D]
    tables = torch.randperm(num_blocks, generator=gen)[: num_seqs * max_blocks].view(num_seqs, max_blocks)
    tables = tables.to(device, torch.int32)  # [B, M]
    seq_lens = torch.tensor([1, 2 * block_size + 3, max_blocks * block_size], dtype=torch.int32, device=device)
    slots = torch.zeros(num_seqs, dtype=torch.int64, device=device)  # [B], unused: no K/V written
    outs = []
    for backend in BACKENDS:
        meta = build_static_decode_metadata(slots, tables, seq_lens, block_size, None, backend)
        try:
            outs.append(paged_attention(q, k_cache, v_cache, meta, head_dim**-0.5).float())  # [B, H, D]
        except (RuntimeError, ValueError) as exc:  # e.g. a block size the flash kernel refuses
            return f"varlen_attn failed: {str(exc).splitlines()[0]}"
    err = (outs[0] - outs[1]).abs().max().item()
    if not err < 2e-2:
        return f"varlen_attn disagrees with the gather path (max error {err:.3g})"
    return None
