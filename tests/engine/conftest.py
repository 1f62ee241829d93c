"""Engine-level fixtures: real default model, float32 so results are exact enough to compare."""

from __future__ import annotations

import pytest

from backfill.engine.llm import LLM


@pytest.fixture(scope="session")
def llm_fp32() -> LLM:
    return LLM(dtype="float32", max_num_seqs=32, max_num_batched_tokens=512, seed=0)
