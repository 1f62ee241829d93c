"""A minimal stand-in for the ModelRunner, for model tests: block allocation and a step loop.

Blocks are handed out from a shuffled free list, so every sequence's block table is
non-contiguous and interleaved with the others' (the case paged attention must get right).
"""

from __future__ import annotations

import random

import torch
from torch import Tensor

from backfill.model.attention import build_attention_metadata
from backfill.model.cpu_decoder import CpuDecoder
from backfill.model.llama import LlamaForCausalLM


class PagedDriver:
    def __init__(
        self, model: LlamaForCausalLM | CpuDecoder, num_blocks: int = 64, block_size: int = 16, seed: int = 0
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.kv_caches = model.make_kv_caches(num_blocks, block_size)
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    @torch.inference_mode()
    def step(self, batch: list[tuple[str, list[int]]]) -> Tensor:
        """Run one step: each (request_id, new token ids) appends those tokens to that sequence.
        Returns logits [S, vocab] float32 of the last new token of each sequence."""
        for request_id, token_ids in batch:
            table = self.block_tables.setdefault(request_id, [])
            computed = self.num_computed.setdefault(request_id, 0)
            needed = -(-(computed + len(token_ids)) // self.block_size)
            while len(table) < needed:
                table.append(self.free_blocks.pop())
        device = self.kv_caches[0][0].device
        positions, meta = build_attention_metadata(
            [self.num_computed[r] for r, _ in batch],
            [len(t) for _, t in batch],
            [self.block_tables[r] for r, _ in batch],
            self.block_size,
            device,
            sliding_window=self.model.config.sliding_window,
        )
        input_ids = torch.tensor([t for _, ids in batch for t in ids], device=device)  # [T]
        hidden = self.model(input_ids, positions, self.kv_caches, meta)  # [T, hidden]
        last_rows = meta.query_start[1:] - 1  # [S]
        for request_id, token_ids in batch:
            self.num_computed[request_id] += len(token_ids)
        return self.model.compute_logits(hidden[last_rows])  # [S, vocab]

    @torch.inference_mode()
    def greedy(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        chunk: int | None = None,
        suppress_token_ids: tuple[int, ...] = (),
    ) -> list[list[int]]:
        """Greedy continuations of all prompts, batched: prompts are prefilled together (in
        chunks of `chunk` tokens if given), then every sequence decodes one token per step.
        `suppress_token_ids` are never chosen (like transformers' min_new_tokens does for eos)."""
        ids = [f"r{i}" for i in range(len(prompts))]
        pending = {r: list(p) for r, p in zip(ids, prompts)}
        outputs: dict[str, list[int]] = {r: [] for r in ids}
        while any(len(outputs[r]) < max_new_tokens for r in ids):
            batch = []
            for r in ids:
                if len(outputs[r]) >= max_new_tokens:
                    continue
                take = len(pending[r]) if chunk is None else min(chunk, len(pending[r]))
                batch.append((r, pending[r][:take]))
                pending[r] = pending[r][take:]
            logits = self.step(batch)  # [S, vocab]
            logits[:, list(suppress_token_ids)] = float("-inf")
            for (r, _), row in zip(batch, logits):
                if not pending[r]:  # the whole prompt is in: this row predicts a new token
                    token = int(row.argmax())
                    outputs[r].append(token)
                    pending[r] = [token]
        return [outputs[r] for r in ids]
