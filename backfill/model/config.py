"""ModelConfig: the architecture of a Llama-family decoder, one frozen dataclass.

Built from a Hugging Face `config.json` dict (llama, mistral, qwen2) or from GGUF metadata
(`from_gguf_metadata`); the model code reads nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# HF `model_type` values this decoder implements. Mistral is llama with an optional sliding
# attention window; qwen2 is llama with a q/k/v bias.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2")
# RoPE variants implemented by layers.compute_inv_freq.
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn", "freq_factors")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of one Llama-family decoder.

    `rope_scaling` is None for plain RoPE, else a dict with a `rope_type` key:
    `{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}`, `{"rope_type": "linear", "factor"}`,
    `{"rope_type": "yarn", "factor", "original_max_position_embeddings", optional "beta_fast",
    "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate"}`, or (from GGUF
    files, whose converter stores the Llama-3 factors as a tensor)
    `{"rope_type": "freq_factors", "freq_factors": [head_dim // 2 floats]}`.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Each position attends to itself and the sliding_window - 1 positions before it (Mistral
    # v0.1: 4096); None attends over the whole context.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive integer or None, got {self.sliding_window!r}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"rope_scaling: rope_type {rope_type!r} is not supported "
                    f"(supported: {SUPPORTED_ROPE_TYPES})"
                )

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face `config.json` dict (transformers 4.x or 5.x layout)."""
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})"
            )
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {d.get('hidden_act')!r} is not supported (only silu)")
        num_heads = int(d["num_attention_heads"])
        hidden_size = int(d["hidden_size"])
        # transformers 5 moved rope_theta and the scaling dict into `rope_parameters`.
        rope_params: dict[str, Any] = dict(d.get("rope_parameters") or {})
        legacy_scaling: dict[str, Any] = dict(d.get("rope_scaling") or {})
        rope_theta = float(rope_params.get("rope_theta", d.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in {**legacy_scaling, **rope_params}.items() if k != "rope_theta"}
        if "type" in scaling and "rope_type" not in scaling:  # transformers 4.x spelling
            scaling["rope_type"] = scaling.pop("type")
        rope_scaling = scaling if scaling.get("rope_type", "default") != "default" else None
        eos = d.get("eos_token_id")
        eos_ids: tuple[int, ...] = (
            () if eos is None else tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)
        )
        bos = d.get("bos_token_id")
        head_dim = d.get("head_dim") or hidden_size // num_heads
        sliding_window = d.get("sliding_window") if model_type == "mistral" else None
        if model_type == "qwen2" and d.get("use_sliding_window"):
            # Qwen2 windows only the layers past max_window_layers: per-layer windows, not built.
            raise ValueError("use_sliding_window: Qwen2's per-layer sliding window is not supported")
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 always has a q/k/v bias and its config.json does not say so.
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            sliding_window=None if sliding_window is None else int(sliding_window),
        )

    @classmethod
    def from_gguf_metadata(
        cls, meta: dict[str, Any], tensor_names: set[str], freq_factors: list[float] | None = None
    ) -> ModelConfig:
        """Read GGUF key/value metadata (already decoded to Python values).

        `tensor_names` decides tied embeddings (no `output.weight`) and the q/k/v bias;
        `freq_factors` is the content of a `rope_freqs.weight` tensor, if the file has one.
        """
        arch = str(meta["general.architecture"])
        if arch not in ("llama", "qwen2", "mistral"):
            raise ValueError(f"GGUF architecture {arch!r} is not supported (llama, qwen2, mistral)")

        def key(name: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{name}", default)

        hidden_size = int(key("embedding_length"))
        num_heads = int(key("attention.head_count"))
        vocab_size = key("vocab_size")
        if vocab_size is None:
            vocab_size = len(meta["tokenizer.ggml.tokens"])
        rope_scaling: dict[str, Any] | None = None
        if freq_factors is not None:
            rope_scaling = {"rope_type": "freq_factors", "freq_factors": list(freq_factors)}
        elif key("rope.scaling.type") == "linear":
            rope_scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
        elif key("rope.scaling.type") == "yarn":  # llama.cpp's keys for it
            rope_scaling = {"rope_type": "yarn"}
            if key("rope.scaling.factor") is not None:  # else the context extension ratio stands in
                rope_scaling["factor"] = float(key("rope.scaling.factor"))
            if key("rope.scaling.original_context_length") is not None:
                rope_scaling["original_max_position_embeddings"] = int(key("rope.scaling.original_context_length"))
        elif key("rope.scaling.type") not in (None, "none"):
            raise ValueError(f"GGUF rope scaling {key('rope.scaling.type')!r} is not supported")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        bos = meta.get("tokenizer.ggml.bos_token_id")
        return cls(
            vocab_size=int(vocab_size),
            hidden_size=hidden_size,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(key("attention.head_count_kv", num_heads)),
            head_dim=int(key("attention.key_length", hidden_size // num_heads)),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(key("context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=() if eos is None else (int(eos),),
        )
