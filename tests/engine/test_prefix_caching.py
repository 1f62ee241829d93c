"""Acceptance: prefix caching does not change greedy outputs (float32), alone, batched and under
preemption, with a shared prefix that ends inside a block; cached tokens are reported."""

from __future__ import annotations

import pytest

from backfill.engine.llm import LLM
from backfill.sampling_params import SamplingParams
from tests.prompts import make_prompts

BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(llm_fp32: LLM) -> list[list[int]]:
    """Six prompts sharing a system prompt whose length is not a multiple of the block size,
    then user turns of different lengths (token ids, so the shared prefix is exact)."""
    system = llm_fp32.tokenizer.encode("You are a helpful assistant. Answer briefly and precisely. " * 4)
    system = system[: (len(system) // BLOCK_SIZE) * BLOCK_SIZE + 5]  # ends 5 tokens into a block
    users = [llm_fp32.tokenizer.encode(text) for text in make_prompts(6, seed=3)]
    return [system + user[: 8 + 7 * i] for i, user in enumerate(users)]


@pytest.fixture(scope="module")
def expected(prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt alone, prefix caching off."""
    llm = LLM(dtype="float32", max_num_seqs=8, enable_prefix_caching=False)
    return [llm.generate([prompt], GREEDY)[0].token_ids for prompt in prompts]


def _check(llm: LLM, outputs: list, expected: list[list[int]]) -> None:  # type: ignore[type-arg]
    assert [output.token_ids for output in outputs] == expected
    kv = llm.engine.scheduler.kv_cache_manager
    kv.check_integrity()
    assert kv.num_used_blocks == 0


def test_alone_with_caching_hits_and_matches(llm_fp32: LLM, prompts: list[list[int]],
                                             expected: list[list[int]]) -> None:
    outputs = [llm_fp32.generate([prompt], GREEDY)[0] for prompt in prompts]
    _check(llm_fp32, outputs, expected)
    shared_blocks = (len(prompts[0]) - 8) // BLOCK_SIZE
    for output in outputs[1:]:  # the shared prefix's full blocks at least, in whole blocks
        assert output.num_cached_tokens >= shared_blocks * BLOCK_SIZE
        assert output.num_cached_tokens % BLOCK_SIZE == 0 and output.num_cached_tokens < len(output.prompt_token_ids)
    # The same prompt again: everything but its last (partial) block's tokens is cached.
    again = llm_fp32.generate([prompts[3]], GREEDY)[0]
    assert again.token_ids == expected[3]
    assert again.num_cached_tokens == (len(prompts[3]) - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_batched_with_caching_matches(llm_fp32: LLM, prompts: list[list[int]], expected: list[list[int]]) -> None:
    _check(llm_fp32, llm_fp32.generate(prompts, GREEDY), expected)


def test_cold_cache_batched_and_preempted_matches(prompts: list[list[int]], expected: list[list[int]]) -> None:
    # 14 blocks cannot hold six ~60-100-token sequences at once: preemption, and resumption
    # from blocks cached before it; no prompt budget, so prompts are admitted together.
    llm = LLM(dtype="float32", max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=14, prefill_budget=0)
    _check(llm, llm.generate(prompts, GREEDY), expected)
    assert llm.engine.num_preemptions_total > 0
    _check(llm, llm.generate(prompts, GREEDY), expected)  # warm cache, small pool
