"""Config parsing, and the GGUF reader against gguf.GGUFReader."""

from __future__ import annotations

import math

import numpy as np
import pytest

from backfill.model import loader
from backfill.model.config import ModelConfig
from backfill.model.layers import rope_attention_factor
from backfill.model_files import default_model_path


def test_gguf_reader_matches_gguf_package() -> None:
    """Our fast reader sees the same metadata and the same raw tensor bytes as GGUFReader."""
    from gguf import GGUFReader

    path = default_model_path()
    ours = loader._GGUFFile(path)
    ref = GGUFReader(path)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
            assert key not in ours.metadata  # skipped on purpose (the tokenizer reads them)
            continue
        assert ours.metadata[key] == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for info, tensor in zip(ours.tensors, ref.tensors):
        data = ours.tensor_data(info)
        assert info.ggml_type == int(tensor.tensor_type)
        assert data.shape == tensor.data.shape and data.dtype == tensor.data.dtype
        assert np.array_equal(data, tensor.data), info.name


def test_unpermute_inverts_llama_cpp_permute() -> None:
    import torch

    heads, head_dim, hidden = 3, 8, 5
    w = torch.randn(heads * head_dim, hidden)
    # llama.cpp convert_hf_to_gguf.py: LlamaModel.permute
    permuted = w.reshape(heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(w.shape)
    out = torch.empty_like(w)
    loader._copy_unpermuted(out, permuted, heads)
    assert torch.equal(out, w)


def test_preferred_dtype_follows_native_bf16_support(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    cpu = torch.device("cpu")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert loader.preferred_dtype(cpu) == torch.float32
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert loader.preferred_dtype(cpu) == torch.bfloat16


def test_config_from_hf_variants() -> None:
    base = {
        "model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4,
    }
    c = ModelConfig.from_hf_config(base)
    assert (c.num_kv_heads, c.head_dim, c.rope_theta, c.rope_scaling) == (4, 16, 10000.0, None)
    assert c.eos_token_ids == () and not c.attention_bias and not c.tie_word_embeddings
    legacy = ModelConfig.from_hf_config(
        {**base, "rope_theta": 5e5, "eos_token_id": [7, 9], "rope_scaling": {"type": "linear", "factor": 2.0}}
    )
    assert legacy.rope_theta == 5e5 and legacy.eos_token_ids == (7, 9)
    assert legacy.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    v5 = ModelConfig.from_hf_config({**base, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}})
    assert v5.rope_theta == 1e6 and v5.rope_scaling is None
    assert ModelConfig.from_hf_config({**base, "model_type": "qwen2"}).attention_bias
    # sliding windows: Mistral's is honoured; llama has none; Qwen2's per-layer one is refused
    assert ModelConfig.from_hf_config({**base, "model_type": "mistral", "sliding_window": 4096}).sliding_window == 4096
    assert ModelConfig.from_hf_config({**base, "model_type": "mistral", "sliding_window": None}).sliding_window is None
    assert c.sliding_window is None and ModelConfig.from_hf_config({**base, "sliding_window": 8}).sliding_window is None
    qwen_window = {**base, "model_type": "qwen2", "sliding_window": 4096}
    assert ModelConfig.from_hf_config(qwen_window).sliding_window is None  # use_sliding_window defaults off
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelConfig.from_hf_config({**qwen_window, "use_sliding_window": True})
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf_config({**base, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope_type"):
        ModelConfig.from_hf_config({**base, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}})
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig.from_hf_config({**base, "num_key_value_heads": 3})


def test_config_from_gguf_metadata_rope_scaling() -> None:
    meta = {
        "general.architecture": "qwen2", "qwen2.embedding_length": 64, "qwen2.attention.head_count": 4,
        "qwen2.vocab_size": 100, "qwen2.feed_forward_length": 128, "qwen2.block_count": 2,
        "qwen2.context_length": 131072, "qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
        "qwen2.rope.scaling.original_context_length": 32768,
    }
    c = ModelConfig.from_gguf_metadata(meta, {"blk.0.attn_q.bias"})
    assert c.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert c.attention_bias and c.max_position_embeddings == 131072
    no_factor = {k: v for k, v in meta.items() if k != "qwen2.rope.scaling.factor"}
    assert ModelConfig.from_gguf_metadata(no_factor, set()).rope_scaling == {
        "rope_type": "yarn", "original_max_position_embeddings": 32768}
    assert rope_attention_factor(ModelConfig.from_gguf_metadata(no_factor, set())) == pytest.approx(
        0.1 * math.log(4.0) + 1.0)  # factor: 131072 / 32768
    linear = ModelConfig.from_gguf_metadata({**meta, "qwen2.rope.scaling.type": "linear"}, set())
    assert linear.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    with pytest.raises(ValueError, match="longrope"):
        ModelConfig.from_gguf_metadata({**meta, "qwen2.rope.scaling.type": "longrope"}, set())
