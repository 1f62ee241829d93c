"""Kernel-test fixtures: the real default model's, shared with tests/model."""

from tests.model.conftest import gguf_path, our_model, prompt_ids, tokenizer  # noqa: F401
