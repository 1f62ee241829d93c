"""`SamplingParams.prompt_logprobs`: the logprobs of a prompt's own tokens.

The check needs no reference model: a sequence's logprobs of the tokens it generated must be
those of the same tokens read back as a prompt (the same positions over the same context: the
kernels give every row the same sums whatever the step, so they match to the bit). Then the
same holds in chunks of a few tokens, beside other requests, with the prompt in the prefix
cache (skipped for such a request) and under preemption (recomputed, never repeated).
"""

from __future__ import annotations

import pytest

from backfill.core.outputs import TokenLogprobs
from backfill.engine.llm import LLM
from backfill.outputs import RequestOutput
from backfill.sampling_params import SamplingParams
from tests.prompts import make_prompts

NUM_TOP = 3
GENERATE = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=NUM_TOP)
READ_BACK = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=NUM_TOP)


@pytest.fixture(scope="module")
def generated(llm_fp32: LLM) -> list[RequestOutput]:
    prompts = [llm_fp32.tokenizer.encode(text)[:24 + 9 * i] for i, text in enumerate(make_prompts(4, seed=11))]
    return llm_fp32.generate(prompts, GENERATE)


def _check_read_back(generated: list[RequestOutput], read: list[RequestOutput]) -> None:
    for gen, back in zip(generated, read):
        full = gen.prompt_token_ids + gen.outputs[0].token_ids
        assert back.prompt_token_ids == full
        entries = back.prompt_logprobs
        assert entries is not None and len(entries) == len(full) and entries[0] is None
        for position, entry in enumerate(entries[1:], start=1):
            assert isinstance(entry, TokenLogprobs) and entry.token_id == full[position]
            assert len(entry.top) == NUM_TOP and entry.rank is not None and entry.rank >= 1
            assert (entry.rank == 1) == (entry.top[0][0] == entry.token_id) or entry.logprob == entry.top[0][1]
            assert [value for _, value in entry.top] == sorted((value for _, value in entry.top), reverse=True)
        start = len(gen.prompt_token_ids)
        for made, seen in zip(gen.outputs[0].logprobs or [], entries[start:]):
            assert seen is not None and (seen.token_id, seen.logprob, seen.top) == (made.token_id, made.logprob, made.top)
            assert seen.rank == 1  # greedy: each generated token was the most likely


def test_read_back_matches_what_was_generated(llm_fp32: LLM, generated: list[RequestOutput]) -> None:
    full = [gen.prompt_token_ids + gen.outputs[0].token_ids for gen in generated]
    _check_read_back(generated, llm_fp32.generate(full, READ_BACK))
    # Again: the prompts are in the prefix cache now, and such a request still computes them all.
    again = llm_fp32.generate(full, READ_BACK)
    _check_read_back(generated, again)
    assert all(output.num_cached_tokens == 0 for output in again)
    plain = llm_fp32.generate(full, SamplingParams(temperature=0, max_tokens=1))
    assert all(output.prompt_logprobs is None for output in plain)
    assert all(output.num_cached_tokens > 0 for output in plain)  # the cache itself still serves others


def test_in_small_chunks_beside_others_and_preempted(generated: list[RequestOutput]) -> None:
    """Chunks of 5 tokens at most a step, mixed with requests that do not ask (n=2 too), in a
    pool too small for all of them at once."""
    llm = LLM(dtype="float32", max_num_seqs=8, max_num_batched_tokens=5, num_kv_blocks=12, prefill_budget=0)
    full = [gen.prompt_token_ids + gen.outputs[0].token_ids for gen in generated]
    others = SamplingParams(temperature=0.7, max_tokens=40, ignore_eos=True, n=2, seed=1)
    outputs = llm.generate(full + full, [READ_BACK] * len(full) + [others] * len(full))
    _check_read_back(generated, outputs[:len(full)])
    assert llm.engine.num_preemptions_total > 0
    assert llm.engine.scheduler.kv_cache_manager.num_used_blocks == 0


def test_n_completions_of_one_prompt(llm_fp32: LLM, generated: list[RequestOutput]) -> None:
    full = generated[0].prompt_token_ids + generated[0].outputs[0].token_ids
    params = SamplingParams(temperature=0.8, max_tokens=2, n=3, seed=0, prompt_logprobs=NUM_TOP)
    output = llm_fp32.generate([full], params)[0]
    _check_read_back(generated[:1], [output])
    assert len(output.outputs) == 3


def test_the_plain_pytorch_path_too(generated: list[RequestOutput]) -> None:
    """The reference (and GPU) path: its matmuls' sums depend on the batch's shape, so the
    values agree to rounding, not to the bit."""
    llm = LLM(dtype="float32", quantization="none", max_num_seqs=4, max_num_batched_tokens=7)
    gen = llm.generate([generated[1].prompt_token_ids], GENERATE)[0]
    back = llm.generate([gen.prompt_token_ids + gen.outputs[0].token_ids], READ_BACK)[0]
    entries = back.prompt_logprobs
    assert entries is not None and len(entries) == len(back.prompt_token_ids) and entries[0] is None
    for made, seen in zip(gen.outputs[0].logprobs or [], entries[len(gen.prompt_token_ids):]):
        assert seen is not None and seen.token_id == made.token_id
        assert seen.logprob == pytest.approx(made.logprob, abs=1e-4)
        assert [t for t, _ in seen.top] == [t for t, _ in made.top]
