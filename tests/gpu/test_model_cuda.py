"""The model and paged attention on CUDA against the references the CPU tests use:
transformers (fp32: same greedy tokens, logits within LOGITS_ATOL), our fp32 model (bf16:
TOLERANCE of tests/model), naive attention, and the fixed-shape decode kernels of the graphs."""

from __future__ import annotations

import pytest
import torch

from backfill.model.llama import LlamaForCausalLM
from backfill.model.loader import load_model
from backfill.model.static_decode import varlen_supported
from backfill.tokenizer import Tokenizer
from tests.model.paged_driver import PagedDriver
from tests.model.test_attention import CASES, check_narrow_caches, check_paged_matches_naive
from tests.model.test_llama_gguf import check_bfloat16_tracks_float32, check_matches_transformers
from tests.model.test_static_decode import DECODE_CASES, check_static_matches_naive

pytestmark = pytest.mark.gpu

# fp32 on the GPU against transformers' fp32 on the CPU: the same arithmetic in another order
# (cuBLAS blocking, no TF32: torch leaves it off for matmuls). The CPU paths agree within 3e-4.
LOGITS_ATOL = 1e-3


@pytest.fixture(scope="module")
def fp32_model(cuda: torch.device, gguf_path: str) -> LlamaForCausalLM:
    return load_model(gguf_path, torch.float32, cuda)


@pytest.fixture(scope="module")
def bf16_model(cuda: torch.device, gguf_path: str) -> LlamaForCausalLM:
    return load_model(gguf_path, torch.bfloat16, cuda)


@torch.inference_mode()
def test_fp32_matches_transformers(fp32_model: LlamaForCausalLM, hf_model: torch.nn.Module,
                                   prompt_ids: list[list[int]]) -> None:
    """Chunked prefill and 20 batched greedy decode steps on the GPU: same greedy tokens as
    transformers at every step, logits within LOGITS_ATOL."""
    assert fp32_model.embed_tokens.weight.is_cuda
    check_matches_transformers(fp32_model, hf_model, prompt_ids, LOGITS_ATOL)


@torch.inference_mode()
def test_bf16_tracks_fp32(fp32_model: LlamaForCausalLM, bf16_model: LlamaForCausalLM,
                          prompt_ids: list[list[int]], tokenizer: Tokenizer) -> None:
    """bf16 logits: cosine similarity to fp32 > 0.995 per row, greedy agreement >= 50% (the CPU
    test's bounds), and the top logits' fp32 refinement keeps the known near-tie right."""
    check_bfloat16_tracks_float32(fp32_model, bf16_model, prompt_ids)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    answer = PagedDriver(bf16_model, num_blocks=8, block_size=16).greedy([tokenizer.encode(chat)], 6)[0]
    assert tokenizer.decode(answer).startswith("The capital of France is Paris")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_paged_matches_naive(cuda: torch.device, dtype: torch.dtype, case: str) -> None:
    check_paged_matches_naive(dtype, case, 9, 3, 64, 16, cuda)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_narrow_caches_read_as_their_values(cuda: torch.device, kv_dtype: torch.dtype, case: str) -> None:
    """`--kv-cache-dtype` on the GPU path (bf16 activations): the caches hold the narrow type,
    attention reads it as caches of bf16 holding the same values."""
    check_narrow_caches(case, torch.bfloat16, kv_dtype, cuda)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", DECODE_CASES)
@pytest.mark.parametrize("sliding_window", [None, 24])
def test_graph_decode_kernels_match_naive(cuda: torch.device, dtype: torch.dtype, case: str,
                                          sliding_window: int | None) -> None:
    check_static_matches_naive(case, dtype, sliding_window, "gather", cuda)
    reason = varlen_supported(cuda, dtype, 16, 9, 3, 64)
    if reason is not None:
        pytest.skip(f"varlen kernel: {reason}")
    check_static_matches_naive(case, dtype, sliding_window, "varlen", cuda)
