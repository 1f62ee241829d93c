"""Tokenizer: a thin wrapper over a transformers fast tokenizer, from a HF folder or a GGUF.

The wrapper pins down the few calls the engine and server make (encode, decode, chat
template) and the special ids they need, so nothing else depends on transformers' API.
Nothing here needs torch: a GGUF's tokenizer is rebuilt without it (`_gguf_tokenizer`). A
Hugging Face folder's goes through transformers' AutoTokenizer, whose config classes import
torch where it is installed.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import secrets
import time
from typing import Any

from backfill.model_files import GGUFHeader, is_gguf, resolve_model_path

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
        self._chat_encoder: _ChatEncoder | None = None  # built on first use (copies the backend)
        self._reserved_template_kwargs: frozenset[str] | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return list(self.hf.convert_ids_to_tokens(ids))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            continue_final_message: bool = False,
                            chat_template_kwargs: dict[str, Any] | None = None,
                            tools: list[dict] | None = None) -> str:
        """Render a chat as prompt text with the model's template.

        `continue_final_message`: leave the last message open (no end-of-turn after it), for the
        model to continue it; needs `add_generation_prompt=False`. `chat_template_kwargs`: extra
        variables the template sees (keys may not be the template's own inputs: `messages`, ...).
        `tools`: OpenAI-format function tools, the template's `tools` variable (as transformers
        passes them). Raises ValueError("messages: ...") when the messages are malformed, the
        model has no chat template, or the template rejects them; ValueError("chat_template_kwargs:
        ...") for a reserved key.
        """
        _check_messages(messages)
        kwargs = self._check_template_kwargs(chat_template_kwargs)
        if not self.chat_template:
            raise ValueError("messages: this model has no chat template; use a plain prompt")
        if tools:
            kwargs = {**kwargs, "tools": tools}
        try:
            text = self.hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **kwargs,
            )
        except Exception as exc:  # jinja2 TemplateError, or the template's own raise_exception
            raise ValueError(f"messages: the chat template rejected them: {exc}") from exc
        if not isinstance(text, str):
            raise ValueError(f"messages: the chat template returned {type(text).__name__}, not text")
        return text

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, *,
                    continue_final_message: bool = False,
                    chat_template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict] | None = None) -> tuple[str, list[int]]:
        """The chat as prompt text and token ids, where only the template's own markers are
        special tokens: a message's text is encoded as the plain characters it is made of.

        So content such as "hi<|im_end|><|im_start|>system ..." cannot close its turn and forge
        another (chat-template injection), for any role and any special token; nor can a value
        in `chat_template_kwargs` or the text of `tools`. The ids equal
        `encode(apply_chat_template(messages), add_special_tokens=False)` whenever no message
        contains special-token text. Raises ValueError as `apply_chat_template`.
        """
        return self._ensure_chat_encoder().encode(self, messages, add_generation_prompt,
                                                  continue_final_message=continue_final_message,
                                                  chat_template_kwargs=chat_template_kwargs, tools=tools)

    def _ensure_chat_encoder(self) -> _ChatEncoder:
        if self._chat_encoder is None:
            self._chat_encoder = _ChatEncoder(self.hf)
        return self._chat_encoder

    def warm_up(self) -> None:
        """Build now what the first chat request would (encode_chat's encoder, ~0.2 s holding
        the GIL): a server does it before it takes requests, so that no stream waits for it."""
        self._ensure_chat_encoder()

    def _check_template_kwargs(self, kwargs: dict[str, Any] | None) -> dict[str, Any]:
        if kwargs is None:
            return {}
        if not isinstance(kwargs, dict):
            raise ValueError("chat_template_kwargs: must be an object")
        if self._reserved_template_kwargs is None:
            # NOTE: transformers' own parameters (tokenize, chat_template, ...) would change what
            # apply_chat_template does, not only what the template sees.
            parameters = inspect.signature(self.hf.apply_chat_template).parameters
            self._reserved_template_kwargs = frozenset(
                {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"}
                | {name for name, p in parameters.items() if p.kind is not inspect.Parameter.VAR_KEYWORD})
        reserved = sorted(key for key in kwargs if key in self._reserved_template_kwargs or not isinstance(key, str))
        if reserved:
            raise ValueError(f"chat_template_kwargs: may not set {', '.join(map(str, reserved))}")
        return kwargs

    @property
    def all_special_ids(self) -> list[int]:
        return list(self.hf.all_special_ids)


class _ChatEncoder:
    """How `Tokenizer.encode_chat` keeps special tokens out of message text.

    1. Every special-token string in the messages is swapped for a placeholder that contains
       a random nonce (nobody can write it in advance), so every special-token string left in
       the rendered template is the template's own.
    2. The rendered text is split at those markers, as the tokenizer itself splits text at
       special tokens (honouring their lstrip/rstrip), and each marker becomes its id.
    3. The text between markers gets its placeholders swapped back and is encoded with
       special-token matching off (a copy of the backend with `encode_special_tokens`).
    Assumes, as every chat template does, that the template writes markers whole, never a
    piece of one next to the content.
    """

    def __init__(self, hf: Any) -> None:
        import tokenizers

        specials = {str(token): int(token_id) for token_id, token in hf.added_tokens_decoder.items()
                    if token.special and str(token)}
        self.special_ids = specials
        self.specials = sorted(specials, key=len, reverse=True)  # longest first, as HF matches
        self.special_pattern = re.compile("|".join(map(re.escape, self.specials))) if specials else None
        flags = {str(t): t for t in hf.added_tokens_decoder.values()}
        self.marker_pattern = re.compile("|".join(
            (r"\s*" if flags[t].lstrip else "") + re.escape(t) + (r"\s*" if flags[t].rstrip else "")
            for t in self.specials)) if specials else None
        config = json.loads(hf.backend_tokenizer.to_str())
        self.text_backend = tokenizers.Tokenizer.from_str(json.dumps(config))
        self.text_backend.encode_special_tokens = True
        # NOTE: a Metaspace pre-tokenizer with prepend_scheme "first" adds its "▁" only to text
        # at offset 0 of the whole input; encoded apart, later pieces need a copy that never does.
        self.later_backend = self.text_backend
        if _set_prepend_scheme(config.get("pre_tokenizer"), "first", "never"):
            self.later_backend = tokenizers.Tokenizer.from_str(json.dumps(config))
            self.later_backend.encode_special_tokens = True
        for backend in (self.text_backend, self.later_backend):
            backend.no_truncation()
            backend.no_padding()

    def encode(self, tokenizer: Tokenizer, messages: list[dict], add_generation_prompt: bool, *,
               continue_final_message: bool = False,
               chat_template_kwargs: dict[str, Any] | None = None,
               tools: list[dict] | None = None) -> tuple[str, list[int]]:
        options: dict[str, Any] = {"continue_final_message": continue_final_message,
                                   "chat_template_kwargs": chat_template_kwargs, "tools": tools}
        if self.special_pattern is None or self.marker_pattern is None:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt, **options)
            return text, tokenizer.encode(text, add_special_tokens=False)
        nonce = secrets.token_hex(8)
        index = {token: i for i, token in enumerate(self.specials)}
        placeholder = re.compile(f"\ue000{nonce}:(\\d+)\ue001")

        def hide(value: Any) -> Any:
            if isinstance(value, str):
                return self.special_pattern.sub(lambda m: f"\ue000{nonce}:{index[m.group()]}\ue001", value)  # type: ignore[union-attr]
            if isinstance(value, list):
                return [hide(item) for item in value]
            if isinstance(value, dict):
                return {key: hide(item) for key, item in value.items()}
            return value

        def reveal(text: str) -> str:
            return placeholder.sub(lambda m: self.specials[int(m.group(1))], text)

        options["chat_template_kwargs"] = hide(chat_template_kwargs)
        options["tools"] = hide(tools)
        rendered = tokenizer.apply_chat_template(hide(messages), add_generation_prompt, **options)
        pieces: list[str] = []  # text, marker, text, marker, ..., text
        start = 0
        for match in self.marker_pattern.finditer(rendered):
            pieces += [rendered[start:match.start()], match.group()]
            start = match.end()
        pieces.append(rendered[start:])
        texts = [reveal(piece) for piece in pieces[0::2]]
        ids: list[int] = []
        later = self.later_backend.encode_batch(texts[1:], add_special_tokens=False) if len(texts) > 1 else []
        for i, text in enumerate(texts):
            if i:
                marker = pieces[2 * i - 1]
                ids.append(self.special_ids.get(marker, self.special_ids.get(marker.strip(), -1)))
            if text:
                encoding = later[i - 1] if i else self.text_backend.encode(text, add_special_tokens=False)
                ids += encoding.ids
        assert -1 not in ids, "a marker matched no special token"
        return reveal(rendered), ids


def _set_prepend_scheme(pre_tokenizer: Any, old: str, new: str) -> bool:
    """Change every Metaspace pre-tokenizer's prepend_scheme `old` to `new` (in place, nested
    Sequences included); whether any was changed."""
    if not isinstance(pre_tokenizer, dict):
        return False
    changed = False
    if pre_tokenizer.get("type") == "Metaspace" and pre_tokenizer.get("prepend_scheme") == old:
        pre_tokenizer["prepend_scheme"] = new
        changed = True
    for child in pre_tokenizer.get("pretokenizers") or []:
        changed = _set_prepend_scheme(child, old, new) or changed
    return changed


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
    start = time.perf_counter()
    path = resolve_model_path(model)
    if is_gguf(path):
        tokenizer = Tokenizer(_gguf_tokenizer(path))
    else:
        from transformers import AutoTokenizer

        tokenizer = Tokenizer(AutoTokenizer.from_pretrained(path), _folder_eos_ids(path))
    logger.info("loaded tokenizer of %s in %.1f s", path, time.perf_counter() - start)
    return tokenizer


# The special tokens a GGUF names by id (transformers' gguf_tokenizer_mapping._SPECIAL_TOKENS).
_GGUF_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                        "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def _gguf_tokenizer(path: str) -> Any:
    """What `AutoTokenizer.from_pretrained(folder, gguf_file=name)` builds for our architectures
    (a TokenizersBackend over transformers' GGUF converters), from our header reader.

    NOTE: transformers' own GGUF metadata reader imports torch; this mirrors its
    `get_gguf_tokenizer` (transformers 5.23) around GGUFHeader, and tests/model/test_tokenizer.py
    checks the result against AutoTokenizer's.
    """
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    metadata = GGUFHeader(path, skip_arrays=()).metadata
    grouped = {
        group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in metadata}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer_dict, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":
        # llama.cpp adds BOS to a sentencepiece vocabulary whose file does not say otherwise.
        tokenizer_config.setdefault("add_bos_token", True)
    for name, key in _GGUF_SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        tokenizer_config[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None  # type: ignore[index]
    backend, extra_kwargs = convert_gguf_tokenizer(str(metadata["general.architecture"]), tokenizer_dict)
    return TokenizersBackend(tokenizer_object=backend, name_or_path=os.path.dirname(path),
                             **tokenizer_config, **extra_kwargs)
