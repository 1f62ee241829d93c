"""GGUF files written here from tiny random transformers models (llama with an untied output
and q/k permuted the way llama.cpp's converter does; qwen2 with q/k/v biases, not permuted):
our GGUF loader must rebuild a model whose logits match the source model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from backfill.model.loader import load_model
from tests.model.paged_driver import PagedDriver

SMALL = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-5, tie_word_embeddings=False,
)
LOGITS_ATOL = 1e-4


def llama_cpp_permute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py LlamaModel.permute: rotate-half rows -> interleaved pairs."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model: torch.nn.Module, arch: str, path: Path) -> None:
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_eos_token_id(7)
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    permute = arch == "llama"

    def add(name: str, t: torch.Tensor) -> None:
        writer.add_tensor(name, np.ascontiguousarray(t.numpy()))

    add("token_embd.weight", state["model.embed_tokens.weight"])
    add("output_norm.weight", state["model.norm.weight"])
    add("output.weight", state["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        pre, blk = f"model.layers.{i}.", f"blk.{i}."
        for kind in ("weight", "bias"):
            q, k = state.get(f"{pre}self_attn.q_proj.{kind}"), state.get(f"{pre}self_attn.k_proj.{kind}")
            if q is None:
                continue
            add(f"{blk}attn_q.{kind}", llama_cpp_permute(q, cfg.num_attention_heads) if permute else q)
            add(f"{blk}attn_k.{kind}", llama_cpp_permute(k, cfg.num_key_value_heads) if permute else k)
            add(f"{blk}attn_v.{kind}", state[f"{pre}self_attn.v_proj.{kind}"])
        add(f"{blk}attn_output.weight", state[f"{pre}self_attn.o_proj.weight"])
        add(f"{blk}attn_norm.weight", state[f"{pre}input_layernorm.weight"])
        add(f"{blk}ffn_norm.weight", state[f"{pre}post_attention_layernorm.weight"])
        add(f"{blk}ffn_gate.weight", state[f"{pre}mlp.gate_proj.weight"])
        add(f"{blk}ffn_up.weight", state[f"{pre}mlp.up_proj.weight"])
        add(f"{blk}ffn_down.weight", state[f"{pre}mlp.down_proj.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@torch.inference_mode()
def test_written_gguf_round_trips(arch: str, tmp_path: Path) -> None:
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    torch.manual_seed(0)
    ref = model_cls(config_cls(**SMALL)).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(ref, arch, path)

    ours = load_model(str(path), torch.float32, torch.device("cpu"))
    c = ours.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (2, 4, 2, 16, 300)
    assert not c.tie_word_embeddings and c.attention_bias == (arch == "qwen2") and c.eos_token_ids == (7,)

    ids = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    driver = PagedDriver(ours, num_blocks=8, block_size=8)
    got = [driver.step([("a", ids[:20])])[0]]
    got += [driver.step([("a", [t])])[0] for t in ids[20:]]
    expected = ref(torch.tensor([ids])).logits[0, 19:]  # [5, vocab]
    err = (torch.stack(got) - expected).abs().max().item()
    assert err < LOGITS_ATOL, f"{arch}: max |ours - source model| = {err}"
