"""Greedy continuations from our model (batched, paged) equal transformers' generate()."""

from __future__ import annotations

import torch

from backfill.model.llama import LlamaForCausalLM
from tests.model.paged_driver import PagedDriver

NUM_NEW_TOKENS = 32


@torch.inference_mode()
def test_greedy_matches_transformers_generate(
    engine_model: LlamaForCausalLM, hf_model: torch.nn.Module, prompt_ids: list[list[int]]
) -> None:
    # min_new_tokens makes transformers mask the eos logits until 32 tokens exist; we mask the
    # same ids so both sides produce exactly 32 tokens.
    eos_ids = hf_model.generation_config.eos_token_id
    eos_ids = tuple(eos_ids) if isinstance(eos_ids, list) else (eos_ids,)
    assert eos_ids == engine_model.config.eos_token_ids
    expected = []
    for p in prompt_ids:
        out = hf_model.generate(
            torch.tensor([p]), max_new_tokens=NUM_NEW_TOKENS, min_new_tokens=NUM_NEW_TOKENS,
            do_sample=False,
        )
        expected.append(out[0, len(p):].tolist())
    # All three prompts share every step; prompts enter in chunks of 8 tokens, so steps mix
    # chunked prefills with decodes once the shortest prompt is in.
    ours = PagedDriver(engine_model, num_blocks=48, block_size=8, seed=2).greedy(
        prompt_ids, NUM_NEW_TOKENS, chunk=8, suppress_token_ids=eos_ids
    )
    for i, (got, want) in enumerate(zip(ours, expected)):
        assert len(got) == len(want) == NUM_NEW_TOKENS
        first_diff = next((j for j, (x, y) in enumerate(zip(got, want)) if x != y), None)
        assert first_diff is None, f"prompt {i}: first different token at {first_diff}"
