"""Paged attention in plain PyTorch: KV writes through slot_mapping, reads through block tables.

Cache layout, per layer: k_cache, v_cache = [num_blocks, block_size, num_kv_heads, head_dim].
Token `p` of a sequence lives in slot `block_table[p // block_size] * block_size + p % block_size`.

The flat batch of a step holds every scheduled token, sequence after sequence:

    rows:  | seq 0 (decode) | seq 1 (prompt chunk, 5 tokens) | seq 2 (decode) | ...
           ^ query_start[0] ^ query_start[1]                  ^ query_start[2]

Two paths share one output buffer:
- decodes (query length 1) run as a few padded SDPA calls, one per length group (usually one):
  each sequence's blocks are gathered (whole blocks, a memcpy each) into
  [num_seqs, max_len, kv_heads, head_dim] and the padding is masked out. Sequences are grouped
  by length so that one 1000-token sequence does not pad thirty 50-token ones. The G =
  num_heads / num_kv_heads query heads sharing a KV head act as G query rows of that KV head,
  so K/V are never repeated.
- prompts and prompt chunks (query length > 1) run one SDPA call per sequence, causal with the
  chunk's offset into the sequence.
Every index tensor and mask is built once per step in `build_attention_metadata`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor


def additive_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean attention mask (True: attend) as the additive bias SDPA turns it into (0 or
    -inf in `dtype`): the same numbers, so SDPA gives the same bits from either."""
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(~mask, float("-inf"))


class _StepMask:
    """A step's boolean `mask` (None: none) and its additive form, converted by the first layer
    that asks (`attn_bias`) and shared by the others: SDPA converts a boolean mask in every call
    (a scalar tensor and a `where`: kernels of every layer on a GPU)."""

    mask: Tensor | None
    _bias: Tensor | None

    def attn_bias(self, dtype: torch.dtype) -> Tensor | None:
        if self.mask is None:
            return None
        if self._bias is None or self._bias.dtype != dtype:
            self._bias = additive_mask(self.mask, dtype)
        return self._bias


@dataclass
class PrefillSpan(_StepMask):
    """A sequence whose query has more than one token this step (a prompt or a prompt chunk)."""

    token_start: int  # first row of the flat batch
    token_end: int  # one past the last row
    kv_len: int  # tokens of this sequence in the cache after this step
    block_ids: Tensor  # [ceil(kv_len / block_size)] int64
    mask: Tensor | None  # [query_len, kv_len] bool (True: attend); None: plain causal (no prefix)
    _bias: Tensor | None = field(default=None, init=False, repr=False, compare=False)


@dataclass
class DecodeGroup(_StepMask):
    """Query-length-1 sequences attended together in one padded SDPA call."""

    num_seqs: int
    rows: slice | Tensor  # their rows of the flat batch: a slice when consecutive, else [n] int64
    block_ids: Tensor  # [num_seqs * group_blocks] int64, each table cut/padded (block 0) to group_blocks
    mask: Tensor  # [num_seqs, 1, 1, group_blocks * block_size] bool, True below the sequence length
    _bias: Tensor | None = field(default=None, init=False, repr=False, compare=False)


# Cost of one more decode group, in gathered KV slots: a group adds ~5 small kernels per layer
# (~40 us), about what gathering and attending a few hundred padded slots costs on a CPU.
DECODE_GROUP_COST_SLOTS = 512
MAX_DECODE_GROUPS = 4


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
    sliding_window: int | None = None  # each query attends to at most this many positions
    # --- fast path: query-length-1 sequences batched, by length group ---
    num_decode: int = 0
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    # --- per-sequence path ---
    prefills: list[PrefillSpan] = field(default_factory=list)
    # A fixed-shape decode step's attention kernel (model/static_decode.py: flash attention
    # reading the block tables directly), called as fn(q, k_cache, v_cache, scale) in place of
    # the paths above; None: the paths above.
    decode_fn: Callable[[Tensor, Tensor, Tensor, float], Tensor] | None = None
    # Gather buffers reused by every layer of the step (filled in by the first layer).
    # NOTE: a fresh multi-MB tensor per layer costs page faults (glibc hands big blocks back
    # to the OS on free); reusing one buffer made the decode gather ~5x faster on CPU.
    workspace: dict[str, Tensor] = field(default_factory=dict)

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
    sliding_window: int | None = None,
    plan_torch_attention: bool = True,
) -> tuple[Tensor, AttentionMetadata]:
    """Flatten one step's sequences into positions [T] int64 and the shared metadata.

    Sequence i computes `query_lens[i]` new tokens at positions
    `num_computed_tokens[i] .. num_computed_tokens[i] + query_lens[i] - 1`; its block table
    must cover all of them (it may hold extra trailing blocks, which are ignored).
    With `sliding_window` W, the query at position p attends to positions p - W + 1 .. p only
    (the model's ModelConfig.sliding_window). `plan_torch_attention=False` skips the decode
    groups and prompt masks that only `paged_attention` reads (the CPU kernels' step needs the
    tensors alone).
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
    num_tokens = query_start[-1]
    max_blocks = max(len(t) for t in block_tables)
    padded_tables = [t + [0] * (max_blocks - len(t)) for t in block_tables]

    if num_tokens == num_seqs:
        # Decodes only (one token a sequence): lists, then one tensor of every field cut into
        # views, faster than the vectorized path's dozen small tensor ops or a tensor a field
        # (each call costs microseconds, more in a batch-1 step whose Python runs with the caches
        # cold from the weights' stream).
        slots = decode_slots(block_tables, num_computed_tokens, block_size)
        flat = torch.tensor(num_computed_tokens + slots + seq_lens + query_start
                            + [block for table in padded_tables for block in table], dtype=torch.int64)
        cpu_positions, cpu_slots, cpu_seq_lens, cpu_query_start, cpu_tables = flat.split(
            [num_tokens, num_tokens, num_seqs, num_seqs + 1, num_seqs * max_blocks])  # [T], [T], [S], [S + 1], ...
        cpu_tables = cpu_tables.view(num_seqs, max_blocks)  # [S, max_blocks]
    else:
        cpu_tables = torch.tensor(padded_tables, dtype=torch.int64)  # [S, max_blocks]
        cpu_query_start = torch.tensor(query_start, dtype=torch.int64)  # [S + 1]
        cpu_seq_lens = torch.tensor(seq_lens, dtype=torch.int64)  # [S]
        # Positions and slots are computed vectorized on the host (a Python loop over the tokens
        # took ~10 ms for a 2k-token step), then moved to the device in one copy each.
        seq_of_token = torch.repeat_interleave(
            torch.arange(num_seqs), torch.tensor(query_lens), output_size=num_tokens
        )  # [T]
        offset = torch.tensor(num_computed_tokens, dtype=torch.int64) - cpu_query_start[:-1]  # [S]
        cpu_positions = torch.arange(num_tokens, dtype=torch.int64) + offset[seq_of_token]  # [T]
        block_of_token = cpu_tables[seq_of_token, cpu_positions // block_size]  # [T]
        cpu_slots = block_of_token * block_size + cpu_positions % block_size  # [T]

    def as_tensor(values: list[int] | list[list[int]]) -> Tensor:
        return torch.tensor(values, dtype=torch.int64).to(device)

    def to_device(t: Tensor) -> Tensor:  # (on the CPU, not even a no-op call)
        return t if device.type == "cpu" else t.to(device)

    meta = AttentionMetadata(
        slot_mapping=to_device(cpu_slots),  # [T]
        block_tables=to_device(cpu_tables),  # [S, max_blocks]
        seq_lens=to_device(cpu_seq_lens),  # [S]
        query_start=to_device(cpu_query_start),  # [S + 1]
        query_lens_list=list(query_lens),
        seq_lens_list=seq_lens,
        block_size=block_size,
        sliding_window=sliding_window,
    )

    if not plan_torch_attention:
        return to_device(cpu_positions), meta  # positions: [T]
    decode_seqs = [i for i in range(num_seqs) if query_lens[i] == 1]
    meta.num_decode = len(decode_seqs)
    for group in _group_by_length(decode_seqs, seq_lens, block_size):
        rows = [query_start[i] for i in group]
        group_blocks = (max(seq_lens[i] for i in group) + block_size - 1) // block_size
        ids = cpu_tables[torch.tensor(group), :group_blocks]  # [n, group_blocks], 0-padded
        lens = as_tensor([seq_lens[i] for i in group])  # [n]
        visible = decode_visible(lens, group_blocks * block_size, sliding_window)  # [n, L_pad]
        meta.decode_groups.append(
            DecodeGroup(
                num_seqs=len(group),
                rows=(
                    slice(rows[0], rows[-1] + 1)
                    if rows[-1] - rows[0] == len(rows) - 1
                    else as_tensor(rows)  # [n]
                ),
                block_ids=ids.reshape(-1).to(device),  # [n * group_blocks]
                mask=visible[:, None, None, :],  # [n, 1, 1, L_pad]
            )
        )

    for i in range(num_seqs):
        if query_lens[i] == 1:
            continue
        q, seq_len = query_lens[i], seq_lens[i]
        num_blocks = (seq_len + block_size - 1) // block_size
        mask = None
        windowed = sliding_window is not None and seq_len > sliding_window
        if num_computed_tokens[i] > 0 or windowed:  # a chunk after a cached prefix, or a window
            q_pos = torch.arange(num_computed_tokens[i], seq_len, device=device)  # [q]
            kv_pos = torch.arange(seq_len, device=device)  # [seq_len]
            mask = kv_pos[None, :] <= q_pos[:, None]  # [q, seq_len]
            if windowed:
                mask &= kv_pos[None, :] > q_pos[:, None] - sliding_window
        meta.prefills.append(
            PrefillSpan(
                token_start=query_start[i],
                token_end=query_start[i + 1],
                kv_len=seq_len,
                block_ids=as_tensor(block_tables[i][:num_blocks]),  # [num_blocks]
                mask=mask,
            )
        )
    return to_device(cpu_positions), meta  # positions: [T]


def decode_slots(block_tables: Sequence[Sequence[int]], positions: Sequence[int], block_size: int) -> list[int]:
    """The KV slot of each sequence's token at positions[i], through its block table."""
    return [table[p // block_size] * block_size + p % block_size for table, p in zip(block_tables, positions)]


def decode_visible(seq_lens: Tensor, padded_len: int, sliding_window: int | None) -> Tensor:
    """Which of `padded_len` gathered key slots each decode query attends to: seq_lens [n]
    (tokens in the cache, the query's own included: it sits at position seq_len - 1)
    -> [n, padded_len] bool. Device ops only (no host sync), so a CUDA graph can capture it."""
    kv_pos = torch.arange(padded_len, device=seq_lens.device)  # [L_pad]
    visible = kv_pos[None, :] < seq_lens[:, None]  # [n, L_pad]
    if sliding_window is not None:
        visible &= kv_pos[None, :] >= seq_lens[:, None] - sliding_window
    return visible


def _group_by_length(seqs: list[int], seq_lens: list[int], block_size: int) -> list[list[int]]:
    """Split `seqs` into at most MAX_DECODE_GROUPS runs of the length-sorted order, cutting
    greedily where a cut saves the most padded slots (each group pads to its longest member),
    as long as it saves more than DECODE_GROUP_COST_SLOTS. Members keep batch order."""
    if not seqs:
        return []
    order = sorted(seqs, key=lambda i: seq_lens[i])
    padded = [-(-seq_lens[i] // block_size) * block_size for i in order]  # ascending
    runs = [(0, len(order))]  # [start, end) ranges of `order`
    while len(runs) < MAX_DECODE_GROUPS:
        best_saving, best_run, best_cut = float(DECODE_GROUP_COST_SLOTS), -1, -1
        for r, (a, b) in enumerate(runs):
            for c in range(a + 1, b):
                if padded[c - 1] == padded[c]:
                    continue  # a cut between equal lengths saves nothing
                saving = (c - a) * (padded[b - 1] - padded[c - 1])
                if saving > best_saving:
                    best_saving, best_run, best_cut = saving, r, c
        if best_run < 0:
            break
        a, b = runs[best_run]
        runs[best_run : best_run + 1] = [(a, best_cut), (best_cut, b)]
    return [sorted(order[a:b]) for a, b in runs]


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# The narrow cache types whose range is short of the activations': a K or V past it is stored as
# the type's largest finite value (as the CPU kernels store it), not as an infinity or (E4M3) a NaN.
_CLAMPED_CACHE_DTYPES = (torch.float16, *_FP8_DTYPES)


def _copyable(t: Tensor) -> Tensor:
    """t, or its bytes where it is fp8 (torch's index_copy_ / index_select have no fp8 kernels
    on the CPU): the same bits moved."""
    return t.view(torch.uint8) if t.dtype in _FP8_DTYPES else t


def as_cache_elements(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x as a KV cache of `dtype` holds it (kv_cache_dtype): rounded to nearest even by .to(),
    clamped first where the type's range is short; x itself where it is already `dtype`."""
    if x.dtype == dtype:
        return x
    if dtype in _CLAMPED_CACHE_DTYPES:
        limit = torch.finfo(dtype).max
        x = x.clamp(-limit, limit)
    return x.to(dtype)


def write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Store this step's keys/values in their slots (as the caches' dtype holds them:
    as_cache_elements).

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] (contiguous), written in place.
    k, v: [T, num_kv_heads, head_dim] (any strides); slot_mapping: [T] int64.
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k, v = as_cache_elements(k, k_cache.dtype), as_cache_elements(v, v_cache.dtype)
    _copyable(k_cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, _copyable(k))  # [slots, Hkv, D]
    _copyable(v_cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, _copyable(v))  # [slots, Hkv, D]


def paged_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float
) -> Tensor:
    """Causal attention of each sequence's queries over its own cached tokens.

    q: [T, num_heads, head_dim] (any strides; rows in flat-batch order) -> [T, num_heads, head_dim].
    The caches must already hold this step's K/V (call write_kv first).
    """
    if meta.decode_fn is not None:
        return meta.decode_fn(q, k_cache, v_cache, scale)  # [T, H, D]
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    groups = meta.decode_groups
    if len(groups) == 1 and groups[0].num_seqs == num_tokens:
        # decode-only step in one group, rows 0..T-1 in order: the SDPA output is the result
        o = _decode_attention(q, k_cache, v_cache, groups[0], meta.workspace, scale)  # [T, Hkv, G, D]
        return o.reshape(num_tokens, num_heads, head_dim)  # a view where SDPA's output is contiguous

    out = q.new_empty(num_tokens, num_heads, head_dim)  # [T, H, D]
    for dg in groups:
        if isinstance(dg.rows, slice):
            q_dec = q[dg.rows]  # [n, H, D]
        else:
            q_dec = q.index_select(0, dg.rows)  # [n, H, D]
        o = _decode_attention(q_dec, k_cache, v_cache, dg, meta.workspace, scale)  # [n, Hkv, G, D]
        o = o.reshape(dg.num_seqs, num_heads, head_dim)  # [n, H, D]
        if isinstance(dg.rows, slice):
            out[dg.rows] = o
        else:
            out.index_copy_(0, dg.rows, o)

    for span in meta.prefills:
        num_q = span.token_end - span.token_start
        k = _gather_blocks(k_cache, span.block_ids, meta.workspace, "k").to(q.dtype)  # [nb, bs, Hkv, D]
        v = _gather_blocks(v_cache, span.block_ids, meta.workspace, "v").to(q.dtype)  # [nb, bs, Hkv, D]
        k = k.view(-1, num_kv_heads, head_dim)  # [nb * bs, Hkv, D]
        v = v.view(-1, num_kv_heads, head_dim)  # [nb * bs, Hkv, D]
        # G query heads per KV head; K/V broadcast over G with a zero stride (no copy).
        k = k[: span.kv_len].permute(1, 0, 2)[:, None].expand(-1, group, -1, -1)  # [Hkv, G, L, D]
        v = v[: span.kv_len].permute(1, 0, 2)[:, None].expand(-1, group, -1, -1)  # [Hkv, G, L, D]
        q_span = q[span.token_start : span.token_end]  # [q, H, D]
        q_span = q_span.reshape(num_q, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, q, D]
        o = F.scaled_dot_product_attention(
            q_span, k, v, attn_mask=span.attn_bias(q.dtype), is_causal=span.mask is None, scale=scale
        )  # [Hkv, G, q, D]
        out_span = out[span.token_start : span.token_end]  # [q, H, D]
        out_span.view(num_q, num_kv_heads, group, head_dim).copy_(o.permute(2, 0, 1, 3))
    return out


def _gather_blocks(cache: Tensor, block_ids: Tensor, workspace: dict[str, Tensor], key: str) -> Tensor:
    """cache [num_blocks, bs, Hkv, D] -> its rows block_ids [n] as [n, bs, Hkv, D], written into
    the step's reusable buffer `workspace[key]` (grown when too small). The result is only
    valid until the next gather with the same key."""
    num_blocks = block_ids.shape[0]
    numel = num_blocks * cache.stride(0)  # cache is contiguous: stride(0) = bs * Hkv * D
    buf = workspace.get(key)
    if buf is None or buf.numel() < numel or buf.dtype != cache.dtype or buf.device != cache.device:
        buf = cache.new_empty(numel)  # [numel]
        workspace[key] = buf
    out = buf[:numel].view(num_blocks, *cache.shape[1:])  # [n, bs, Hkv, D]
    torch.index_select(_copyable(cache), 0, block_ids, out=_copyable(out))
    return out


def _decode_attention(
    q_dec: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    dg: DecodeGroup,
    workspace: dict[str, Tensor],
    scale: float,
) -> Tensor:
    """One decode group in one padded SDPA call.

    q_dec: [n, H, D] -> [n, Hkv, G, D] (contiguous; viewed as [n, H, D] it is in head order).
    """
    num_seqs, num_heads, head_dim = q_dec.shape
    num_kv_heads = k_cache.shape[2]
    # (a cache of another dtype, kv_cache_dtype: its elements widened exactly to q's)
    k = _gather_blocks(k_cache, dg.block_ids, workspace, "k").to(q_dec.dtype)  # [n * blocks, bs, Hkv, D]
    v = _gather_blocks(v_cache, dg.block_ids, workspace, "v").to(q_dec.dtype)  # [n * blocks, bs, Hkv, D]
    k = k.view(num_seqs, -1, num_kv_heads, head_dim)  # [n, L, Hkv, D]
    v = v.view(num_seqs, -1, num_kv_heads, head_dim)  # [n, L, Hkv, D]
    # The G query heads of one KV head act as G query rows against that head's keys.
    q_rows = q_dec.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [n, Hkv, G, D]
    return F.scaled_dot_product_attention(
        q_rows, k.transpose(1, 2), v.transpose(1, 2), attn_mask=dg.attn_bias(q_dec.dtype), scale=scale
    )  # [n, Hkv, G, D]


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
        if meta.sliding_window is not None:
            causal &= pos[None, :] > q_pos[:, None] - meta.sliding_window
        scores = scores.masked_fill(~causal[None], float("-inf"))  # [H, q, L]
        probs = torch.softmax(scores, dim=-1)  # [H, q, L]
        out[start : start + num_q] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)  # [q, H, D]
        start += num_q
    return out
