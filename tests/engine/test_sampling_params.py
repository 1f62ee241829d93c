"""SamplingParams validation: every invalid field raises a ValueError that names the field."""

from __future__ import annotations

from typing import Any

import pytest

from backfill.sampling_params import MAX_LOGPROBS, SamplingParams

INVALID: list[tuple[str, dict[str, Any]]] = [
    ("n", {"n": 0}),
    ("n", {"n": 129}),
    ("n", {"n": 1.5}),
    ("n", {"n": True}),
    ("temperature", {"temperature": -0.1}),
    ("temperature", {"temperature": float("nan")}),
    ("temperature", {"temperature": "1"}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.01}),
    ("top_p", {"top_p": None}),
    ("top_k", {"top_k": -2}),
    ("top_k", {"top_k": 2.0}),
    ("min_p", {"min_p": -0.01}),
    ("min_p", {"min_p": 1.5}),
    ("presence_penalty", {"presence_penalty": 2.5}),
    ("presence_penalty", {"presence_penalty": -2.01}),
    ("frequency_penalty", {"frequency_penalty": -3}),
    ("frequency_penalty", {"frequency_penalty": float("nan")}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("repetition_penalty", {"repetition_penalty": 10.5}),
    ("logit_bias", {"logit_bias": [1, 2]}),
    ("logit_bias", {"logit_bias": {"abc": 1.0}}),
    ("logit_bias", {"logit_bias": {5: 101.0}}),
    ("logit_bias", {"logit_bias": {-1: 1.0}}),
    ("logit_bias", {"logit_bias": {5: "x"}}),
    ("seed", {"seed": 1.5}),
    ("seed", {"seed": 2**64}),
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": "16"}),
    ("min_tokens", {"min_tokens": -1}),
    ("min_tokens", {"min_tokens": 20, "max_tokens": 10}),
    ("stop", {"stop": 5}),
    ("stop", {"stop": ["ok", 3]}),
    ("stop", {"stop": ""}),
    ("stop", {"stop": ["a", ""]}),
    ("stop_token_ids", {"stop_token_ids": [1, -1]}),
    ("stop_token_ids", {"stop_token_ids": 7}),
    ("stop_token_ids", {"stop_token_ids": [True]}),
    ("ignore_eos", {"ignore_eos": 1}),
    ("allowed_token_ids", {"allowed_token_ids": []}),
    ("allowed_token_ids", {"allowed_token_ids": [1, -2]}),
    ("bad_words", {"bad_words": ["ok", " "]}),
    ("bad_words", {"bad_words": ["w"] * 129}),
    ("bad_words_token_ids", {"bad_words_token_ids": [[1], []]}),
    ("bad_words_token_ids", {"bad_words_token_ids": [[1, -1]]}),
    ("prompt_logprobs", {"prompt_logprobs": 21}),
    ("prompt_logprobs", {"prompt_logprobs": -1}),
    ("logprobs", {"logprobs": -1}),
    ("logprobs", {"logprobs": MAX_LOGPROBS + 1}),
]


@pytest.mark.parametrize(("field", "kwargs"), INVALID, ids=[f"{f}-{i}" for i, (f, _) in enumerate(INVALID)])
def test_invalid_field_raises_value_error_naming_it(field: str, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value).startswith(f"{field}:"), str(info.value)


def test_every_validated_field_has_an_invalid_case() -> None:
    validated = {
        "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "logit_bias", "seed", "max_tokens", "min_tokens", "stop",
        "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs", "allowed_token_ids", "bad_words",
        "bad_words_token_ids",
    }  # fmt: skip
    assert validated == {field for field, _ in INVALID}


def test_defaults_are_valid_and_random() -> None:
    params = SamplingParams()
    assert params.stop_list == []
    assert not params.greedy
    assert params.max_tokens == 16 and params.min_tokens == 0


def test_boundary_values_are_accepted() -> None:
    params = SamplingParams(
        n=128,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        min_p=1.0,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=10.0,
        logit_bias={"7": -100, 3: 100.0},
        seed=-(2**63),
        max_tokens=None,
        min_tokens=0,
        stop_token_ids=[],
        logprobs=MAX_LOGPROBS,
    )
    assert params.greedy
    assert params.logit_bias == {7: -100.0, 3: 100.0}  # string keys (JSON) become token ids


def test_stop_is_normalized_to_a_list() -> None:
    assert SamplingParams(stop="###").stop_list == ["###"]
    assert SamplingParams(stop=["a", "bc"]).stop_list == ["a", "bc"]
    assert SamplingParams(stop=None).stop_list == []


def test_min_tokens_may_equal_max_tokens() -> None:
    assert SamplingParams(min_tokens=10, max_tokens=10).min_tokens == 10
    assert SamplingParams(min_tokens=10_000, max_tokens=None).min_tokens == 10_000
