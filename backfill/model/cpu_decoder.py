"""CpuDecoder: the whole decoder stack of one engine step in one C++ call (CPU, fp32 activations).

A drop-in for `LlamaForCausalLM` in the ModelRunner on CPU: the same `forward(input_ids,
positions, kv_caches, meta)` and `compute_logits(hidden_rows)`, the same numbers to fp32
rounding, over KV caches of its own layout (`kv_cache_shapes`: K transposed per block and head). Where LlamaForCausalLM runs ~20 eager ops per layer, this runs
the C++ `FusedDecoder` of backfill/kernels/csrc/decoder.cpp: RMSNorm, the fused qkv linear,
RoPE and the KV write in one pass, paged attention over the caches directly (no gather), the
residual adds inside the o_proj/down GEMMs, SiLU*mul in one pass. Linear weights are read as
stored (GGUF blocks, or fp32) by the packed kernels of qgemm.h.

Weights come as a state dict in our parameter names (see `CpuDecoder.__init__`); a linear is
a `QuantWeight` (quant.py: the file's blocks, row segments of several types where a fused
linear mixes them, e.g. a Q4_K q/k and a Q6_K v) or a dense fp32 tensor (stored as F32 blocks).

Batch invariance: a sequence's logits are bit-identical whether it runs alone or with others,
in any order, on any thread count, and however its tokens arrive (a prompt in one piece or in
chunks of any size, decodes, a preempted request's prompt and generated tokens recomputed as
chunks): the attention's arithmetic per query row is fixed by absolute positions alone (see
kernels/csrc/fused_kernels.h), and every other operation works row by row.
"""

from __future__ import annotations

from collections.abc import Mapping
import torch
from torch import Tensor

from backfill import kernels
from backfill.config import ACTIVATION_QUANTIZATIONS
from backfill.model.attention import AttentionMetadata
from backfill.model.config import ModelConfig
from backfill.model.layers import RotaryEmbedding
from backfill.model.llama import LlamaForCausalLM
from backfill.model.quant import F32, KERNEL_TYPES, QuantSegment, QuantWeight, type_name

LinearWeights = QuantWeight | Tensor


def unsupported_reason(config: ModelConfig) -> str | None:
    """Why CpuDecoder cannot run `config` on this machine, or None when it can."""
    if not kernels.available():
        return "the CPU kernels extension is not available"
    if config.head_dim % 4 != 0:
        return f"head_dim {config.head_dim} is not a multiple of 4"
    return None


class CpuDecoder:
    """LlamaForCausalLM's forward and compute_logits as one fused C++ step per call (CPU).

    Not an nn.Module: it holds packed weights only, and is called by the ModelRunner exactly
    like the model (`decoder(input_ids, positions, kv_caches, meta)`). One step at a time
    (concurrent calls serialize on the C++ side's scratch buffers); the GIL is released while
    a step runs.
    """

    def __init__(self, config: ModelConfig, state: Mapping[str, LinearWeights],
                 activation_quantization: str = "none") -> None:
        """`state`, in our parameter names (loader._fuse's), per layer i:
        `layers.{i}.input_layernorm.weight`, `layers.{i}.post_attention_layernorm.weight`
        fp32 [hidden]; `layers.{i}.self_attn.qkv_proj.weight` (rows [q | k | v], q/k already in
        the rotate-half layout: a llama GGUF's rows unpermuted), optional
        `layers.{i}.self_attn.qkv_proj.bias` fp32 [(H + 2 Hkv) * D] (Qwen2),
        `layers.{i}.self_attn.o_proj.weight`, `layers.{i}.mlp.gate_up_proj.weight` (rows
        [gate | up]), `layers.{i}.mlp.down_proj.weight`; and `embed_tokens.weight`,
        `norm.weight` fp32 [hidden], `lm_head.weight` (untied models only). Linears and the
        embedding are LinearWeights (see the module docstring). `activation_quantization`:
        "none" or "int8", as the property of that name describes."""
        reason = unsupported_reason(config)
        if reason is not None:
            raise RuntimeError(f"CpuDecoder: {reason}")
        ext = kernels.extension()
        assert ext is not None
        self.config = config
        self._rotary = RotaryEmbedding(config)
        # cos, signed_sin [P, D] for positions 0 .. P - 1, grown (doubled) when a step needs more:
        # the C++ step reads rows by position, so a step costs no Python RoPE ops.
        self._rope_cos = torch.empty(0, config.head_dim)
        self._rope_sin = torch.empty(0, config.head_dim)
        self._rope_len = 0  # rows of the tables (read every step: no tensor attribute call)
        self._bound_caches: list[tuple[Tensor, Tensor]] | None = None  # the caches decode runs on
        self._step = ext.FusedDecoder(
            config.vocab_size, config.hidden_size, config.intermediate_size, config.num_heads,
            config.num_kv_heads, config.head_dim, config.rms_norm_eps,
        )
        missing = [name for name in _expected_names(config) if name not in state]
        if missing:
            raise KeyError(f"CpuDecoder: missing weights {missing[:6]}")
        names = ["embed_tokens.weight"] + ([] if config.tie_word_embeddings else ["lm_head.weight"])
        for i in range(config.num_layers):
            names += [f"layers.{i}.{name}" for name in _LAYER_LINEARS]
        packed = dict(zip(names, _pack([state[name] for name in names], ext)))
        embedding = packed["embed_tokens.weight"]
        if len(embedding) != 1:
            raise ValueError("embed_tokens.weight must be a single matrix")
        self._step.set_embedding(embedding[0])
        head = embedding if config.tie_word_embeddings else packed["lm_head.weight"]
        self._step.set_lm_head(head)
        self._step.set_final_norm(_norm(state["norm.weight"]))
        # Bytes of weights every step reads in full: each layer's linears and the LM head (the
        # embedding table is read only at the step's T rows). What `bench roofline` charges.
        self.weight_bytes_per_step = _nbytes(head)
        for i in range(config.num_layers):
            pre = f"layers.{i}."
            bias = state.get(pre + "self_attn.qkv_proj.bias")
            linears = [packed[pre + name] for name in _LAYER_LINEARS]
            self.weight_bytes_per_step += sum(_nbytes(segments) for segments in linears)
            self._step.add_layer(
                _norm(state[pre + "input_layernorm.weight"]),
                _norm(state[pre + "post_attention_layernorm.weight"]),
                linears[0],
                None if bias is None else _norm(bias),  # type: ignore[arg-type]
                *linears[1:],
            )
        self.activation_quantization = activation_quantization

    @property
    def int8_activation_matrices(self) -> int:
        """Row segments of the layers' linears and the LM head that int8 activations apply to
        (the C++ side's count: those of csrc/q8.h's q8_activation_type)."""
        return int(self._step.q8_matrices)

    @property
    def activation_quantization(self) -> str:
        """"int8": the 4-bit linears (Q4_0, Q4_1, Q4_K; the LM head too where it is one) take
        their input quantized to int8 per 32 values (csrc/q8.h; opt-in, not exact); "none": fp32
        throughout. Settable between steps."""
        return "int8" if self._step.q8_activations else "none"

    @activation_quantization.setter
    def activation_quantization(self, mode: str) -> None:
        if mode not in ACTIVATION_QUANTIZATIONS:
            raise ValueError(f"activation_quantization must be one of {ACTIVATION_QUANTIZATIONS}, got {mode!r}")
        self._step.q8_activations = mode == "int8"

    @classmethod
    def from_dense(cls, model: LlamaForCausalLM) -> CpuDecoder:
        """The same model with every weight held as F32 blocks (works for any model folder;
        the dense model may be dropped afterwards). Accepts a prepacked model too."""
        state: dict[str, LinearWeights] = {
            name: p.detach().float() for name, p in model.state_dict().items() if not name.endswith("_proj.weight")
        }
        for i, layer in enumerate(model.layers):
            pre = f"layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            state[pre + "self_attn.qkv_proj.weight"] = attn.qkv_proj.weight
            if attn.qkv_proj.bias is not None:  # a prepacked model's is no state_dict entry
                state[pre + "self_attn.qkv_proj.bias"] = attn.qkv_proj.bias
            state[pre + "self_attn.o_proj.weight"] = attn.o_proj.weight
            state[pre + "mlp.gate_up_proj.weight"] = mlp.gate_up_proj.weight
            state[pre + "mlp.down_proj.weight"] = mlp.down_proj.weight
        if not model.config.tie_word_embeddings:
            head = model.lm_head if model.lm_head is not None else model.packed_lm_head
            assert head is not None
            state["lm_head.weight"] = head.weight
        return cls(model.config, state)

    def forward(
        self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]], meta: AttentionMetadata
    ) -> Tensor:
        """input_ids, positions: [T] int64 -> hidden [T, hidden] fp32 (after the final norm).

        Writes this step's K/V into `kv_caches` (per layer (k, v), each fp32
        [num_blocks, block_size, Hkv, D], contiguous) at `meta.slot_mapping`, as
        LlamaForCausalLM.forward does."""
        return self._run(input_ids, positions, kv_caches, meta, None)

    __call__ = forward

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [S, hidden] (rows already selected) -> logits [S, vocab] float32."""
        return self._step.logits(hidden.float())

    def forward_logits(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[tuple[Tensor, Tensor]],
        meta: AttentionMetadata,
        logits_index: Tensor,
    ) -> Tensor:
        """forward + compute_logits(hidden[logits_index]) in one call: logits [S, vocab] fp32 of
        the rows `logits_index` [S] int64 (the final norm runs on those rows only)."""
        hidden = self._run(input_ids, positions, kv_caches, meta, logits_index)  # [S, hidden]
        return self._step.logits(hidden)

    def decode(
        self,
        token_ids: list[int],
        positions: list[int],
        block_tables: list[list[int]],
        kv_caches: list[tuple[Tensor, Tensor]],
        sliding_window: int | None,
        greedy: bool,
    ) -> tuple[Tensor | None, list[int]]:
        """A step of decodes (one token a sequence, every one sampling) from plain lists, as
        forward_logits over them computes it: sequence i's token token_ids[i] at position
        positions[i], its block table block_tables[i] (its K/V go into the position's slot).
        Returns (logits [S, vocab] fp32, []) or, `greedy`, (None, each row's argmax). No tensor
        is built in Python, nor a list per block: after the weights' stream has left the caches
        cold, each torch call a step makes costs tens of microseconds (a batch-1 step's Python
        took ~0.5 ms), and each line of Python a few."""
        if kv_caches is not self._bound_caches:
            self._step.bind_kv_caches(kv_caches)
            self._bound_caches = kv_caches
        self._ensure_rope(max(positions))
        return self._step.decode(token_ids, positions, block_tables, self._rope_cos, self._rope_sin,
                                 sliding_window or 0, greedy)

    def forward_rows(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                     meta: AttentionMetadata, rows: Tensor) -> Tensor:
        """forward, keeping only the rows `rows` [S] int64: hidden [S, hidden] fp32 (normed),
        for compute_logits to take in parts."""
        return self._run(input_ids, positions, kv_caches, meta, rows)

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shapes of a layer's K and V caches: one panel of block_size x head_dim per block and
        KV head, K as [num_blocks, Hkv, D, block_size] (transposed: a decode's scores read the
        keys of one dimension as consecutive floats), V as [num_blocks, Hkv, block_size, D]
        (LlamaForCausalLM's caches are [num_blocks, block_size, Hkv, D], both; see kv_rows)."""
        heads, dim = self.config.num_kv_heads, self.config.head_dim
        return (num_blocks, heads, dim, block_size), (num_blocks, heads, block_size, dim)

    @staticmethod
    def kv_rows(k_cache: Tensor, v_cache: Tensor) -> tuple[Tensor, Tensor]:
        """A layer's caches as LlamaForCausalLM lays them out, [num_blocks, block_size, Hkv, D]
        each (views, for tests and tools)."""
        return k_cache.permute(0, 3, 1, 2), v_cache.permute(0, 2, 1, 3)

    @staticmethod
    def kv_panels(k_rows: Tensor, v_rows: Tensor) -> tuple[Tensor, Tensor]:
        """kv_rows' inverse: caches laid out as LlamaForCausalLM's, [num_blocks, block_size,
        Hkv, D] each, as contiguous copies in this decoder's layout (tests, benchmarks)."""
        return k_rows.permute(0, 2, 3, 1).contiguous(), v_rows.permute(0, 2, 1, 3).contiguous()

    def make_kv_caches(self, num_blocks: int, block_size: int,
                       dtype: torch.dtype = torch.float32) -> list[tuple[Tensor, Tensor]]:
        """Zeroed per-layer (k_cache, v_cache) pairs, fp32 (or bf16 / fp16 / fp8: kv_cache_dtype), shaped
        as kv_cache_shapes says."""
        k_shape, v_shape = self.kv_cache_shapes(num_blocks, block_size)
        return [(kernels.zeros(k_shape, dtype), kernels.zeros(v_shape, dtype)) for _ in range(self.config.num_layers)]

    @property
    def kv_prefetch_cap(self) -> int:
        """The most bytes of a layer's K/V the step prefetches while the layer before runs its
        o_proj and MLP (by default a quarter of the L3 cache, 1 MB on Intel cores; less where those
        GEMMs leave the memory bus little idle time; 0: none). It changes no result, only where the
        reads wait."""
        return int(self._step.kv_prefetch_cap)

    @kv_prefetch_cap.setter
    def kv_prefetch_cap(self, nbytes: int) -> None:
        self._step.kv_prefetch_cap = nbytes

    @property
    def last_kv_prefetch_blocks(self) -> int:
        """KV blocks the last step prefetched for each layer but the first."""
        return int(self._step.last_kv_prefetch_blocks)

    @property
    def row_shards(self) -> int:
        """How a step's rows meet the threads: -1 (the default) a shard of the sequences per thread,
        each taken through every layer on its own thread, when the step is short queries that split
        evenly (decodes, chunks of up to 16 tokens; at least 6 tokens a thread, and 2 x threads a
        thread on more than 3), else each operation over all the threads; 0 never shards; 1
        shards any step with a sequence per thread. It changes no result, only how often the
        threads meet (once a step instead of ~8 times a layer)."""
        return int(self._step.row_shards)

    @row_shards.setter
    def row_shards(self, mode: int) -> None:
        self._step.row_shards = mode

    @property
    def team_steps(self) -> bool:
        """Whether a step not cut into row shards runs its threads as one team (the default): one
        fork and join a step, each operation cut between the threads, which wait for each other
        at a barrier where the next one reads its output (~5 a layer); else each operation forks
        and joins torch's pool (~5 a layer, a few microseconds each). It changes no result."""
        return bool(self._step.team_steps)

    @team_steps.setter
    def team_steps(self, on: bool) -> None:
        self._step.team_steps = on

    @property
    def last_shards(self) -> int:
        """Shards the last step ran in (1: the whole step, each operation over the threads)."""
        return int(self._step.last_shards)

    def set_profile(self, on: bool) -> None:
        """Start (and zero) or stop the C++ side's timers; see `profile`."""
        self._step.set_profile(on)

    def profile(self) -> dict[str, float]:
        """Seconds spent since set_profile(True) in the linears (LM head included), attention,
        and everything else of the step (norms, RoPE and KV writes, SiLU, embedding)."""
        linear, attention, other = self._step.profile()
        return {"linear": linear, "attention": attention, "other": other}

    @property
    def kernels(self) -> str:
        """The instruction sets the step runs: "<norms, SiLU>/<attention>", e.g. "avx512/avx512",
        and with int8 activations "+int8 x (<their kernels' ISA>)"."""
        ext = kernels.extension()
        assert ext is not None
        suffix = f"+int8 x ({ext.q8_isa()})" if self.activation_quantization == "int8" else ""
        return str(self._step.kernels()) + suffix

    def _run(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[tuple[Tensor, Tensor]],
        meta: AttentionMetadata,
        rows: Tensor | None,
    ) -> Tensor:
        self._ensure_rope(max(meta.seq_lens_list) - 1)  # the last position any token of the step has
        return self._step.forward(
            input_ids.contiguous(),
            positions.contiguous(),
            self._rope_cos,  # [P, D]
            self._rope_sin,  # [P, D]
            kv_caches,
            meta.slot_mapping,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start,
            meta.sliding_window or 0,
            rows,
        )  # [T or S, hidden]

    def _ensure_rope(self, max_position: int) -> None:
        """RoPE tables that reach `max_position`."""
        if max_position >= self._rope_len:
            self._grow_rope_tables(max_position + 1)

    def _grow_rope_tables(self, num_positions: int) -> None:
        size = max(4096, self._rope_cos.shape[0])
        while size < num_positions:
            size *= 2
        cos, signed_sin = self._rotary(torch.arange(size), torch.float32)  # [P, 1, D] each
        self._rope_cos = cos.view(size, -1).contiguous()  # [P, D]
        self._rope_sin = signed_sin.view(size, -1).contiguous()  # [P, D]
        self._rope_len = size


def load_cpu_decoder(model: str | None, quantization: str = "auto") -> CpuDecoder:
    """The model at `model` (model_files.resolve_model_path's rules) as a CpuDecoder, its matrices
    stored as `quantization` says (loader.load_stored_weights): by default a GGUF's as stored,
    a Hugging Face folder's as F32 blocks."""
    from backfill.model.loader import load_stored_weights

    config, state = load_stored_weights(model, quantization)
    return CpuDecoder(config, state)


def _expected_names(config: ModelConfig) -> list[str]:
    names = ["embed_tokens.weight", "norm.weight"] + ([] if config.tie_word_embeddings else ["lm_head.weight"])
    for i in range(config.num_layers):
        pre = f"layers.{i}."
        names += [pre + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                    "self_attn.qkv_proj.weight", "self_attn.o_proj.weight",
                                    "mlp.gate_up_proj.weight", "mlp.down_proj.weight")]
        if config.attention_bias:
            names.append(pre + "self_attn.qkv_proj.bias")
    return names


def _norm(weight: LinearWeights) -> Tensor:
    assert isinstance(weight, Tensor), "norm weights and biases are plain fp32 tensors"
    return weight.detach().to(torch.float32).contiguous()  # [n]


def dense_weight(weight: Tensor) -> QuantWeight:
    """fp32 [rows, cols] (any float dtype is cast) -> one F32 segment (a row is its fp32 bytes)."""
    w = weight.detach().to(torch.float32).contiguous()  # [rows, cols]
    return QuantWeight([QuantSegment(w.view(torch.uint8), F32)], int(w.shape[1]))  # raw: [rows, 4 * cols]


def _nbytes(segments: list[tuple[Tensor, int, int, int]]) -> int:
    return sum(int(packed.numel()) for packed, _, _, _ in segments)


_LAYER_LINEARS = ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight",
                  "mlp.down_proj.weight")


def _pack(linears: list[LinearWeights], ext: object) -> list[list[tuple[Tensor, int, int, int]]]:
    """Linears' weights -> for each, the C++ side's (packed bytes, qtype, rows, cols) row
    segments, all packed into one buffer on transparent huge pages (where the OS has them): a
    step sweeps every weight, and on 4 KiB pages ~25k of them would keep missing the TLB. One
    linear is converted at a time (a dense one's fp32 copy lives only while it is packed)."""
    specs = [_segment_specs(weights) for weights in linears]  # per linear: [(qtype, rows, cols)]
    sizes = [[int(ext.packed_bytes(*spec)) for spec in segments] for segments in specs]  # type: ignore[attr-defined]
    arena = ext.zeros_hugepages(sum(_cache_lines(n) for ns in sizes for n in ns))  # type: ignore[attr-defined]
    out, offset = [], 0
    for weights, ns in zip(linears, sizes, strict=True):
        if isinstance(weights, Tensor):
            weights = dense_weight(weights)
        packed = []
        for segment, n in zip(weights.segments, ns, strict=True):  # sized by _segment_specs
            view = arena[offset:offset + n]  # each segment on a cache line of its own
            raw = segment.raw.contiguous()  # [rows, row_bytes] uint8
            packed.append((ext.repack(raw, segment.qtype, weights.cols, out=view),  # type: ignore[attr-defined]
                           segment.qtype, segment.rows, weights.cols))
            offset += _cache_lines(n)
        out.append(packed)
    return out


def _segment_specs(weights: LinearWeights) -> list[tuple[int, int, int]]:
    """(qtype, rows, cols) of each row segment `_pack` will pack, checked, nothing converted."""
    if isinstance(weights, Tensor):
        rows, cols = weights.shape
        return [(F32, int(rows), int(cols))]
    for segment in weights.segments:
        if segment.qtype not in KERNEL_TYPES:
            raise ValueError(f"{type_name(segment.qtype)} is not read by the packed kernels")
    return [(segment.qtype, segment.rows, weights.cols) for segment in weights.segments]


def _cache_lines(nbytes: int) -> int:
    """`nbytes` rounded up to whole 64-byte lines."""
    return (nbytes + 63) // 64 * 64
