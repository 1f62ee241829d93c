"""CudaGraphRunner's host side on CPU: capture sizes, padding to the next size, the dummy KV
slot of padding rows, output slicing, and the padded step run eagerly through the same static
buffers giving the logits of the unpadded eager step (the graphs themselves: tests/gpu)."""

from __future__ import annotations

import pytest
import torch

from backfill.core.outputs import SchedulerOutput, ScheduledRequest
from backfill.engine.llm import LLM
from backfill.model.llama import LlamaForCausalLM
from backfill.sampling_params import SamplingParams
from backfill.worker.cuda_graph import (CudaGraphRunner, DecodeBuffers, DecodeInputs, block_buckets, capture_sizes,
                                        decode_inputs, padded_size)
from tests.kernels.test_decoder import tiny_model
from tests.model.paged_driver import PagedDriver

CPU = torch.device("cpu")
LOGITS_ATOL = 1e-5
# A padded step multiplies more rows than the eager one (4 for 3), and torch's CPU GEMM may pick
# another kernel, with another summation order, for another row count: the real rows then differ
# by rounding, a few ulps of fp32 (on a Zen 5 EPYC 1.5e-5 on a logit of 42, 3.6e-7 relative,
# past LOGITS_ATOL alone). 1e-6 relative is ~8 ulps: rounding, never a wrong row.
LOGITS_RTOL = 1e-6


def test_capture_sizes_and_padding() -> None:
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(1) == [1]
    sizes = capture_sizes(32)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 25, 32, 33)] == [1, 2, 4, 8, 8, 16, 24, 32, 32, None]
    assert block_buckets(512, graded=True) == [16, 64, 256, 512]
    assert block_buckets(100, graded=True) == [16, 64, 100]
    assert block_buckets(10, graded=True) == [10]
    assert block_buckets(512, graded=False) == [512]


def test_buffers_pad_rows_onto_the_scratch_block() -> None:
    block_size, scratch = 4, 99
    buffers = DecodeBuffers(max_size=8, max_blocks=5, block_size=block_size, scratch_block=scratch, device=CPU)
    step = DecodeInputs(input_ids=[11, 12, 13], positions=[5, 0, 9], block_tables=[[7, 2], [3], [1, 4, 6]],
                        sample_rows=[0, 1, 2])
    buffers.fill(step, size=4, num_blocks=3)
    assert buffers.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buffers.positions[:4].tolist() == [5, 0, 9, 0]
    # row 0: position 5 is block 1 of its table (2), offset 1; the padding row writes slot 0 of the scratch block
    assert buffers.slot_mapping[:4].tolist() == [2 * 4 + 1, 3 * 4 + 0, 6 * 4 + 1, scratch * 4]
    assert buffers.seq_lens[:4].tolist() == [6, 1, 10, 1]
    assert buffers.tables(4, 3).tolist() == [[7, 2, scratch], [3, scratch, scratch], [1, 4, 6], [scratch] * 3]
    assert buffers.tables(4, 3).is_contiguous()
    buffers.fill(None, size=2, num_blocks=5)  # the dummy step of capture: padding only
    assert buffers.slot_mapping[:2].tolist() == [scratch * 4] * 2
    assert buffers.tables(2, 5).tolist() == [[scratch] * 5] * 2
    with pytest.raises(AssertionError):
        buffers.fill(step, size=2, num_blocks=3)  # 3 rows do not fit 2


def test_only_one_token_steps_are_graphed() -> None:
    def item(name: str, tokens: list[int], computed: int, sample: bool = True) -> ScheduledRequest:
        return ScheduledRequest(name, tokens, computed, [4, 5], sample)

    scratch, block_size = 99, 16
    decode = SchedulerOutput([item("a", [7], 20), item("b", [8], 3, sample=False)])
    inputs = decode_inputs(decode, scratch, block_size)
    assert inputs is not None
    assert (inputs.input_ids, inputs.positions, inputs.sample_rows) == ([7, 8], [20, 3], [0])
    assert decode_inputs(SchedulerOutput([item("a", [7], 20), item("b", [1, 2], 0)]), scratch, block_size) is None
    # a static batch's padding rows: after the scheduled ones, over the scratch block, never sampled
    static = decode_inputs(SchedulerOutput([item("a", [7], 20)], padding_seq_lens=[9, 40]), scratch, block_size)
    assert static is not None
    assert (static.input_ids, static.positions, static.sample_rows) == ([7, 0, 0], [20, 8, 39], [0])
    assert static.block_tables == [[4, 5], [scratch], [scratch] * 3]


def twin_drivers(model: LlamaForCausalLM, num_blocks: int, block_size: int) -> tuple[PagedDriver, PagedDriver, int]:
    """Two drivers allocating the same blocks, each over its own caches, with one more block
    (the scratch block) that neither hands out."""
    scratch = num_blocks
    drivers = []
    for _ in range(2):
        driver = PagedDriver(model, num_blocks=num_blocks + 1, block_size=block_size, seed=4)
        driver.free_blocks.remove(scratch)
        drivers.append(driver)
    return drivers[0], drivers[1], scratch


def test_padded_graph_step_equals_the_eager_step() -> None:
    """Prompts prefilled eagerly, then decode steps of 3, 5, 12 and 1 sequences (padded to 4, 8,
    12, 1) through the runner's buffers match an eager twin's logits; padding rows write only
    the scratch block; sequences past the smallest block budget take the next one."""
    check_padded_steps(CPU, torch.float32, capture=False)


@torch.inference_mode()
def check_padded_steps(device: torch.device, dtype: torch.dtype, capture: bool, backend: str = "gather",
                       atol: float = LOGITS_ATOL) -> None:
    """The comparison above on `device` in `dtype`, replaying captured graphs when `capture`
    (tests/gpu reuses it)."""
    model = tiny_model("gqa2_hd16").to(device, dtype)
    block_size = 4
    eager, graphed, scratch = twin_drivers(model, num_blocks=400, block_size=block_size)
    runner = CudaGraphRunner(model, graphed.kv_caches, max_num_seqs=12, max_model_len=model.config.max_position_embeddings,
                             scratch_block=scratch, backend=backend)
    assert runner.sizes == [1, 2, 4, 8, 12] and runner.buckets == ([16, 64] if backend == "gather" else [64])
    if capture:
        runner.capture()
        assert len(runner.graphs) == len(runner.sizes) * len(runner.buckets)
    gen = torch.Generator().manual_seed(1)
    names = [f"s{i}" for i in range(12)]
    lengths = [5, 30, 58, 12, 70, 3, 88, 20, 45, 9, 66, 2]  # s5 stays under 16 blocks, s6 needs more
    prompts = {n: torch.randint(0, 101, (length,), generator=gen).tolist() for n, length in zip(names, lengths)}
    for driver in (eager, graphed):
        driver.step([(n, prompts[n]) for n in names])
    buckets_seen = set()
    for step_names in (names[:3], names[3:8], names, names[5:6], names[::-1], names[:3]):
        batch = [(n, [int(torch.randint(0, 101, (1,), generator=gen))]) for n in step_names]
        want = eager.step(batch)  # [n, vocab]
        step = DecodeInputs(
            input_ids=[t[0] for _, t in batch],
            positions=[graphed.num_computed[n] for n, _ in batch],
            block_tables=[graphed.block_tables[n] for n, _ in batch],
            sample_rows=list(range(len(batch))),
        )
        # the driver's bookkeeping for the graphed twin (allocate, then advance)
        for n, tokens in batch:
            table = graphed.block_tables[n]
            while len(table) * block_size < graphed.num_computed[n] + 1:
                table.append(graphed.free_blocks.pop())
        key = runner.graph_key(step)
        assert key is not None and key[0] >= len(batch)
        buckets_seen.add(key[1])
        got = runner.run(step)
        for n, _ in batch:
            graphed.num_computed[n] += 1
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=atol, rtol=LOGITS_RTOL)
    assert buckets_seen == set(runner.buckets)
    # Padding rows wrote the scratch block alone: every block no sequence owns is still zero.
    unowned = sorted(set(range(scratch)) - {b for table in graphed.block_tables.values() for b in table})
    assert graphed.free_blocks and set(graphed.free_blocks) <= set(unowned)
    for (k_eager, v_eager), (k_graph, v_graph) in zip(eager.kv_caches, graphed.kv_caches):
        assert not k_graph[unowned].any() and not v_graph[unowned].any() and k_graph[scratch].any()
        torch.testing.assert_close(k_graph[:scratch], k_eager[:scratch], atol=atol, rtol=0)
        torch.testing.assert_close(v_graph[:scratch], v_eager[:scratch], atol=atol, rtol=0)
    too_many = DecodeInputs([0] * 13, [0] * 13, [[0]] * 13, list(range(13)))
    too_long = DecodeInputs([0], [0], [[0] * 65], [0])
    assert runner.graph_key(too_many) is None and runner.graph_key(too_long) is None


def _graphed_as_eager(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[DecodeInputs]:
    """`llm`'s greedy tokens through the ModelRunner's graphed path (installed by hand on CPU,
    where it runs the padded step eagerly) equal its eager tokens; returns the graphed steps."""
    eager = [out.token_ids for out in llm.generate(prompts, params)]
    runner = llm.engine.runner
    graph_runner = CudaGraphRunner(runner.model, runner.kv_caches, 8, runner.max_model_len,  # type: ignore[arg-type]
                                   runner.scratch_block)
    calls: list[DecodeInputs] = []
    run = graph_runner.run
    graph_runner.run = lambda step: calls.append(step) or run(step)  # type: ignore[method-assign]
    runner.graph_runner = graph_runner
    try:
        graphed = [out.token_ids for out in llm.generate(prompts, params)]
    finally:
        runner.graph_runner = None
    assert graphed == eager
    return calls


def test_engine_decodes_through_the_graph_runner_as_it_does_eagerly() -> None:
    """The first step cannot take every prompt (24 tokens), and a prompt budget of 2 units then
    feeds the rest one token a step beside the decodes: steps of one token a row where a
    prompt's row samples nothing."""
    llm = LLM(dtype="float32", quantization="none", prepack_weights=False, max_num_seqs=8, enable_prefix_caching=False,
              max_num_batched_tokens=24, prefill_budget=2, seed=0)
    prompts = [[1 + (31 * i + 7 * j) % 4000 for j in range(length)] for i, length in enumerate((9, 14, 6, 11, 8))]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (4, 6, 1, 5, 3)]
    calls = _graphed_as_eager(llm, prompts, params)
    assert calls and max(step.num_seqs for step in calls) >= 3  # padded: 3 rows run as 4


def test_static_batches_padding_rows_go_through_the_graph_runner() -> None:
    """Static batching's fixed-shape steps (finished slots computed as padding rows over the
    scratch block) run through the graphed path too, with the eager path's tokens."""
    llm = LLM(dtype="float32", quantization="none", prepack_weights=False, max_num_seqs=4, enable_prefix_caching=False,
              policy="static", static_padding=True, seed=0)
    prompts = [[1 + (17 * i + 5 * j) % 4000 for j in range(length)] for i, length in enumerate((7, 12, 5, 9, 10))]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 7, 3, 5, 4)]
    calls = _graphed_as_eager(llm, prompts, params)
    padded = [step for step in calls if step.num_seqs > len(step.sample_rows)]
    assert padded and all(step.sample_rows == list(range(len(step.sample_rows))) for step in padded)
