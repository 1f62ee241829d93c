"""The wire format without a server: strict parsing, error params, token text for logprobs."""

from __future__ import annotations

import pytest

from backfill.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from backfill.entrypoints.openai.wire import APIError, loc_to_param, parse_request
from backfill.entrypoints.openai.serving import value_error
from backfill.entrypoints.openai.token_text import TokenText


@pytest.mark.parametrize("loc, param", [
    (("body", "temperature"), "temperature"),
    (("messages", 0, "content", "list[TextPart]", 1, "type"), "messages[0].content[1].type"),
    (("stop", "function-after[_check_stop(), any]"), "stop"),
    (("response_format", "type"), "response_format.type"),
    (("logit_bias", "5"), "logit_bias"),  # a key the client chose is not a field
    (("logit_bias", "a.b", "float"), "logit_bias"),
    ((), None),
])
def test_loc_to_param_drops_union_tags(loc: tuple[object, ...], param: str | None) -> None:
    assert loc_to_param(loc) == param


def test_parsing_is_strict_but_ignores_harmless_unknown_fields() -> None:
    request = parse_request(CompletionRequest, b'{"prompt": [1, 2], "temperature": 1, "future": {"x": 1}}')
    assert request.prompt == [1, 2] and request.temperature == 1.0 and request.max_tokens == 16
    for body, param in [(b'{"prompt": "a", "n": "2"}', "n"), (b'{"prompt": "a", "echo": 1}', "echo"),
                        (b'{"prompt": [[1], []]}', "prompt"), (b'{"prompt": "a", "tools": [{}]}', "tools")]:
        with pytest.raises(APIError) as error:
            parse_request(CompletionRequest, body)
        assert error.value.status_code == 400 and error.value.param == param



@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p",
                                   "repetition_penalty"])
@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_finite_numbers_are_refused_as_such(field: str, value: bytes) -> None:
    # JSON has no NaN, but the parser reads the common spelling of it; the error must say what
    # is wrong with the number (it said "less than or equal to 2" for a NaN temperature).
    body = b'{"prompt": "a", "' + field.encode() + b'": ' + value + b"}"
    for model in (CompletionRequest, ChatCompletionRequest):
        with pytest.raises(APIError) as error:
            parse_request(model, body.replace(b'"prompt": "a"', b'"messages": [{"role": "user", "content": "x"}]')
                          if model is ChatCompletionRequest else body)
        assert error.value.status_code == 400 and error.value.param == field
        assert "finite" in error.value.message

def test_chat_request_checks() -> None:
    request = parse_request(ChatCompletionRequest, b'{"messages": [{"role": "developer", "content": '
                                                   b'[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}')
    assert request.messages[0].text() == "ab"
    request = parse_request(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "x"}], '
                                                   b'"max_completion_tokens": 5}')
    assert request.max_tokens_param == "max_completion_tokens"
    for extra, param in [(b'"top_logprobs": 1', "top_logprobs"), (b'"stream_options": {}', "stream_options")]:
        request = parse_request(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "x"}], ' + extra + b"}")
        with pytest.raises(APIError) as error:
            request.check()
        assert error.value.param == param


def test_value_error_names_the_renamed_field() -> None:
    error = value_error(ValueError("logprobs: must be <= 20, got 30"), {"logprobs": "top_logprobs"})
    assert error.param == "top_logprobs" and error.message.startswith("top_logprobs: ")
    error = value_error(ValueError("max_tokens: this model's maximum context length is 8192 tokens."))
    assert error.param == "max_tokens" and error.code == "context_length_exceeded"
    assert value_error(ValueError("something went wrong: badly")).param is None


def test_token_text_gives_exact_bytes_for_partial_characters() -> None:
    from backfill.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    token_text = TokenText(tokenizer)
    text = "你好😀 café <|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert bytes(b for i in ids for b in token_text.token_bytes(i)).decode() == text
    shown = [token_text.text(i) for i in ids]
    assert shown[0].startswith("bytes:\\x") and shown[-1] == "<|im_end|>" and " café" in shown
