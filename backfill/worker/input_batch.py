"""Flatten one SchedulerOutput into the tensors of a model step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from backfill.core.outputs import SchedulerOutput
from backfill.model.attention import AttentionMetadata, build_attention_metadata


@dataclass
class Batch:
    """All tokens scheduled in a step, flattened into one dimension.

    ```
    input_ids    | seq 0 chunk ... | seq 1 (decode) | seq 2 chunk ... |     [T]
    logits_index               ^                 ^                  ^    [S_sample]
    ```
    Only the last token of a sequence that samples this step goes through the LM head.
    Padding rows (static batches, see SchedulerOutput.padding_seq_lens) come last: one token
    each, over the scratch KV block; their logits rows follow the sampled ones. Then the rows
    of `prompt_rows` (prompt positions whose logprobs were asked for), from
    `prompt_logits_start` on.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    metadata: AttentionMetadata
    logits_index: torch.Tensor  # [S_sample + P + prompt rows] int64, rows of the hidden states for the LM head
    sample_request_ids: list[str]  # request id of the first S_sample logits rows (the P padding rows follow)
    prompt_logits_start: int = 0  # S_sample + P: where the prompt_rows' logits rows begin


def padding_rows(padding_lens: Sequence[int], scratch_block: int | None,
                 block_size: int) -> tuple[list[int], list[list[int]]]:
    """A static batch's padding rows (SchedulerOutput.padding_seq_lens): each a dummy token at
    position n - 1 over n tokens of `scratch_block` (its table repeats that block: a real
    context's worth of reads). Returns (positions, block tables)."""
    tables = [[scratch_block] * -(-n // block_size) for n in padding_lens]
    return [n - 1 for n in padding_lens], tables  # type: ignore[return-value]


def build_batch(
    scheduler_output: SchedulerOutput,
    block_size: int,
    device: torch.device,
    scratch_block: int | None = None,
    sliding_window: int | None = None,
    plan_torch_attention: bool = True,
    prompt_rows: Sequence[tuple[int, int]] = (),
) -> Batch:
    """Build the step's tensors once; every layer reuses them.

    Padding rows write and read only `scratch_block`, a KV block the scheduler never hands out
    (its table repeats that block to the row's length: a real context's worth of reads).
    `prompt_rows`: (index into `scheduled`, n): the first n tokens of that item also go through
    the LM head.
    """
    scheduled = scheduler_output.scheduled
    assert scheduled, "build_batch needs at least one scheduled request"
    padding_lens = scheduler_output.padding_seq_lens
    assert scratch_block is not None or not padding_lens, "padding rows need a scratch block"
    input_ids: list[int] = []
    logits_index: list[int] = []
    sample_request_ids: list[str] = []
    starts = []
    for item in scheduled:
        starts.append(len(input_ids))
        input_ids.extend(item.token_ids)
        if item.sample:
            logits_index.append(len(input_ids) - 1)
            sample_request_ids.append(item.request_id)
    for _ in padding_lens:
        input_ids.append(0)
        logits_index.append(len(input_ids) - 1)
    prompt_logits_start = len(logits_index)
    for index, count in prompt_rows:
        logits_index.extend(range(starts[index], starts[index] + count))
    padding_positions, padding_tables = padding_rows(padding_lens, scratch_block, block_size)
    positions, metadata = build_attention_metadata(
        num_computed_tokens=[item.num_computed_tokens for item in scheduled] + padding_positions,
        query_lens=[item.num_tokens for item in scheduled] + [1] * len(padding_lens),
        block_tables=[item.block_ids for item in scheduled] + padding_tables,
        block_size=block_size,
        device=device,
        sliding_window=sliding_window,
        plan_torch_attention=plan_torch_attention,
    )
    ids, rows = torch.tensor(input_ids + logits_index, dtype=torch.long).split([len(input_ids), len(logits_index)])
    return Batch(
        input_ids=ids.to(device),  # [T]
        positions=positions,
        metadata=metadata,
        logits_index=rows.to(device),  # [S_sample + P + prompt rows]
        sample_request_ids=sample_request_ids,
        prompt_logits_start=prompt_logits_start,
    )
