"""`activation_quantization="int8"` on the real default model through the engine: opt-in, off by
default, batch invariant, refused where the CPU kernels do not run it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from backfill import kernels
from backfill.config import ConfigError, EngineConfig
from backfill.engine.llm import LLM
from backfill.sampling_params import SamplingParams
from tests.prompts import make_prompts

pytestmark = pytest.mark.skipif(not kernels.available(), reason="CPU kernels extension unavailable")


def test_off_by_default_and_checked() -> None:
    assert EngineConfig().activation_quantization == "none"
    with pytest.raises(ValueError, match="activation_quantization must be one of"):
        EngineConfig(activation_quantization="int4")
    # the dense PyTorch model has no int8-activation path: refused, not ignored
    with pytest.raises(ConfigError, match="CPU kernels only"):
        LLM(activation_quantization="int8", quantization="none")


def test_int8_engine_is_batch_invariant() -> None:
    llm = LLM(activation_quantization="int8", max_num_seqs=8, max_num_batched_tokens=256, seed=0)
    decoder = llm.engine.runner.model
    assert decoder.activation_quantization == "int8" and decoder.int8_activation_matrices >= 4 * 30  # Q4_1 layers
    prompts = make_prompts(6, seed=3)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    together = [o.token_ids for o in llm.generate(prompts, params)]
    assert together == alone and all(len(t) == 12 for t in alone)


def test_a_model_without_4bit_linears_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A Hugging Face folder runs as F32 blocks: int8 activations have nothing to apply to, and the
    log says so rather than letting the flag pass silently."""
    from backfill.worker.model_runner import ModelRunner
    from tests.model.test_hf_folder import save_tiny

    save_tiny("llama", tmp_path)
    with caplog.at_level(logging.WARNING, logger="backfill.worker.model_runner"):
        runner = ModelRunner(EngineConfig(model=str(tmp_path), activation_quantization="int8", max_model_len=64))
    assert runner.model.int8_activation_matrices == 0
    assert "no linear of this model is stored in a 4-bit type" in caplog.text
