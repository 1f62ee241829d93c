"""Our Llama on the default GGUF model against transformers' own model loaded from the same
file (its GGUF loader dequantizes and un-permutes independently of ours), float32."""

from __future__ import annotations

import torch

from backfill.model.llama import LlamaForCausalLM
from tests.model.paged_driver import PagedDriver

# Logits are O(10-30); fp32 paths that differ only in op order and fusion agree to ~1e-4.
LOGITS_ATOL = 1e-3
NUM_DECODE_STEPS = 20


def test_config_read_from_gguf_metadata(our_model: LlamaForCausalLM) -> None:
    c = our_model.config
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.rope_theta == 100000.0 and c.rope_scaling is None
    assert c.tie_word_embeddings and our_model.lm_head is None
    assert c.max_position_embeddings == 8192 and c.eos_token_ids == (2,) and c.bos_token_id == 1
    assert abs(c.rms_norm_eps - 1e-5) < 1e-9


@torch.inference_mode()
def test_prefill_and_decode_logits_match_transformers(
    our_model: LlamaForCausalLM, hf_model: torch.nn.Module, prompt_ids: list[list[int]]
) -> None:
    """Prefill (in two chunks) then 20 decode steps through our paged cache, with two other
    sequences sharing the batch; every step's logits are compared with transformers' logits
    for the same position of the same token sequence."""
    prompts = prompt_ids
    # Reference continuation: transformers' own greedy tokens, then one full forward.
    ref_tokens = []
    ref_logits = []
    for p in prompts:
        out = hf_model.generate(torch.tensor([p]), max_new_tokens=NUM_DECODE_STEPS, do_sample=False)
        full = out[0].tolist()
        ref_tokens.append(full)
        ref_logits.append(hf_model(torch.tensor([full])).logits[0])  # [len, vocab]

    driver = PagedDriver(our_model, num_blocks=64, block_size=16, seed=1)
    names = [f"s{i}" for i in range(len(prompts))]
    # Step 1: first half of each prompt (chunks). Step 2: the rest (chunked prefill over a cache).
    halves = [len(p) // 2 for p in prompts]
    driver.step([(n, p[:h]) for n, p, h in zip(names, prompts, halves)])
    logits = driver.step([(n, p[h:]) for n, p, h in zip(names, prompts, halves)])  # [S, vocab]
    for step in range(NUM_DECODE_STEPS + 1):
        for i, p in enumerate(prompts):
            pos = len(p) - 1 + step  # logits row of the token just fed
            expected = ref_logits[i][pos]
            err = (logits[i] - expected).abs().max().item()
            assert err < LOGITS_ATOL, f"seq {i} step {step}: max |ours - hf| = {err}"
            assert int(logits[i].argmax()) == int(expected.argmax())
        if step == NUM_DECODE_STEPS:
            break
        # All sequences decode together: one batched decode group.
        logits = driver.step([(n, [ref_tokens[i][len(prompts[i]) + step]]) for i, n in enumerate(names)])


@torch.inference_mode()
def test_forward_returns_normed_hidden_and_logits_only_for_given_rows(our_model: LlamaForCausalLM) -> None:
    driver = PagedDriver(our_model, num_blocks=8, block_size=16)
    logits = driver.step([("a", [1, 2, 3, 4]), ("b", [5, 6])])
    assert logits.shape == (2, 49152) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
