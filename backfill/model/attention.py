"""Paged attention in plain PyTorch: KV writes through slot_mapping, reads through block tables.

Cache layout, per layer: k_cache, v_cache = [num_blocks, block_size, num_kv_heads, head_dim].
Token `p` of a sequence lives in slot `block_table[p // block_size] * block_size + p % block_size`.

The flat batch of a step holds every scheduled token, sequence after sequence:

    rows:  | seq 0 (decode) | seq 1 (prompt chunk, 5 tokens) | seq 2 (decode) | ...
           ^ query_start[0] ^ query_start[1]                  ^ query_start[2]

Two paths share one output buffer:
- decodes (query length 1) run as ONE padded SDPA call: each sequence's blocks are gathered
  (whole blocks, a memcpy per block) into [num_decode, max_len, kv_heads, head_dim] and padding
  is masked out. The query's G = num_heads / num_kv_heads heads that share a KV head are laid
  out as G query rows of that KV head, so K/V are never repeated.
- prompts and prompt chunks (query length > 1) run one SDPA call per sequence, causal with the
  chunk's offset into the sequence.
Every index tensor and mask is built once per step in `build_attention_metadata`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class PrefillSpan:
    """A sequence whose query has more than one token this step (a prompt or a prompt chunk)."""

    token_start: int  # first row of the flat batch
    token_end: int  # one past the last row
    kv_len: int  # tokens of this sequence in the cache after this step
    block_ids: Tensor  # [ceil(kv_len / block_size)] int64
    mask: Tensor | None  # [query_len, kv_len] bool (True: attend); None: plain causal (no prefix)


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step, built once and shared by all layers."""

    slot_mapping: Tensor  # [T] int64, flat KV slot of each token
    block_tables: Tensor  # [S, max_blocks] int64, padded with 0
    seq_lens: Tensor  # [S] int64, tokens in the cache for each sequence after this step
    query_start: Tensor  # [S + 1] int64, cumulative query lengths
    query_lens_list: list[int]
    seq_lens_list: list[int]
    block_size: int
    # --- fast path: decodes batched into one call ---
    num_decode: int = 0
    decode_rows: slice | None = None  # rows of the decodes when contiguous (the common case)
    decode_token_index: Tensor | None = None  # [num_decode] int64 rows, when not contiguous
    decode_block_ids: Tensor | None = None  # [num_decode * max_decode_blocks] int64
    decode_mask: Tensor | None = None  # [num_decode, 1, 1, max_decode_blocks * block_size] bool
    # --- per-sequence path ---
    prefills: list[PrefillSpan] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_list)


def build_attention_metadata(
    num_computed_tokens: list[int],
    query_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> tuple[Tensor, AttentionMetadata]:
    """Flatten one step's sequences into positions [T] int64 and the shared metadata.

    Sequence i computes `query_lens[i]` new tokens at positions
    `num_computed_tokens[i] .. num_computed_tokens[i] + query_lens[i] - 1`; its block table
    must cover all of them (it may hold extra trailing blocks, which are ignored).
    """
    num_seqs = len(query_lens)
    assert len(num_computed_tokens) == num_seqs and len(block_tables) == num_seqs
    assert num_seqs > 0, "a step needs at least one sequence"
    seq_lens = [nc + q for nc, q in zip(num_computed_tokens, query_lens)]
    for i, (q, seq_len, table) in enumerate(zip(query_lens, seq_lens, block_tables)):
        if q < 1:
            raise ValueError(f"query_lens[{i}] must be >= 1, got {q}")
        if len(table) * block_size < seq_len:
            raise ValueError(
                f"block_tables[{i}] holds {len(table)} blocks of {block_size}, "
                f"too few for {seq_len} tokens"
            )

    query_start = [0]
    for q in query_lens:
        query_start.append(query_start[-1] + q)
    positions: list[int] = []
    slots: list[int] = []
    for nc, seq_len, table in zip(num_computed_tokens, seq_lens, block_tables):
        for p in range(nc, seq_len):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
    max_blocks = max(len(t) for t in block_tables)
    padded_tables = [t + [0] * (max_blocks - len(t)) for t in block_tables]

    def as_tensor(values: list[int] | list[list[int]]) -> Tensor:
        return torch.tensor(values, dtype=torch.int64).to(device)

    meta = AttentionMetadata(
        slot_mapping=as_tensor(slots),  # [T]
        block_tables=as_tensor(padded_tables),  # [S, max_blocks]
        seq_lens=as_tensor(seq_lens),  # [S]
        query_start=as_tensor(query_start),  # [S + 1]
        query_lens_list=list(query_lens),
        seq_lens_list=seq_lens,
        block_size=block_size,
    )

    decode_seqs = [i for i in range(num_seqs) if query_lens[i] == 1]
    if decode_seqs:
        rows = [query_start[i] for i in decode_seqs]
        meta.num_decode = len(decode_seqs)
        if rows[-1] - rows[0] == len(rows) - 1:  # consecutive rows: a slice, no gather/scatter
            meta.decode_rows = slice(rows[0], rows[-1] + 1)
        else:
            meta.decode_token_index = as_tensor(rows)  # [num_decode]
        decode_lens = [seq_lens[i] for i in decode_seqs]
        max_decode_blocks = (max(decode_lens) + block_size - 1) // block_size
        ids = [
            (block_tables[i] + [0] * max_decode_blocks)[:max_decode_blocks] for i in decode_seqs
        ]
        meta.decode_block_ids = as_tensor(ids).view(-1)  # [num_decode * max_decode_blocks]
        kv_pos = torch.arange(max_decode_blocks * block_size, device=device)  # [L_pad]
        lens = as_tensor(decode_lens)  # [num_decode]
        meta.decode_mask = (kv_pos[None, :] < lens[:, None])[:, None, None, :]  # [Sd, 1, 1, L_pad]

    for i in range(num_seqs):
        if query_lens[i] == 1:
            continue
        q, seq_len = query_lens[i], seq_lens[i]
        num_blocks = (seq_len + block_size - 1) // block_size
        mask = None
        if num_computed_tokens[i] > 0:  # chunk after a cached prefix: causal, offset
            q_pos = torch.arange(num_computed_tokens[i], seq_len, device=device)  # [q]
            kv_pos = torch.arange(seq_len, device=device)  # [seq_len]
            mask = kv_pos[None, :] <= q_pos[:, None]  # [q, seq_len]
        meta.prefills.append(
            PrefillSpan(
                token_start=query_start[i],
                token_end=query_start[i + 1],
                kv_len=seq_len,
                block_ids=as_tensor(block_tables[i][:num_blocks]),  # [num_blocks]
                mask=mask,
            )
        )
    return as_tensor(positions), meta  # positions: [T]


def write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Store this step's keys/values in their slots.

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] (contiguous), written in place.
    k, v: [T, num_kv_heads, head_dim] (any strides); slot_mapping: [T] int64.
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)  # [slots, Hkv, D]
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)  # [slots, Hkv, D]


def paged_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float
) -> Tensor:
    """Causal attention of each sequence's queries over its own cached tokens.

    q: [T, num_heads, head_dim] (any strides; rows in flat-batch order) -> [T, num_heads, head_dim].
    The caches must already hold this step's K/V (call write_kv first).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    if meta.num_decode == num_tokens:  # decode-only step: the output is the SDPA result itself
        return _decode_attention(q, k_cache, v_cache, meta, scale).view(num_tokens, num_heads, head_dim)

    out = q.new_empty(num_tokens, num_heads, head_dim)  # [T, H, D]
    if meta.num_decode:
        if meta.decode_rows is not None:
            q_dec = q[meta.decode_rows]  # [Sd, H, D]
        else:
            q_dec = q.index_select(0, meta.decode_token_index)  # [Sd, H, D]
        o_dec = _decode_attention(q_dec, k_cache, v_cache, meta, scale)  # [Sd, Hkv, G, D]
        o_dec = o_dec.view(meta.num_decode, num_heads, head_dim)  # [Sd, H, D]
        if meta.decode_rows is not None:
            out[meta.decode_rows] = o_dec
        else:
            out.index_copy_(0, meta.decode_token_index, o_dec)

    for span in meta.prefills:
        num_q = span.token_end - span.token_start
        k = k_cache.index_select(0, span.block_ids).view(-1, num_kv_heads, head_dim)  # [nb*bs, Hkv, D]
        v = v_cache.index_select(0, span.block_ids).view(-1, num_kv_heads, head_dim)  # [nb*bs, Hkv, D]
        # G query heads per KV head; K/V broadcast over G with a zero stride (no copy).
        k = k[: span.kv_len].permute(1, 0, 2)[:, None].expand(-1, group, -1, -1)  # [Hkv, G, L, D]
        v = v[: span.kv_len].permute(1, 0, 2)[:, None].expand(-1, group, -1, -1)  # [Hkv, G, L, D]
        q_span = q[span.token_start : span.token_end]  # [q, H, D]
        q_span = q_span.reshape(num_q, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, q, D]
        o = F.scaled_dot_product_attention(
            q_span, k, v, attn_mask=span.mask, is_causal=span.mask is None, scale=scale
        )  # [Hkv, G, q, D]
        out_span = out[span.token_start : span.token_end]  # [q, H, D]
        out_span.view(num_q, num_kv_heads, group, head_dim).copy_(o.permute(2, 0, 1, 3))
    return out


def _decode_attention(
    q_dec: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float
) -> Tensor:
    """All query-length-1 sequences in one padded SDPA call.

    q_dec: [Sd, H, D] -> [Sd, Hkv, G, D] (contiguous; viewing it as [Sd, H, D] is head order).
    """
    num_decode, num_heads, head_dim = q_dec.shape
    num_kv_heads = k_cache.shape[2]
    assert meta.decode_block_ids is not None and meta.decode_mask is not None
    # Whole blocks are gathered (block_size * Hkv * D contiguous elements each), not slots.
    k = k_cache.index_select(0, meta.decode_block_ids).view(num_decode, -1, num_kv_heads, head_dim)  # [Sd, L, Hkv, D]
    v = v_cache.index_select(0, meta.decode_block_ids).view(num_decode, -1, num_kv_heads, head_dim)  # [Sd, L, Hkv, D]
    # The G query heads of one KV head act as G query rows against that head's keys.
    q_rows = q_dec.reshape(num_decode, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [Sd, Hkv, G, D]
    return F.scaled_dot_product_attention(
        q_rows, k.transpose(1, 2), v.transpose(1, 2), attn_mask=meta.decode_mask, scale=scale
    )  # [Sd, Hkv, G, D]


def naive_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float
) -> Tensor:
    """Reference for paged_attention: per sequence, gather K/V slot by slot from its block
    table, explicit causal softmax in fp32, no SDPA. Same contract as paged_attention."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    k_slots = k_cache.reshape(-1, num_kv_heads, head_dim)  # [num_slots, Hkv, D]
    v_slots = v_cache.reshape(-1, num_kv_heads, head_dim)  # [num_slots, Hkv, D]
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)  # [T, H, D]
    start = 0
    for i, (num_q, seq_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        pos = torch.arange(seq_len, device=q.device)  # [L]
        slots = meta.block_tables[i][pos // block_size] * block_size + pos % block_size  # [L]
        k = k_slots[slots].float().repeat_interleave(group, dim=1)  # [L, H, D]
        v = v_slots[slots].float().repeat_interleave(group, dim=1)  # [L, H, D]
        qi = q[start : start + num_q].float()  # [q, H, D]
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale  # [H, q, L]
        q_pos = torch.arange(seq_len - num_q, seq_len, device=q.device)  # [q]
        causal = pos[None, :] <= q_pos[:, None]  # [q, L]
        scores = scores.masked_fill(~causal[None], float("-inf"))  # [H, q, L]
        probs = torch.softmax(scores, dim=-1)  # [H, q, L]
        out[start : start + num_q] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)  # [q, H, D]
        start += num_q
    return out
