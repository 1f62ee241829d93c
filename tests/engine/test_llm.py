"""The offline API end to end on the default model: stops, n, logprobs, abort, chat, CLI."""

from __future__ import annotations

import subprocess
import time
import sys

import pytest

from backfill.engine.llm import LLM
from backfill.sampling_params import SamplingParams


def _kv_clean(llm: LLM) -> None:
    kv = llm.engine.scheduler.kv_cache_manager
    kv.check_integrity()
    assert kv.num_used_blocks == 0
    assert not llm.engine.has_unfinished_requests()


def test_max_tokens_gives_length(llm_fp32: LLM) -> None:
    out = llm_fp32.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
    assert len(out.token_ids) == 7
    assert out.finish_reason == "length"
    assert out.text == llm_fp32.tokenizer.decode(out.token_ids)
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finish_time
    _kv_clean(llm_fp32)


def test_eos_gives_stop(llm_fp32: LLM) -> None:
    out = llm_fp32.chat([{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0, max_tokens=200))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in llm_fp32.tokenizer.eos_token_ids
    assert "<|im_end|>" not in out.text
    _kv_clean(llm_fp32)


def test_stop_token_ids_and_stop_strings(llm_fp32: LLM) -> None:
    base = llm_fp32.generate("The alphabet: A, B, C,", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert len(base.token_ids) == 24
    # Stop on the 5th generated token id.
    stop_id = base.token_ids[4]
    first = base.token_ids.index(stop_id)
    out = llm_fp32.generate("The alphabet: A, B, C,", SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id]))[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop_id
    assert out.token_ids == base.token_ids[: first + 1]
    # Stop on a piece of the text: the text is cut before it.
    needle = base.text[len(base.text) // 2 : len(base.text) // 2 + 3]
    assert needle.strip()
    out = llm_fp32.generate("The alphabet: A, B, C,", SamplingParams(temperature=0, max_tokens=24, stop=[needle]))[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == needle
    assert out.text == base.text[: base.text.index(needle)]
    kept = llm_fp32.generate(
        "The alphabet: A, B, C,",
        SamplingParams(temperature=0, max_tokens=24, stop=[needle], include_stop_str_in_output=True),
    )[0]
    assert kept.text == base.text[: base.text.index(needle) + len(needle)]
    _kv_clean(llm_fp32)


def test_min_tokens_and_ignore_eos(llm_fp32: LLM) -> None:
    msgs = [{"role": "user", "content": "Say hello."}]
    short = llm_fp32.chat(msgs, SamplingParams(temperature=0, max_tokens=200))[0]
    n = len(short.token_ids)
    longer = llm_fp32.chat(msgs, SamplingParams(temperature=0, max_tokens=200, min_tokens=n + 5))[0]
    assert len(longer.token_ids) >= n + 5
    forced = llm_fp32.chat(msgs, SamplingParams(temperature=0, max_tokens=n + 10, ignore_eos=True))[0]
    assert len(forced.token_ids) == n + 10 and forced.finish_reason == "length"
    _kv_clean(llm_fp32)


def test_n_seed_and_logprobs(llm_fp32: LLM) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=12, n=3, seed=7, logprobs=2, ignore_eos=True)
    a = llm_fp32.generate("My favourite colour is", params)[0]
    b = llm_fp32.generate("My favourite colour is", params)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
    for completion in a.outputs:
        assert completion.logprobs is not None and len(completion.logprobs) == 12
        for token_id, lp in zip(completion.token_ids, completion.logprobs):
            assert lp.token_id == token_id and lp.logprob <= 0 and len(lp.top) == 2
    _kv_clean(llm_fp32)


def test_abort_frees_blocks(llm_fp32: LLM) -> None:
    engine = llm_fp32.engine
    engine.add_request("a", "Tell me a long story.", SamplingParams(max_tokens=100, ignore_eos=True))
    engine.add_request("b", "Tell me another one.", SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.num_kv_blocks_used > 0
    engine.abort_request(["a", "b", "unknown"])
    assert engine.num_kv_blocks_used == 0
    assert all(o.request_id not in ("a", "b") for o in engine.step())
    _kv_clean(llm_fp32)


def test_a_request_past_its_deadline_ends_with_timeout_and_frees_its_blocks(llm_fp32: LLM) -> None:
    engine = llm_fp32.engine
    now = time.monotonic()
    engine.add_request("late", "Tell me a long story.", SamplingParams(max_tokens=100, ignore_eos=True),
                       deadline=now + 3600)
    engine.add_request("fine", "Tell me another one.", SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request("past", "Too late.", SamplingParams(max_tokens=3), deadline=now)
    outputs = engine.step()
    (past,) = [o for o in outputs if o.request_id == "past"]
    assert past.finished and past.outputs[0].finish_reason == "timeout" and past.outputs[0].token_ids == []
    assert engine.core.scheduler.get_request("late") is not None and engine.num_kv_blocks_used > 0
    engine.core.scheduler._deadlines["late"] = now  # its time is up while it runs
    outputs = engine.step()
    (late,) = [o for o in outputs if o.request_id == "late"]
    assert late.finished and late.outputs[0].finish_reason == "timeout" and len(late.outputs[0].token_ids) == 1
    while engine.has_unfinished_requests():
        engine.step()
    _kv_clean(llm_fp32)


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ("", SamplingParams(), "prompt"),
        ([], SamplingParams(), "prompt"),
        ([10**9], SamplingParams(), "prompt"),
        ("hi", SamplingParams(max_tokens=10**6), "max_tokens"),
    ],
)
def test_bad_input_names_the_field(llm_fp32: LLM, prompt, params, field) -> None:
    with pytest.raises(ValueError, match=rf"^{field}:"):
        llm_fp32.engine.add_request("bad", prompt, params)
    _kv_clean(llm_fp32)


def test_cli_generate_chat_answers() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "backfill.entrypoints.cli", "generate", "What is the capital of France?", "--chat"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
