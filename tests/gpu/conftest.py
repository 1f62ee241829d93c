"""GPU tests: marked `gpu`, skipped with a reason where torch sees no CUDA device (CI, laptops);
run on a GPU machine by scripts/gpu_check.sh. The model fixtures are tests/model's."""

from __future__ import annotations

import pytest
import torch

from tests.model.conftest import gguf_path, hf_model, prompt_ids, tokenizer  # noqa: F401 (fixtures)

NO_GPU_REASON = "no CUDA device (torch.cuda.is_available() is False): the gpu tests run on a GPU machine, see scripts/gpu_check.sh"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_GPU_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cuda() -> torch.device:
    return torch.device("cuda")
