"""CudaGraphRunner: decode steps replayed as CUDA graphs, one per (batch size, block budget).

A decode step of a small model is dozens of tiny kernels per layer; launched one by one from
Python, the launches cost more than the arithmetic. A CUDA graph records a whole step once and
replays it with one launch. A graph replays fixed shapes at fixed addresses, so (as nano-vllm
and vLLM do):

- graphs are captured at start-up for a set of batch sizes (`capture_sizes`: 1, 2, 4, 8, 16,
  24, 32, ... up to max_num_seqs) and, for the gather kernel, of block budgets (how many KV
  blocks a row may have: `block_buckets`), largest first into one memory pool;
- every input lives in a static buffer (`DecodeBuffers`); a step of n sequences is padded up to
  the next captured size B and block budget M:

      row:          0 .. n-1                   n .. B-1 (padding)
      input_ids     the step's tokens          0
      positions     num_computed_tokens        0
      slot_mapping  the token's KV slot        the scratch block's slot 0 (a dummy write)
      block_tables  the row's blocks           the scratch block
      seq_lens      position + 1               1

  and only the first n logits rows are returned (padded rows never reach the sampler);
- a static batch's padding rows (finished slots still computed) are rows of the step like any
  other, over the scratch block;
- prompt steps, mixed steps, steps of more sequences than the largest size and sequences
  longer than the largest block budget run eagerly (ModelRunner's ordinary path).

Only `capture` and the replay in `run` are CUDA-specific: on another device `run` computes the
padded step eagerly through the same buffers and metadata, which is how tests check the
padding on CPU.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from backfill.core.outputs import SchedulerOutput
from backfill.model.llama import LlamaForCausalLM
from backfill.model.static_decode import build_static_decode_metadata
from backfill.worker.input_batch import padding_rows

logger = logging.getLogger(__name__)

# Smallest block budget of the gather kernel's graphs, in blocks; each next budget is 4x.
MIN_BLOCK_BUCKET = 16


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 8, up to and including
    max_num_seqs (a step pads to the next one: at most 7 padded rows past 8)."""
    sizes = {s for s in (1, 2, 4, 8) if s <= max_num_seqs}
    sizes.update(range(16, max_num_seqs + 1, 8))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def block_buckets(max_blocks: int, graded: bool) -> list[int]:
    """Block budgets to capture: `graded` (the gather kernel, whose cost grows with the budget)
    MIN_BLOCK_BUCKET x 4^k below max_blocks, then max_blocks; else max_blocks alone."""
    buckets = {max_blocks}
    size = MIN_BLOCK_BUCKET
    while graded and size < max_blocks:
        buckets.add(size)
        size *= 4
    return sorted(buckets)


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest of the ascending `sizes` that holds n, or None when none does."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


@dataclass
class DecodeInputs:
    """One decode-only step on the host: row i is sequence i's one new token."""

    input_ids: list[int]
    positions: list[int]  # = its num_computed_tokens
    block_tables: list[list[int]]
    sample_rows: list[int]  # rows whose logits are sampled (a 1-token prompt chunk is not)

    @property
    def num_seqs(self) -> int:
        return len(self.input_ids)

    @property
    def max_blocks(self) -> int:
        """Blocks the longest row needs this step."""
        return max(len(table) for table in self.block_tables)


def decode_inputs(scheduler_output: SchedulerOutput, scratch_block: int, block_size: int) -> DecodeInputs | None:
    """The step as DecodeInputs when every scheduled sequence computes exactly one token, else
    None (an eager step). A static batch's padding rows (`padding_seq_lens`) come after the
    scheduled rows, as build_batch lays them out: a dummy token over that many tokens of the
    scratch block, never sampled."""
    scheduled = scheduler_output.scheduled
    if not scheduled or any(item.num_tokens != 1 for item in scheduled):
        return None
    padding_positions, padding_tables = padding_rows(scheduler_output.padding_seq_lens, scratch_block, block_size)
    return DecodeInputs(
        input_ids=[item.token_ids[0] for item in scheduled] + [0] * len(padding_positions),
        positions=[item.num_computed_tokens for item in scheduled] + padding_positions,
        block_tables=[item.block_ids for item in scheduled] + padding_tables,
        sample_rows=[i for i, item in enumerate(scheduled) if item.sample],
    )


class DecodeBuffers:
    """The static inputs of every captured graph. The graph for (B, M) reads rows [0, B) and,
    of the block tables, the first B * M entries of one flat buffer viewed [B, M] (contiguous,
    so the gather reads it without a copy)."""

    def __init__(self, max_size: int, max_blocks: int, block_size: int, scratch_block: int,
                 device: torch.device) -> None:
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.input_ids = torch.zeros(max_size, dtype=torch.int64, device=device)  # [N]
        self.positions = torch.zeros(max_size, dtype=torch.int64, device=device)  # [N]
        self.slot_mapping = torch.zeros(max_size, dtype=torch.int64, device=device)  # [N]
        self.seq_lens = torch.zeros(max_size, dtype=torch.int32, device=device)  # [N]
        self.block_tables = torch.zeros(max_size * max_blocks, dtype=torch.int32, device=device)  # [N * M_max]

    def tables(self, size: int, num_blocks: int) -> Tensor:
        return self.block_tables[: size * num_blocks].view(size, num_blocks)  # [B, M]

    def fill(self, step: DecodeInputs | None, size: int, num_blocks: int) -> None:
        """Write `step` into rows [0, n) and padding into rows [n, size) (all rows padding
        when `step` is None: the dummy step of warm-up and capture)."""
        n = 0 if step is None else step.num_seqs
        assert n <= size and (step is None or step.max_blocks <= num_blocks), "step exceeds the graph"
        bs, scratch = self.block_size, self.scratch_block
        pad = size - n
        ids = ([] if step is None else step.input_ids) + [0] * pad
        positions = ([] if step is None else step.positions) + [0] * pad
        tables = [] if step is None else [t + [scratch] * (num_blocks - len(t)) for t in step.block_tables]
        tables += [[scratch] * num_blocks] * pad
        slots = [table[p // bs] * bs + p % bs for table, p in zip(tables, positions)]
        # One host tensor per buffer, copied in one transfer each.
        self.input_ids[:size].copy_(torch.tensor(ids, dtype=torch.int64), non_blocking=True)
        self.positions[:size].copy_(torch.tensor(positions, dtype=torch.int64), non_blocking=True)
        self.slot_mapping[:size].copy_(torch.tensor(slots, dtype=torch.int64), non_blocking=True)
        self.seq_lens[:size].copy_(torch.tensor([p + 1 for p in positions], dtype=torch.int32), non_blocking=True)
        self.tables(size, num_blocks).copy_(torch.tensor(tables, dtype=torch.int32), non_blocking=True)


class CudaGraphRunner:
    """Runs decode-only steps of `model` through captured graphs (CUDA) or eagerly through the
    same padded buffers (elsewhere). Owns the buffers, the graphs and their memory pool; the
    KV caches are the ModelRunner's, written by every replay."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[Tensor, Tensor]],
        max_num_seqs: int,
        max_model_len: int,
        scratch_block: int,
        backend: str = "gather",
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = int(kv_caches[0][0].shape[1])
        self.device = kv_caches[0][0].device
        self.backend = backend
        self.sizes = capture_sizes(max_num_seqs)
        max_blocks = -(-max_model_len // self.block_size)
        self.buckets = block_buckets(max_blocks, graded=backend == "gather")
        self.buffers = DecodeBuffers(self.sizes[-1], max_blocks, self.block_size, scratch_block, self.device)
        vocab = model.config.vocab_size
        self.logits = torch.zeros(self.sizes[-1], vocab, dtype=torch.float32, device=self.device)  # [N, vocab]
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}

    def graph_key(self, step: DecodeInputs) -> tuple[int, int] | None:
        """(batch size, block budget) that `step` is padded to, or None when it runs eagerly."""
        size = padded_size(step.num_seqs, self.sizes)
        num_blocks = padded_size(step.max_blocks, self.buckets)
        return None if size is None or num_blocks is None else (size, num_blocks)

    @torch.inference_mode()
    def _forward(self, size: int, num_blocks: int) -> None:
        """The padded step over the buffers: logits[:size] <- the model's logits of every row."""
        b = self.buffers
        meta = build_static_decode_metadata(
            b.slot_mapping[:size], b.tables(size, num_blocks), b.seq_lens[:size], self.block_size,
            self.model.config.sliding_window, self.backend,
        )
        hidden = self.model(b.input_ids[:size], b.positions[:size], self.kv_caches, meta)  # [B, hidden]
        self.logits[:size].copy_(self.model.compute_logits(hidden))  # [B, vocab]

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per (size, budget), largest first so later ones fit in the pool the
        first allocated. The dummy steps write only the scratch block."""
        assert self.device.type == "cuda", "CUDA graphs need a CUDA device"
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            for num_blocks in reversed(self.buckets):
                self.buffers.fill(None, size, num_blocks)
                self._forward(size, num_blocks)  # warm-up: lazy tables, cuBLAS handles, autotuning
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._forward(size, num_blocks)
                self.graphs[(size, num_blocks)] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decode CUDA graphs (batch sizes %s, block budgets %s, %s attention) in %.1f s",
                    len(self.graphs), self.sizes, self.buckets, self.backend, time.perf_counter() - start)

    @torch.inference_mode()
    def run(self, step: DecodeInputs) -> Tensor:
        """Logits [n, vocab] fp32 of `step`'s rows (graph_key must not be None). Valid until
        the next run."""
        key = self.graph_key(step)
        assert key is not None, "step does not fit any captured graph"
        self.buffers.fill(step, *key)
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
        else:  # not captured (CPU): the same padded step, eagerly
            self._forward(*key)
        return self.logits[: step.num_seqs]  # [n, vocab], padded rows dropped
