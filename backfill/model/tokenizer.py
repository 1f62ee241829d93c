"""Tokenizer: a thin wrapper over a transformers fast tokenizer, from a HF folder or a GGUF.

The wrapper pins down the few calls the engine and server make (encode, decode, chat
template) and the special ids they need, so nothing else depends on transformers' API.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from backfill.model.loader import is_gguf, resolve_model_path

logger = logging.getLogger(__name__)


class Tokenizer:
    """Text <-> token ids for one model.

    `eos_token_ids` is every id that ends generation: the tokenizer's eos plus, for HF folders,
    the ids listed in config.json / generation_config.json (Llama 3 lists several).
    """

    def __init__(self, hf: Any, extra_eos_token_ids: tuple[int, ...] = ()) -> None:
        self.hf = hf
        self.vocab_size: int = len(hf)
        eos: list[int] = [] if hf.eos_token_id is None else [int(hf.eos_token_id)]
        eos += [e for e in extra_eos_token_ids if e not in eos]
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self.bos_token_id: int | None = None if hf.bos_token_id is None else int(hf.bos_token_id)
        self.chat_template: str | None = getattr(hf, "chat_template", None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return list(self.hf.convert_ids_to_tokens(ids))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render a chat as prompt text with the model's template.

        Raises ValueError("messages: ...") when the messages are malformed, the model has no
        chat template, or the template rejects them.
        """
        _check_messages(messages)
        if not self.chat_template:
            raise ValueError("messages: this model has no chat template; use a plain prompt")
        try:
            text = self.hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # jinja2 TemplateError, or the template's own raise_exception
            raise ValueError(f"messages: the chat template rejected them: {exc}") from exc
        if not isinstance(text, str):
            raise ValueError(f"messages: the chat template returned {type(text).__name__}, not text")
        return text

    @property
    def all_special_ids(self) -> list[int]:
        return list(self.hf.all_special_ids)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: expected a non-empty list of {'role', 'content'} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages: item {i} is {type(message).__name__}, not an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages: item {i} needs a non-empty string 'role'")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(
                f"messages: item {i} 'content' must be a string or a list of parts, "
                f"got {type(content).__name__}"
            )


def _folder_eos_ids(path: str) -> tuple[int, ...]:
    """eos ids listed in a HF folder's generation_config.json and config.json, in that order."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        with open(file) as f:
            eos = json.load(f).get("eos_token_id")
        for e in eos if isinstance(eos, list) else [] if eos is None else [eos]:
            if int(e) not in ids:
                ids.append(int(e))
    return tuple(ids)


def load_tokenizer(model: str | None) -> Tokenizer:
    """The tokenizer of `model` (same resolution as load_model): a HF folder's tokenizer files,
    or rebuilt from a GGUF file's metadata (a few seconds)."""
    from transformers import AutoTokenizer

    start = time.perf_counter()
    path = resolve_model_path(model)
    if is_gguf(path):
        hf = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        tokenizer = Tokenizer(hf)
    else:
        hf = AutoTokenizer.from_pretrained(path)
        tokenizer = Tokenizer(hf, _folder_eos_ids(path))
    logger.info("loaded tokenizer of %s in %.1f s", path, time.perf_counter() - start)
    return tokenizer
