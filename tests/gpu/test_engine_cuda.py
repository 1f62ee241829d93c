"""The engine on CUDA: decode steps replayed as CUDA graphs give what eager steps give, and a
request's greedy output does not depend on its companions (fp32)."""

from __future__ import annotations

import pytest
import torch

from backfill.bench.graph_floor import measure_graph_floor
from backfill.engine.llm import LLM
from backfill.model.static_decode import varlen_supported
from backfill.sampling_params import SamplingParams
from backfill.worker.cuda_graph import CudaGraphRunner
from tests.engine.test_batch_invariance import _check_together, workload  # noqa: F401 (fixture)
from tests.kernels.test_decoder import tiny_model
from tests.worker.test_cuda_graph import check_padded_steps, twin_drivers

pytestmark = pytest.mark.gpu

MAX_MODEL_LEN = 1024  # block budgets 16 and 64: both graph sizes get used


@pytest.fixture(scope="module")
def graphed_llm() -> LLM:
    llm = LLM(device="cuda", dtype="float32", max_num_seqs=32, max_model_len=MAX_MODEL_LEN, seed=0)
    runner = llm.engine.runner.graph_runner
    assert runner is not None and len(runner.graphs) == len(runner.sizes) * len(runner.buckets)
    return llm


@pytest.fixture(scope="module")
def alone_cuda(graphed_llm: LLM, workload: tuple[list[str], list[SamplingParams]]) -> list[list[int]]:
    prompts, params = workload
    return [graphed_llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]


def test_batch_invariance_with_graphs(graphed_llm: LLM, workload, alone_cuda) -> None:
    _check_together(graphed_llm, workload, alone_cuda)


def test_graphs_give_the_eager_tokens(workload, alone_cuda) -> None:
    eager = LLM(device="cuda", dtype="float32", max_num_seqs=32, max_model_len=MAX_MODEL_LEN, seed=0,
                enforce_eager=True)
    assert eager.engine.runner.graph_runner is None
    _check_together(eager, workload, alone_cuda)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_graph_replay_matches_eager_steps(dtype: torch.dtype, atol: float) -> None:
    """A tiny model's padded decode steps replayed from captured graphs against eager steps."""
    check_padded_steps(torch.device("cuda"), dtype, capture=True, atol=atol)
    if varlen_supported(torch.device("cuda"), dtype, 4, 4, 2, 16) is None:
        check_padded_steps(torch.device("cuda"), dtype, capture=True, backend="varlen", atol=atol)


def test_graph_floor_counts_the_steps_kernels() -> None:
    """bench roofline's launch floor on a tiny model's captured graphs: every layer launches
    several kernels, the floor graph replays, and a step too large for any graph has none."""
    model = tiny_model("gqa2_hd16").to("cuda", torch.float32)
    _, graphed, scratch = twin_drivers(model, num_blocks=100, block_size=4)
    runner = CudaGraphRunner(model, graphed.kv_caches, max_num_seqs=4, max_model_len=64, scratch_block=scratch)
    runner.capture()
    floor = measure_graph_floor(runner, 3, 20)
    assert floor is not None and floor["graph_key"] == [4, 16]
    assert floor["kernels"] > 4 * model.config.num_layers
    assert floor["floor_ms"] > 0 and floor["replay_ms"] > 0
    assert measure_graph_floor(runner, 5, 20) is None
