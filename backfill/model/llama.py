"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) over a flattened, paged batch.

One forward runs every scheduled token of a step at once: each linear layer is one matmul over
all T tokens (selective batching); only attention looks at sequences, through
AttentionMetadata. Parameter names follow Hugging Face's with q/k/v and gate/up fused
(`qkv_proj`, `gate_up_proj`); the loader fuses them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backfill.model.attention import AttentionMetadata, paged_attention, write_kv
from backfill.model.config import ModelConfig
from backfill.model.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP, apply_rope
from backfill.model.prepack import PackedLinear, prepack_linears

# Logits per row recomputed with fp32 sums when the model runs in bf16/fp16 (see compute_logits).
LOGITS_REFINE_TOP_K = 8


class VocabEmbedding(nn.Module):
    """Token id -> row of `weight`.

    NOTE: initialized with uniform_, not nn.Embedding's normal_: the first normal_ on the meta
    device (where the loader builds the model) costs a second of imports.
    """

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size).uniform_(-1.0, 1.0))  # [vocab, hidden]

    def forward(self, input_ids: Tensor) -> Tensor:
        # input_ids: [T] -> [T, hidden]
        return F.embedding(input_ids, self.weight)


class LlamaAttention(nn.Module):
    """Fused q/k/v projection, RoPE, paged KV write and read, output projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        # rows: [q (H*D) | k (Hkv*D) | v (Hkv*D)]
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        signed_sin: Tensor,
        kv_cache: tuple[Tensor, Tensor],
        meta: AttentionMetadata,
    ) -> Tensor:
        # x: [T, hidden]; cos, signed_sin: [T, 1, D] -> [T, hidden]
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) * D]
        qk_size = self.q_size + self.kv_size
        num_qk_heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, :qk_size].view(num_tokens, num_qk_heads, self.head_dim)  # [T, H + Hkv, D]
        qk = apply_rope(qk, cos, signed_sin)  # [T, H + Hkv, D], q and k rotated in one pass
        q = qk[:, : self.num_heads]  # [T, H, D]
        k = qk[:, self.num_heads :]  # [T, Hkv, D]
        v = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        k_cache, v_cache = kv_cache  # [num_blocks, block_size, Hkv, D] each
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        attn = paged_attention(q, k_cache, v_cache, meta, self.scale)  # [T, H, D]
        return self.o_proj(attn.reshape(num_tokens, self.q_size))  # [T, hidden]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        signed_sin: Tensor,
        kv_cache: tuple[Tensor, Tensor],
        meta: AttentionMetadata,
    ) -> Tensor:
        # x: [T, hidden] -> [T, hidden]
        h = self.self_attn(self.input_layernorm(x), cos, signed_sin, kv_cache, meta)  # [T, hidden]
        x = x + h  # [T, hidden]
        h = self.mlp(self.post_attention_layernorm(x))  # [T, hidden]
        return x + h  # [T, hidden]


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head. `forward` returns final-normed hidden states for every token;
    `compute_logits` applies the LM head to the rows the caller selects (the last token of
    each sequence), so the 49k-wide matmul never runs over whole prompts."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        # Tied models read the LM head from embed_tokens.weight (no second copy).
        self.lm_head: nn.Linear | None = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.packed_lm_head: PackedLinear | None = None  # set by prepack_weights()

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[tuple[Tensor, Tensor]],
        meta: AttentionMetadata,
    ) -> Tensor:
        """input_ids, positions: [T] int64 -> hidden [T, hidden] (after the final norm).

        Writes this step's K/V into `kv_caches` (one (k, v) pair per layer, each
        [num_blocks, block_size, num_kv_heads, head_dim]) at `meta.slot_mapping`.
        """
        assert len(kv_caches) == len(self.layers), "one (k_cache, v_cache) pair per layer"
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos, signed_sin = self.rotary_emb(positions, x.dtype)  # [T, 1, D] each
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, cos, signed_sin, kv_cache, meta)  # [T, hidden]
        return self.norm(x)  # [T, hidden]

    def forward_logits(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[tuple[Tensor, Tensor]],
        meta: AttentionMetadata,
        logits_index: Tensor,
    ) -> Tensor:
        """forward, then compute_logits on the rows `logits_index` [S] int64 -> [S, vocab] fp32."""
        hidden = self(input_ids, positions, kv_caches, meta)  # [T, hidden]
        return self.compute_logits(hidden[logits_index])  # [S, vocab]

    def forward_rows(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                     meta: AttentionMetadata, rows: Tensor) -> Tensor:
        """forward, keeping only the rows `rows` [S] int64: hidden [S, hidden] (for
        compute_logits to take in parts)."""
        return self(input_ids, positions, kv_caches, meta)[rows]

    @property
    def weight_bytes_per_step(self) -> int:
        """Bytes of weights a step reads in full: every linear and the LM head (the embedding
        table only at the step's rows); a prepacked model's dense copies are not counted."""
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        linears = sum(p.numel() * p.element_size() for name, p in self.layers.named_parameters()
                      if name.endswith("proj.weight"))
        packed = sum(m.weight.numel() * m.weight.element_size() for m in self.layers.modules()
                     if isinstance(m, PackedLinear))
        return linears + packed + head.numel() * head.element_size()

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [S, hidden] (rows already selected) -> logits [S, vocab] float32.

        In bf16/fp16 the LM head matmul rounds its fp32 sums to the model dtype: at a logit of
        25 a bf16 step is 0.125, enough to turn a 0.08 lead into a tie (SmolLM2 answering
        "What is the capital of France?" starts with "The" in fp32 and "L" in bf16). The top
        LOGITS_REFINE_TOP_K logits of each row are therefore recomputed from the same inputs
        with fp32 sums, so greedy choices and the head of the sampling distribution are exact.
        """
        if self.packed_lm_head is not None:  # fp32 only: no refinement needed
            return self.packed_lm_head(hidden)  # [S, vocab]
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight  # [vocab, hidden]
        logits = F.linear(hidden, weight).float()  # [S, vocab]
        if hidden.dtype in (torch.bfloat16, torch.float16):
            top = logits.topk(LOGITS_REFINE_TOP_K, dim=-1).indices  # [S, K]
            rows = weight[top].float()  # [S, K, hidden]
            exact = torch.bmm(rows, hidden.float()[:, :, None])[:, :, 0]  # [S, K]
            logits.scatter_(1, top, exact)
        return logits

    def prepack_weights(self) -> int:
        """CPU fp32: hold every linear weight, the LM head's included, in oneDNN's packed layout
        (see backfill/model/prepack.py), beside the dense one. A tied head gets a packed copy of
        the embedding; an untied head moves into `packed_lm_head` (`lm_head` becomes None).
        Returns the number of matrices packed."""
        count = prepack_linears(self.layers)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight  # [vocab, hidden]
        self.packed_lm_head = PackedLinear(weight, None)
        self.lm_head = None
        return count + 1

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shapes of a layer's K and V caches: [num_blocks, block_size, Hkv, D] both."""
        shape = (num_blocks, block_size, self.config.num_kv_heads, self.config.head_dim)
        return shape, shape

    @staticmethod
    def kv_rows(k_cache: Tensor, v_cache: Tensor) -> tuple[Tensor, Tensor]:
        """A layer's caches as [num_blocks, block_size, Hkv, D] each: as they are (see CpuDecoder)."""
        return k_cache, v_cache

    def make_kv_caches(self, num_blocks: int, block_size: int) -> list[tuple[Tensor, Tensor]]:
        """Zeroed per-layer (k_cache, v_cache) pairs, [num_blocks, block_size, Hkv, D] each, in
        the model's dtype and device (the layout the ModelRunner allocates; for tests and tools)."""
        weight = self.embed_tokens.weight  # [vocab, hidden]
        shape, _ = self.kv_cache_shapes(num_blocks, block_size)

        def zeros() -> Tensor:
            return torch.zeros(shape, dtype=weight.dtype, device=weight.device)  # [blocks, bs, Hkv, D]

        return [(zeros(), zeros()) for _ in self.layers]
