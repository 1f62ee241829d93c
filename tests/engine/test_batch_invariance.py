"""Acceptance: a request's greedy output does not depend on its companions (float32)."""

from __future__ import annotations

import random

import pytest

from backfill.engine.llm import LLM
from backfill.sampling_params import SamplingParams
from tests.prompts import make_prompts

NUM_REQUESTS = 32


@pytest.fixture(scope="module")
def workload() -> tuple[list[str], list[SamplingParams]]:
    rng = random.Random(1)
    prompts = make_prompts(NUM_REQUESTS, seed=1)
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(2, 16), ignore_eos=True) for _ in prompts]
    return prompts, params


@pytest.fixture(scope="module")
def alone(llm_fp32: LLM, workload: tuple[list[str], list[SamplingParams]]) -> list[list[int]]:
    prompts, params = workload
    return [llm_fp32.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]


def _check_together(llm: LLM, workload: tuple[list[str], list[SamplingParams]], alone: list[list[int]]) -> None:
    prompts, params = workload
    outputs = llm.generate(prompts, params)
    for i, (output, expected) in enumerate(zip(outputs, alone)):
        assert output.token_ids == expected, f"request {i} differs when batched"
        assert output.finish_reason == "length"
    kv = llm.engine.scheduler.kv_cache_manager
    kv.check_integrity()
    assert kv.num_used_blocks == 0


def test_alone_vs_batched(llm_fp32: LLM, workload, alone) -> None:
    _check_together(llm_fp32, workload, alone)
    # Everything ran at once: more than one sequence per step on average.
    assert llm_fp32.engine.last_step_stats is not None


def test_alone_vs_batched_chunked_prefill(workload, alone) -> None:
    llm = LLM(dtype="float32", max_num_seqs=32, max_num_batched_tokens=16)
    prompts, _ = workload
    assert max(len(llm.tokenizer.encode(p)) for p in prompts) > 16  # chunking really happens
    _check_together(llm, workload, alone)


def test_alone_vs_batched_small_prompt_budget(workload, alone) -> None:
    """Prompts chunked by the prompt budget beside decoding streams (chunks of 1-3 tokens)."""
    llm = LLM(dtype="float32", max_num_seqs=32, prefill_budget=3)
    _check_together(llm, workload, alone)


def test_alone_vs_batched_with_preemption(workload, alone) -> None:
    # 40 blocks of 16 tokens cannot hold 32 requests of ~30-200 tokens at once. No prompt
    # budget: prompts are admitted as fast as the token budget allows, so the pool overflows.
    llm = LLM(dtype="float32", max_num_seqs=32, max_num_batched_tokens=256, num_kv_blocks=40, prefill_budget=0)
    _check_together(llm, workload, alone)
    assert llm.engine.num_preemptions_total > 0


@pytest.mark.parametrize("static_padding", [True, False], ids=["padded", "compact"])
def test_static_policy_same_outputs(workload, alone, static_padding: bool) -> None:
    """Static batches, with finished slots computed as padding rows or skipped: same tokens."""
    llm = LLM(dtype="float32", policy="static", max_num_seqs=8, max_num_batched_tokens=512,
              static_padding=static_padding)
    padding_rows: list[int] = []
    engine_step = llm.engine.step

    def step():  # record every step's padding rows
        result = engine_step()
        padding_rows.append(llm.engine.last_step_stats.num_padding_tokens)
        return result

    llm.engine.step = step  # type: ignore[method-assign]
    _check_together(llm, workload, alone)
    assert (sum(padding_rows) > 0) == static_padding
