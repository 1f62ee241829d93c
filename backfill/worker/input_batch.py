"""Flatten one SchedulerOutput into the tensors of a model step."""

from __future__ import annotations

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
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    metadata: AttentionMetadata
    logits_index: torch.Tensor  # [S_sample] int64, rows of the hidden states to sample from
    sample_request_ids: list[str]  # request id of each logits row, in row order


def build_batch(scheduler_output: SchedulerOutput, block_size: int, device: torch.device) -> Batch:
    """Build the step's tensors once; every layer reuses them."""
    scheduled = scheduler_output.scheduled
    assert scheduled, "build_batch needs at least one scheduled request"
    input_ids: list[int] = []
    logits_index: list[int] = []
    sample_request_ids: list[str] = []
    for item in scheduled:
        input_ids.extend(item.token_ids)
        if item.sample:
            logits_index.append(len(input_ids) - 1)
            sample_request_ids.append(item.request_id)
    positions, metadata = build_attention_metadata(
        num_computed_tokens=[item.num_computed_tokens for item in scheduled],
        query_lens=[item.num_tokens for item in scheduled],
        block_tables=[item.block_ids for item in scheduled],
        block_size=block_size,
        device=device,
    )
    return Batch(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=positions,
        metadata=metadata,
        logits_index=torch.tensor(logits_index, dtype=torch.long, device=device),
        sample_request_ids=sample_request_ids,
    )
