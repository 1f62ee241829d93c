"""PrefillBudget: how much prompt work one step may add while other requests decode."""

from __future__ import annotations

import math

from backfill.core.outputs import ScheduledRequest
from backfill.request import Request


class PrefillBudget:
    """One step's allowance for prompt chunks (requests more than one token behind) while other
    requests decode: `limit` units, a prompt token at position p costing 1 + context_cost * p
    (its attention grows with the context before it, so a chunk late in an 8k prompt gets
    fewer tokens than one at its start and every chunked step costs about the same). None: no
    limit but the step's token budget. A decode (one token behind) is never held back, and the
    first prompt token of a step is always allowed, so every prompt progresses.
    """

    def __init__(self, limit: int | None, context_cost: float) -> None:
        self.limit = limit
        self.context_cost = context_cost
        self.spent = 0.0

    def cost(self, start: int, num_tokens: int) -> float:
        """Units of prompt tokens at positions start .. start + num_tokens - 1."""
        return num_tokens + self.context_cost * (num_tokens * start + num_tokens * (num_tokens - 1) / 2)

    def chunk_len(self, request: Request, budget: int) -> int:
        """Tokens `request` computes this step within `budget` tokens (0: none)."""
        behind = request.num_tokens - request.num_computed_tokens
        num_tokens = min(behind, budget)
        if behind == 1 or self.limit is None or num_tokens == 0:
            return num_tokens
        left = self.limit - self.spent
        start = request.num_computed_tokens
        if self.cost(start, num_tokens) > left:
            # the largest n with cost(start, n) <= left: the root of a quadratic, then made exact
            a, b = self.context_cost / 2, 1 + self.context_cost * (start - 0.5)
            n = int(left / b) if a == 0 else int((-b + math.sqrt(b * b + 4 * a * max(left, 0.0))) / (2 * a))
            n = max(min(n, num_tokens), 0)
            while n > 0 and self.cost(start, n) > left:
                n -= 1
            while n < num_tokens and self.cost(start, n + 1) <= left:
                n += 1
            num_tokens = n if n > 0 or self.spent > 0 else 1
        return num_tokens

    def spend(self, request: Request, num_tokens: int) -> None:
        if num_tokens > 1 or request.num_tokens - request.num_computed_tokens > 1:
            self.spent += self.cost(request.num_computed_tokens, num_tokens)

    def give_back(self, undone: ScheduledRequest) -> None:
        """A chunk taken back (its request was preempted in the same step)."""
        if not undone.sample or undone.num_tokens > 1:
            self.spent -= self.cost(undone.num_computed_tokens, undone.num_tokens)
