"""Tiny random-weight Hugging Face folders (llama, qwen2, tied, Llama-3 rope scaling): our
loader + model against transformers' own model on the same folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backfill import kernels
from backfill.model.config import ModelConfig
from backfill.model.cpu_decoder import CpuDecoder, load_cpu_decoder
from backfill.model.layers import compute_inv_freq, rope_attention_factor
from backfill.model.llama import LlamaForCausalLM
from backfill.model.loader import load_model, load_stored_weights
from backfill.model.quant import F16, Q8_0, QuantWeight
from backfill.model_files import read_model_config
from tests.model.paged_driver import PagedDriver

LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
SMALL = dict(
    vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
)
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
VARIANTS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rms_norm_eps=1e-5, rope_theta=10000.0)),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "llama3_rope": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1000000.0, num_key_value_heads=4)),
    "qwen2_yarn": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1000000.0, rope_scaling=YARN_ROPE)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, head_dim=16)),
    # a window shorter than the test's sequences (70, 33 tokens) and its 40-token prefill chunk
    "mistral_window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=16, head_dim=16)),
}
LOGITS_ATOL = 1e-4  # fp32, logits O(1) from a random model


def save_tiny(kind: str, folder: Path) -> torch.nn.Module:
    import transformers

    config_name, model_name, extra = VARIANTS[kind]
    config = getattr(transformers, config_name)(**{**SMALL, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # random biases and norm weights, so loading them is checked too
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.0, 0.5 if name.endswith("bias") else 0.2).add_(0.0 if name.endswith("bias") else 1.0)
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("path", ["dense", "prepacked", "kernels"])
@pytest.mark.parametrize("kind", sorted(VARIANTS))
@torch.inference_mode()
def test_tiny_folder_logits_match_transformers(kind: str, path: str, tmp_path: Path) -> None:
    ref_model = save_tiny(kind, tmp_path)
    ours: LlamaForCausalLM | CpuDecoder
    if path == "kernels":  # the default CPU path: the fused step, the folder's weights as F32 blocks
        if not kernels.available():
            pytest.skip("the CPU kernels extension is not available")
        ours = load_cpu_decoder(str(tmp_path))
    else:
        ours = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
        if path == "prepacked":  # oneDNN-packed weights (q/k/v biases and untied heads too)
            ours.prepack_weights()
    assert ours.config.tie_word_embeddings == (kind == "llama_tied")
    assert ours.config.attention_bias == kind.startswith("qwen2")
    assert read_model_config(str(tmp_path)) == ours.config  # what a front end reads, without torch
    gen = torch.Generator().manual_seed(1)
    # Long enough to pass original_max_position_embeddings (32) for the llama3 variant.
    seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (70, 9, 33)]
    driver = PagedDriver(ours, num_blocks=40, block_size=8, seed=3)
    # prefill all but the last 4 tokens (the longest in two chunks), then decode 4 steps
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    prefix = [len(s) - 4 for s in seqs]
    driver.step([(f"s{i}", s[: min(p, 40)]) for i, (s, p) in enumerate(zip(seqs, prefix))])
    logits = driver.step([(f"s{i}", s[min(p, 40) : p]) for i, (s, p) in enumerate(zip(seqs, prefix)) if p > 40])
    got[0].append(logits[0])
    for step in range(4):
        logits = driver.step([(f"s{i}", [s[p + step]]) for i, (s, p) in enumerate(zip(seqs, prefix))])
        for i in range(len(seqs)):
            got[i].append(logits[i])
    for i, (s, p) in enumerate(zip(seqs, prefix)):
        ref = ref_model(torch.tensor([s])).logits[0]  # [len, vocab]
        rows = list(range(p - 1, len(s))) if i == 0 else list(range(p, len(s)))
        expected = ref[rows]  # [n, vocab]
        err = (torch.stack(got[i]) - expected).abs().max().item()
        assert err < LOGITS_ATOL, f"{kind} seq {i}: max |ours - transformers| = {err}"


@pytest.mark.parametrize(("quantization", "qtype"), [("int8", Q8_0), ("fp16", F16)])
@torch.inference_mode()
def test_weight_only_quantization_of_a_folder(quantization: str, qtype: int, tmp_path: Path) -> None:
    """`quantization="int8"|"fp16"`: every matrix of a Hugging Face folder stored as Q8_0 blocks /
    fp16, read as stored by the fused step, which then computes what the reference model
    computes over the same (dequantized) weights; and stays close to the fp32 original."""
    if not kernels.available():
        pytest.skip("the CPU kernels extension is not available")
    save_tiny("qwen2", tmp_path)  # q/k/v bias and an untied head: every kind of matrix
    config, state = load_stored_weights(str(tmp_path), quantization)
    matrices = {name: w for name, w in state.items() if isinstance(w, QuantWeight)}
    assert len(matrices) == 4 * config.num_layers + 2  # + embedding and untied LM head
    assert all(seg.qtype == qtype for w in matrices.values() for seg in w.segments)
    fp32 = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    reference = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    params = dict(reference.named_parameters())
    for name, w in matrices.items():
        params[name].copy_(w.dequantize())
    stored_bytes = sum(w.nbytes for w in matrices.values())
    fp32_bytes = sum(params[name].numel() * 4 for name in matrices)
    assert stored_bytes < fp32_bytes * (0.3 if qtype == Q8_0 else 0.51)  # 8.5 / 16 bits a weight
    seqs = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (21, 7)]
    logits = {}
    for label, model in (("stored", CpuDecoder(config, state)), ("reference", reference), ("fp32", fp32)):
        driver = PagedDriver(model, num_blocks=16, block_size=8, seed=1)
        logits[label] = torch.cat([driver.step([("a", seqs[0]), ("b", seqs[1])]),
                                   driver.step([("a", [5]), ("b", [6])])])  # [4, vocab]
    assert (logits["stored"] - logits["reference"]).abs().max().item() < LOGITS_ATOL
    scale = logits["fp32"].abs().max().item()
    assert (logits["stored"] - logits["fp32"]).abs().max().item() < 0.05 * scale  # weight-only rounding


@pytest.mark.parametrize("extra", [
    {},
    {"beta_fast": 16, "beta_slow": 2, "truncate": False},
    {"mscale": 1.0, "mscale_all_dim": 0.5},
    {"attention_factor": 1.25},
], ids=["defaults", "betas_untruncated", "mscale", "attention_factor"])
def test_yarn_inv_freq_and_attention_factor_match_transformers(extra: dict) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = LlamaConfig(**{**SMALL, "rope_theta": 10000.0, "rope_scaling": {**YARN_ROPE, **extra}})
    expected, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, torch.device("cpu"))
    config = ModelConfig.from_hf_config(hf_config.to_dict())
    assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "yarn"
    torch.testing.assert_close(compute_inv_freq(config), expected, atol=0, rtol=0)
    assert rope_attention_factor(config) == pytest.approx(attention_factor, rel=1e-12)
    assert attention_factor != 1.0


def test_llama3_inv_freq_matches_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = LlamaConfig(**{**SMALL, "rope_theta": 500000.0, "rope_scaling": dict(LLAMA3_ROPE)})
    expected, attention_scaling = ROPE_INIT_FUNCTIONS["llama3"](hf_config, torch.device("cpu"))
    config = ModelConfig.from_hf_config(hf_config.to_dict())
    assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "llama3"
    got = compute_inv_freq(config)
    assert attention_scaling == 1.0
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    # the scaling actually changes something: long wavelengths are slowed down by `factor`
    unscaled = {"rope_theta": 500000.0, "rope_type": "default"}
    plain = compute_inv_freq(ModelConfig.from_hf_config({**hf_config.to_dict(), "rope_parameters": unscaled}))
    assert torch.allclose(got[-1], plain[-1] / 8.0) and got[0] == plain[0]
