"""Prompt logprobs (`SamplingParams.prompt_logprobs`): which of a step's prompt positions go
through the LM head, and the logprobs of the prompt tokens they predict.

Position p's logits predict the prompt's token p + 1, so a prompt of P tokens has P - 1 of
them (its first token has none); position P - 1's logits are the ones sampled from. A chunk
that computes positions [c, c + n) asks for rows c .. min(c + n, P - 1) - 1. Each entry
carries the prompt token's logprob, its rank among all tokens (1: the most likely) and the
top-N alternatives, as raw log_softmax of the model's logits (vLLM's "raw" mode).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from backfill.core.outputs import ScheduledRequest, TokenLogprobs

# Rows whose logits are taken at once: bounds a step's logits to this many x vocab floats.
_ROWS_AT_ONCE = 256


class PromptLogprobs:
    """The requests of one runner that asked for prompt logprobs: their prompts and top-N."""

    def __init__(self) -> None:
        self._requests: dict[str, tuple[list[int], int]] = {}

    def add(self, request_id: str, prompt_token_ids: list[int], num_top: int) -> None:
        self._requests[request_id] = (prompt_token_ids, num_top)

    def remove(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def rows(self, scheduled: list[ScheduledRequest]) -> list[tuple[int, int]]:
        """(index into `scheduled`, n): the step computes these n prompt positions of that item
        (its first n tokens) and their logits are needed."""
        if not self._requests:
            return []
        rows = []
        for index, item in enumerate(scheduled):
            entry = self._requests.get(item.request_id)
            if entry is not None:
                end = min(item.num_computed_tokens + item.num_tokens, len(entry[0]) - 1)
                if end > item.num_computed_tokens:
                    rows.append((index, end - item.num_computed_tokens))
        return rows

    def logprobs(self, scheduled: list[ScheduledRequest], rows: list[tuple[int, int]], hidden: torch.Tensor,
                 compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        """request id -> (the prompt position of its first entry, the entries), from `hidden`
        [sum of n, hidden], the rows of `rows` in order, through the LM head `compute_logits`
        at most _ROWS_AT_ONCE rows at a time."""
        out: dict[str, tuple[int, list[TokenLogprobs]]] = {}
        offset = 0
        for index, count in rows:
            item = scheduled[index]
            prompt, num_top = self._requests[item.request_id]
            first = item.num_computed_tokens + 1  # the prompt position the first row predicts
            entries: list[TokenLogprobs] = []
            for lo in range(0, count, _ROWS_AT_ONCE):
                hi = min(count, lo + _ROWS_AT_ONCE)
                targets = torch.tensor(prompt[first + lo:first + hi], device=hidden.device)  # [r]
                logprobs = compute_logits(hidden[offset + lo:offset + hi]).log_softmax(dim=-1)  # [r, vocab]
                chosen = logprobs.gather(1, targets.unsqueeze(1))  # [r, 1]
                ranks = (logprobs > chosen).sum(dim=1).add_(1).tolist()
                top_values, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (None, None)
                for j, (token_id, value, rank) in enumerate(zip(targets.tolist(), chosen.squeeze(1).tolist(), ranks)):
                    top = [] if top_ids is None else list(zip(top_ids[j].tolist(), top_values[j].tolist()))
                    entries.append(TokenLogprobs(token_id=token_id, logprob=value, top=top, rank=rank))
            out[item.request_id] = (first, entries)
            offset += count
        return out
