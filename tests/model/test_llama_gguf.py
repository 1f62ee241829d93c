"""Our Llama on the default GGUF model against transformers' own model loaded from the same
file (its GGUF loader dequantizes and un-permutes independently of ours), float32."""

from __future__ import annotations

import pytest
import torch

from backfill.model.llama import LlamaForCausalLM
from backfill.model.loader import load_model
from backfill.tokenizer import Tokenizer
from tests.model.paged_driver import PagedDriver

# Logits are O(10-30); the two fp32 implementations differ only in op order and fusion
# (measured max difference ~6e-5 over prefill + 20 decode steps).
LOGITS_ATOL = 3e-4
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
    engine_model: LlamaForCausalLM, hf_model: torch.nn.Module, prompt_ids: list[list[int]]
) -> None:
    """Prefill (in two chunks) then 20 greedy decode steps through our paged cache, three
    sequences sharing every step; then one transformers forward over each final sequence must
    give the same logits at every position we computed, and the same greedy tokens."""
    check_matches_transformers(engine_model, hf_model, prompt_ids, LOGITS_ATOL)


def check_matches_transformers(model: LlamaForCausalLM, hf_model: torch.nn.Module, prompts: list[list[int]],
                               atol: float) -> None:
    """The comparison above for `model` on any device (transformers' model stays on the CPU)."""
    driver = PagedDriver(model, num_blocks=64, block_size=16, seed=1)
    names = [f"s{i}" for i in range(len(prompts))]
    # Step 1: first half of each prompt. Step 2: the rest (chunked prefill over a cached prefix).
    halves = [len(p) // 2 for p in prompts]
    driver.step([(n, p[:h]) for n, p, h in zip(names, prompts, halves)])
    logits = driver.step([(n, p[h:]) for n, p, h in zip(names, prompts, halves)])  # [S, vocab]
    ours: list[list[torch.Tensor]] = [[row] for row in logits]
    sequences = [list(p) for p in prompts]
    for _ in range(NUM_DECODE_STEPS):  # all sequences decode together: one batched group
        next_tokens = [int(row[-1].argmax()) for row in ours]
        for seq, token in zip(sequences, next_tokens):
            seq.append(token)
        logits = driver.step([(n, [t]) for n, t in zip(names, next_tokens)])
        for row, new in zip(ours, logits):
            row.append(new)

    for i, (p, seq) in enumerate(zip(prompts, sequences)):
        ref = hf_model(torch.tensor([seq])).logits[0, len(p) - 1 :]  # [1 + steps, vocab]
        got = torch.stack(ours[i]).cpu()  # [1 + steps, vocab]
        err = (got - ref).abs().max().item()
        assert err < atol, f"sequence {i}: max |ours - transformers| = {err}"
        # greedy choices agree at every step (the next token fed was our argmax)
        assert got.argmax(-1).tolist() == ref.argmax(-1).tolist()


@torch.inference_mode()
def test_logits_are_float32_one_row_per_sequence(our_model: LlamaForCausalLM) -> None:
    driver = PagedDriver(our_model, num_blocks=8, block_size=16)
    logits = driver.step([("a", [1, 2, 3, 4]), ("b", [5, 6])])
    assert logits.shape == (2, 49152) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


@pytest.fixture(scope="module")
def bf16_model() -> LlamaForCausalLM:
    return load_model(None, torch.bfloat16, torch.device("cpu"))


@torch.inference_mode()
def test_bfloat16_model_tracks_float32(
    our_model: LlamaForCausalLM, bf16_model: LlamaForCausalLM, prompt_ids: list[list[int]]
) -> None:
    """The production dtype: bf16 weights, activations and KV cache stay close to fp32
    (bf16 keeps ~3 significant digits, so only a loose agreement is expected)."""
    check_bfloat16_tracks_float32(our_model, bf16_model, prompt_ids)


def check_bfloat16_tracks_float32(our_model: LlamaForCausalLM, bf16_model: LlamaForCausalLM,
                                  prompt_ids: list[list[int]]) -> None:
    """The comparison above, for the two models on any one device."""
    assert bf16_model.embed_tokens.weight.dtype == torch.bfloat16
    rows: dict[str, torch.Tensor] = {}
    tokens: list[list[int]] = []  # fp32's greedy first tokens, fed to both models
    for name, model in (("fp32", our_model), ("bf16", bf16_model)):
        driver = PagedDriver(model, num_blocks=32, block_size=16, seed=4)
        first = driver.step([(f"s{i}", p) for i, p in enumerate(prompt_ids)])  # [S, vocab]
        tokens = tokens or [[int(t)] for t in first.argmax(-1)]
        second = driver.step([(f"s{i}", t) for i, t in enumerate(tokens)])  # [S, vocab]
        rows[name] = torch.cat([first, second])  # [2S, vocab]
        assert rows[name].dtype == torch.float32
    cos = torch.nn.functional.cosine_similarity(rows["fp32"], rows["bf16"], dim=-1)  # [2S]
    agree = (rows["fp32"].argmax(-1) == rows["bf16"].argmax(-1)).float().mean().item()
    assert cos.min().item() > 0.995, cos  # measured >= 0.9997
    assert agree >= 0.5


@torch.inference_mode()
def test_bfloat16_top_logits_use_fp32_sums(bf16_model: LlamaForCausalLM, tokenizer: Tokenizer) -> None:
    """bf16 logits near 25 are 0.125 apart; the top candidates are recomputed with fp32 sums,
    so a 0.05 lead survives. Regression: this prompt's first token is a near-tie
    ("The" 25.51 vs "L" 25.46 from bf16 hidden states) that bf16 rounding turned into "L"."""
    hidden = torch.randn(4, 576, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    logits = bf16_model.compute_logits(hidden)  # [4, vocab]
    exact = hidden.float() @ bf16_model.embed_tokens.weight.float().t()  # [4, vocab]
    top = exact.topk(4, dim=-1).indices  # [4, 4]
    torch.testing.assert_close(logits.gather(1, top), exact.gather(1, top), atol=1e-3, rtol=0)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))

    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    answer = PagedDriver(bf16_model, num_blocks=8, block_size=16).greedy([tokenizer.encode(chat)], 6)[0]
    assert tokenizer.decode(answer).startswith("The capital of France is Paris")
