"""`kv_cache_dtype="bfloat16"` / `"float16"` / `"fp8"` / `"fp8_e5m2"` on the real default model
through the engine: opt-in, off by default, half (a quarter) the KV bytes a token, batch
invariant, on the CPU kernels and on the plain-PyTorch path."""

from __future__ import annotations

import pytest
import torch

from backfill import kernels
from backfill.config import EngineConfig
from backfill.engine.llm import LLM
from backfill.model.cpu_decoder import CpuDecoder
from backfill.sampling_params import SamplingParams
from tests.prompts import make_prompts

pytestmark = pytest.mark.skipif(not kernels.available(), reason="CPU kernels extension unavailable")


def test_off_by_default_and_checked() -> None:
    assert EngineConfig().kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int4")


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8"])
def test_plain_pytorch_path_runs_narrow_caches(kv_cache_dtype: str) -> None:
    """The plain-PyTorch model (`quantization="none"`: the reference, and the GPU path) stores K
    and V in the narrow type too (write_kv) and widens the gathered blocks: its caches hold the
    type, and its greedy tokens stay mostly those of its own fp32 cache."""
    dtype, ratio, least_agreed = NARROW[kv_cache_dtype]
    settings = dict(quantization="none", dtype="float32", max_num_seqs=8, max_model_len=256, seed=0)
    exact, llm = LLM(**settings), LLM(kv_cache_dtype=kv_cache_dtype, **settings)
    runner = llm.engine.runner
    assert not isinstance(runner.model, CpuDecoder)
    assert all(k.dtype == v.dtype == dtype for k, v in runner.kv_caches)
    assert ratio * runner.kv_bytes_per_token == exact.engine.runner.kv_bytes_per_token
    prompts = make_prompts(6, seed=3)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    reference = [o.token_ids for o in exact.generate(prompts, params)]
    agreed = sum(a == b for x, y in zip(got, reference) for a, b in zip(x, y))
    print(f"{kv_cache_dtype} (plain PyTorch): {agreed} of {len(prompts) * 12} greedy tokens the fp32 cache's")
    assert all(len(t) == 12 for t in got) and agreed >= least_agreed * len(prompts) * 12, (got, reference)


# Each narrow cache: its torch dtype, fp32's bytes over its, and the least share of the greedy
# tokens (position by position) that stays the fp32 path's on the prompts below (measured on a
# Zen 4 EPYC, AVX-512 / AVX2 kernels: bf16 and fp16 72 / 72 of 72, fp8 e4m3 72 / 60, e5m2 27 / 37:
# two significand bits are few for this small model, see `backfill bench divergence`).
NARROW = {"bfloat16": (torch.bfloat16, 2, 0.5), "float16": (torch.float16, 2, 0.5),
          "fp8": (torch.float8_e4m3fn, 4, 0.5), "fp8_e5m2": (torch.float8_e5m2, 4, 0.25)}


@pytest.mark.parametrize("kv_cache_dtype", list(NARROW))
def test_narrow_cache_engine_is_batch_invariant_and_fewer_bytes(kv_cache_dtype: str) -> None:
    dtype, ratio, least_agreed = NARROW[kv_cache_dtype]
    exact = LLM(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512, seed=0)
    llm = LLM(kv_cache_dtype=kv_cache_dtype, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512, seed=0)
    runner, exact_runner = llm.engine.runner, exact.engine.runner
    assert runner.kv_dtype == dtype and exact_runner.kv_dtype == torch.float32
    assert all(k.dtype == v.dtype == dtype for k, v in runner.kv_caches)
    assert ratio * runner.kv_bytes_per_token == exact_runner.kv_bytes_per_token
    prompts = make_prompts(6, seed=3)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    together = [o.token_ids for o in llm.generate(prompts, params)]
    assert together == alone and all(len(t) == 12 for t in alone)
    # the rounding changes numbers, not the model: most greedy tokens stay the fp32 path's
    reference = [o.token_ids for o in exact.generate(prompts, params)]
    agreed = sum(a == b for x, y in zip(together, reference) for a, b in zip(x, y))
    print(f"{kv_cache_dtype}: {agreed} of {len(prompts) * 12} greedy tokens the fp32 path's")
    assert agreed >= least_agreed * len(prompts) * 12, (together, reference)
