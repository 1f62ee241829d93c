"""Tokenizer wrapper: GGUF-rebuilt tokenizer of the default model, and a HF folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backfill.model.tokenizer import Tokenizer, load_tokenizer

SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def test_special_ids(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 49152
    assert tokenizer.eos_token_ids == (2,) and tokenizer.bos_token_id == 1
    assert {0, 1, 2} <= set(tokenizer.all_special_ids)
    assert tokenizer.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]


@pytest.mark.parametrize(
    "text",
    [
        "Hello world",
        "  leading spaces and\ttabs\nnewlines",
        "Ünïcödé — émojis 🚀🤖 and 中文",
        "def f(x):\n    return x**2",
    ],
)
def test_encode_decode_round_trip(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert ids and all(isinstance(i, int) for i in ids)
    assert ids == tokenizer.encode(text, add_special_tokens=False)  # add_bos_token is False
    assert tokenizer.decode(ids) == text


def test_decode_skips_special_tokens_on_request(tokenizer: Tokenizer) -> None:
    ids = [1] + tokenizer.encode("Hi") + [2]
    assert tokenizer.decode(ids) == "Hi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>Hi<|im_end|>"


def test_chat_template_equals_transformers_and_chatml(tokenizer: Tokenizer) -> None:
    messages = [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Tell me a joke."},
    ]
    text = tokenizer.apply_chat_template(messages)
    assert text == tokenizer.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        f"<|im_start|>system\n{SMOLLM2_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nTell me a joke.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert text == no_prompt + "<|im_start|>assistant\n"
    with_system = tokenizer.apply_chat_template([{"role": "system", "content": "Be terse."}, messages[0]])
    assert with_system.startswith("<|im_start|>system\nBe terse.<|im_end|>\n")
    assert SMOLLM2_SYSTEM not in with_system


@pytest.mark.parametrize(
    "messages",
    [[], "hello", [{"content": "no role"}], [{"role": "user", "content": 5}], ["not a dict"]],
)
def test_chat_template_rejects_bad_messages(tokenizer: Tokenizer, messages: object) -> None:
    with pytest.raises(ValueError, match="^messages: "):
        tokenizer.apply_chat_template(messages)  # type: ignore[arg-type]


def test_hf_folder_tokenizer_and_eos_from_generation_config(tokenizer: Tokenizer, tmp_path: Path) -> None:
    tokenizer.hf.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    folder = load_tokenizer(str(tmp_path))
    text = "Folders and GGUF files give the same ids."
    assert folder.encode(text) == tokenizer.encode(text)
    assert folder.eos_token_ids == (2, 0)


def test_no_chat_template_is_a_value_error(tokenizer: Tokenizer) -> None:
    bare = Tokenizer(tokenizer.hf)
    bare.chat_template = None
    with pytest.raises(ValueError, match="^messages: .*no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])
