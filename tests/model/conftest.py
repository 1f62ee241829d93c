"""Model-test fixtures: the default GGUF model (ours and transformers'), loaded once per session,
in float32 so the comparisons can be tight."""

from __future__ import annotations

import os

import pytest
import torch

from backfill import kernels
from backfill.model.cpu_decoder import CpuDecoder, load_cpu_decoder
from backfill.model.llama import LlamaForCausalLM
from backfill.model.loader import load_model
from backfill.model_files import default_model_path
from backfill.tokenizer import Tokenizer, load_tokenizer


@pytest.fixture(scope="session")
def gguf_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def our_model(gguf_path: str) -> LlamaForCausalLM:
    return load_model(gguf_path, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="session", params=["dense", "prepacked", "kernels"])
def engine_model(request: pytest.FixtureRequest, gguf_path: str) -> LlamaForCausalLM | CpuDecoder:
    """The model as the engine runs it, every way: dense `nn.Linear` weights; the
    oneDNN-prepacked weights (model/prepack.py); and the default CPU path, the CPU kernels'
    fused step over the GGUF's matrices as stored (model/cpu_decoder.py)."""
    if request.param == "dense":
        return request.getfixturevalue("our_model")
    if request.param == "kernels":
        if not kernels.available():
            pytest.skip("the CPU kernels extension is not available")
        return load_cpu_decoder(gguf_path)
    model = load_model(gguf_path, torch.float32, torch.device("cpu"))
    assert model.prepack_weights() == 4 * model.config.num_layers + 1
    return model


@pytest.fixture(scope="session")
def hf_model(gguf_path: str) -> torch.nn.Module:
    """transformers' own Llama, loaded by its own GGUF loader from the same file (~20 s)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def tokenizer(gguf_path: str) -> Tokenizer:
    return load_tokenizer(gguf_path)


@pytest.fixture(scope="session")
def prompt_ids(tokenizer: Tokenizer) -> list[list[int]]:
    """Three prompts of different lengths (chat-formatted and plain)."""
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Write a short poem about the sea."}])
    texts = [
        chat,
        "The quick brown fox jumps over the lazy dog. The dog",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    ]
    return [tokenizer.encode(t) for t in texts]
