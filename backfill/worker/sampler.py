"""Sampler: one row of logits per request -> one token id per request (+ logprobs).

Per call, in order (vLLM semantics, batched over rows):
  raw logprobs  log_softmax of the model's logits, for rows that asked (vLLM's "raw" mode)
  penalties     repetition (prompt or output tokens), frequency (x output count), presence
  logit_bias    added to the listed token ids
  allowed ids   every other token masked (allowed_token_ids)
  bad_words     a word's last token masked where the output ends with the tokens before it
  min_tokens    stop_token_ids (and EOS unless ignore_eos) masked while outputs < min_tokens
  greedy        temperature 0: argmax of the processed logits
  random        / temperature, top_k, top_p, min_p, then inverse-CDF sampling: one uniform draw
                per row (`inverse_cdf_sample`).
On a CPU with the kernels extension, the argmax and the inverse-CDF pick run there (the same
indices as their torch references, which run elsewhere).

Everything that depends only on which requests share the batch (parameter tensors, index
tensors) is built once per batch composition and reused while the composition is unchanged, so
a steady decode batch does no per-row Python work besides the rows that need it (seeded rows
draw from their own generator; min_tokens rows check their count).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from backfill import kernels
from backfill.core.outputs import TokenLogprobs
from backfill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from backfill.structured_output.manager import GrammarBitmask

logger = logging.getLogger(__name__)

# Temperatures below this sample greedily (as in vLLM): dividing by them overflows float32.
GREEDY_TEMPERATURE_EPS = 1e-5
_INITIAL_PENALTY_SLOTS = 8


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row, in row order
    logprobs: list[TokenLogprobs | None] | None  # None if no row asked for logprobs


@dataclass
class _RequestState:
    params: SamplingParams
    greedy: bool
    generator: torch.Generator | None  # the request's own stream when it is seeded and random
    penalty_slot: int  # its row in the sampler's count tables; -1 when it uses no penalty
    min_tokens_ids: list[int]  # masked while num_output_tokens < params.min_tokens
    num_output_tokens: int = 0  # counted only for requests with min_tokens_ids
    # bad_words: each word's tokens, and the output's last tokens (as many as the longest word's
    # less one); None when the request has none.
    bad_words: list[list[int]] | None = None
    recent: list[int] | None = None

    def banned(self) -> list[int]:
        """The last token of every bad word whose other tokens end the output so far."""
        assert self.bad_words is not None and self.recent is not None
        recent = self.recent
        return [word[-1] for word in self.bad_words
                if len(word) == 1 or (len(word) - 1 <= len(recent) and recent[len(recent) - len(word) + 1:] == word[:-1])]


@dataclass
class _BatchPlan:
    """What a batch needs that depends only on which requests are in it (built once per composition)."""

    request_ids: tuple[str, ...]
    states: list[_RequestState]
    all_greedy: bool
    greedy_mask: torch.Tensor | None  # [S] bool; None unless the batch mixes greedy and random rows
    temperature: torch.Tensor | None  # [S, 1] (1.0 on greedy rows); None when all greedy
    top_k: torch.Tensor | None  # [S] int64 in [1, V], V where disabled; None when no row uses it
    max_top_k: int  # the largest enabled k (0 when top_k is None)
    top_p: torch.Tensor | None  # [S, 1], 1.0 where disabled; None when no row uses it
    min_p: torch.Tensor | None  # [S, 1], 0.0 where disabled; None when no row uses it
    penalty_rows: torch.Tensor | None  # [P] int64 rows with penalties; None when none
    penalty_slots: torch.Tensor | None  # [P] int64 their rows in the count tables
    repetition: torch.Tensor | None  # [P, 1]; None when every row's is 1
    frequency: torch.Tensor | None  # [P, 1]; None when every row's is 0
    presence: torch.Tensor | None  # [P, 1]; None when every row's is 0
    bias_index: tuple[torch.Tensor, torch.Tensor] | None  # ([B] rows, [B] token ids)
    bias_values: torch.Tensor | None  # [B]
    allowed_rows: torch.Tensor | None  # [A] int64 rows with allowed_token_ids; None when none
    allowed_mask: torch.Tensor | None  # [A, V] bool: True where the row may sample the token
    min_tokens_rows: list[int]  # rows whose request has a min_tokens to enforce
    bad_words_rows: list[int]  # rows whose request has bad_words
    seeded_rows: list[int]  # random rows that draw from their own generator
    logprobs_rows: list[int]  # rows that asked for logprobs
    logprobs_index: torch.Tensor | None  # [L] int64, the same rows as a tensor
    max_num_logprobs: int


class Sampler:
    """Owns each running request's sampling state: parameters, generator, token history.

    `add_request` before a request's first `sample`; `remove_request` when it leaves the engine
    (not on preemption: its history and generator must survive a recompute). Adding an id that is
    already present keeps its state, so re-sending a preempted request is harmless.
    """

    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...], device: torch.device, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = torch.device(device)
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed)
        self._requests: dict[str, _RequestState] = {}
        self._plan: _BatchPlan | None = None
        # Count tables for requests with penalties, one row ("slot") each, grown by doubling.
        self._output_counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=self.device)  # [slots, V]
        self._prompt_mask = torch.zeros((0, vocab_size), dtype=torch.bool, device=self.device)  # [slots, V]
        self._free_slots: list[int] = []
        self._bit_shifts: torch.Tensor | None = None  # [32] int32, unpacks grammar bitmasks
        # NOTE: torch's CPU argmax reads one element at a time (~3 ms for [32, 49152]); the
        # kernels' argmax_rows gives the same indices ~10x faster.
        ext = kernels.extension() if self.device.type == "cpu" else None
        self._argmax_rows = getattr(ext, "argmax_rows", None)
        # Likewise its inverse_cdf_sample: the reference's tokens without its float64 cumsum tensor.
        self._inverse_cdf_sample = getattr(ext, "inverse_cdf_sample", None)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @torch.inference_mode()
    def add_request(self, request_id: str, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        """Register a request. Raises ValueError if its logit_bias names a token outside the vocabulary."""
        if request_id in self._requests:
            return
        bad_words = [t for word in params.bad_words_token_ids or () for t in word]
        for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ()),
                          ("bad_words", bad_words)):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")
        greedy = params.temperature < GREEDY_TEMPERATURE_EPS
        generator = None
        if params.seed is not None and not greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        slot = -1
        if params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
            slot = self._allocate_slot()
            self._output_counts[slot].zero_()
            self._prompt_mask[slot].zero_()
            prompt = [t for t in prompt_token_ids if 0 <= t < self.vocab_size]
            if prompt:
                self._prompt_mask[slot, torch.tensor(prompt, dtype=torch.long, device=self.device)] = True
        min_tokens_ids: list[int] = []
        if params.min_tokens > 0:
            stop_ids = list(params.stop_token_ids or [])
            if not params.ignore_eos:
                stop_ids += self.eos_token_ids
            min_tokens_ids = [t for t in dict.fromkeys(stop_ids) if t < self.vocab_size]
        bad_words = params.bad_words_token_ids or None
        self._requests[request_id] = _RequestState(params, greedy, generator, slot, min_tokens_ids,
                                                   bad_words=bad_words, recent=[] if bad_words else None)
        self._plan = None

    def remove_request(self, request_id: str) -> None:
        """Forget a request (unknown ids are ignored); its count-table slot is reused."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        if state.penalty_slot >= 0:
            self._free_slots.append(state.penalty_slot)
        self._plan = None

    @torch.inference_mode()
    def sample(self, request_ids: list[str], logits: torch.Tensor,
               grammar_bitmask: GrammarBitmask | None = None) -> SamplerOutput:
        """Pick one token per row and append it to that request's history.

        `logits` [S, V] holds one row per id in `request_ids` (all added before); it is not
        modified. Results are in row order. The rows of `grammar_bitmask` (constrained requests)
        may only pick the tokens their row allows.
        """
        assert logits.dim() == 2 and logits.shape == (len(request_ids), self.vocab_size), (
            f"logits {tuple(logits.shape)} for {len(request_ids)} requests, vocab {self.vocab_size}"
        )
        if not request_ids:
            return SamplerOutput(token_ids=[], logprobs=None)
        if logits.dtype != torch.float32:  # (no call at all where it already is)
            logits = logits.float()  # [S, V]
        plan = self._plan_for(request_ids)
        processed = self._process(plan, logits)  # [S, V]
        if grammar_bitmask is not None:
            processed = self._apply_grammar(request_ids, logits, processed, grammar_bitmask)
        if plan.all_greedy:
            tokens = self._argmax(processed)  # [S]
        else:
            tokens = self._sample_random(plan, processed)  # [S]
        self._record(plan, tokens)
        logprobs = self._logprobs(plan, logits, tokens) if plan.logprobs_rows else None
        return SamplerOutput(token_ids=tokens.tolist(), logprobs=logprobs)

    def plain_greedy(self, request_ids: list[str]) -> bool:
        """Whether `sample` would take each row's argmax of the logits as they are (every row
        greedy, nothing to apply first, no logprobs) and record nothing: a caller that computes
        those argmaxes itself (CpuDecoder.decode) may skip `sample`."""
        plan = self._plan_for(request_ids)
        return (plan.all_greedy and plan.penalty_rows is None and plan.bias_index is None
                and plan.allowed_rows is None and not plan.min_tokens_rows and not plan.bad_words_rows
                and not plan.logprobs_rows)

    # -- per composition ------------------------------------------------------------------------

    def _plan_for(self, request_ids: list[str]) -> _BatchPlan:
        key = tuple(request_ids)
        if self._plan is not None and self._plan.request_ids == key:
            return self._plan
        try:
            states = [self._requests[request_id] for request_id in request_ids]
        except KeyError as error:
            raise KeyError(f"sample: request {error.args[0]!r} was never added to the sampler") from None
        self._plan = self._build_plan(key, states)
        return self._plan

    def _build_plan(self, key: tuple[str, ...], states: list[_RequestState]) -> _BatchPlan:
        device, vocab = self.device, self.vocab_size
        greedy = [s.greedy for s in states]
        all_greedy = all(greedy)
        random_params = [None if s.greedy else s.params for s in states]

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)  # [n, 1]

        temperature = top_k = top_p = min_p = greedy_mask = None
        max_top_k = 0
        if not all_greedy:
            temperature = column([p.temperature if p else 1.0 for p in random_params])
            if any(greedy):
                greedy_mask = torch.tensor(greedy, dtype=torch.bool, device=device)  # [S]
            ks = [p.top_k if p and 0 < p.top_k < vocab else vocab for p in random_params]
            max_top_k = max((k for k in ks if k < vocab), default=0)
            if max_top_k:
                top_k = torch.tensor(ks, dtype=torch.long, device=device)  # [S]
            ps = [p.top_p if p else 1.0 for p in random_params]
            if any(p < 1.0 for p in ps):
                top_p = column(ps)
            min_ps = [p.min_p if p else 0.0 for p in random_params]
            if any(m > 0.0 for m in min_ps):
                min_p = column(min_ps)

        rows = [i for i, s in enumerate(states) if s.penalty_slot >= 0]
        penalty_rows = penalty_slots = repetition = frequency = presence = None
        if rows:
            penalty_rows = torch.tensor(rows, dtype=torch.long, device=device)  # [P]
            penalty_slots = torch.tensor([states[i].penalty_slot for i in rows], dtype=torch.long, device=device)
            reps = [states[i].params.repetition_penalty for i in rows]
            freqs = [states[i].params.frequency_penalty for i in rows]
            pres = [states[i].params.presence_penalty for i in rows]
            repetition = column(reps) if any(r != 1.0 for r in reps) else None
            frequency = column(freqs) if any(f != 0.0 for f in freqs) else None
            presence = column(pres) if any(p != 0.0 for p in pres) else None

        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_vals: list[float] = []
        for i, s in enumerate(states):
            if s.params.logit_bias:
                bias_rows += [i] * len(s.params.logit_bias)
                bias_ids += s.params.logit_bias.keys()
                bias_vals += s.params.logit_bias.values()
        bias_index = bias_values = None
        if bias_rows:
            bias_index = (
                torch.tensor(bias_rows, dtype=torch.long, device=device),  # [B]
                torch.tensor(bias_ids, dtype=torch.long, device=device),  # [B]
            )
            bias_values = torch.tensor(bias_vals, dtype=torch.float32, device=device)  # [B]

        rows = [i for i, s in enumerate(states) if s.params.allowed_token_ids is not None]
        allowed_rows = allowed_mask = None
        if rows:
            allowed_rows = torch.tensor(rows, dtype=torch.long, device=device)  # [A]
            allowed_mask = torch.zeros((len(rows), vocab), dtype=torch.bool, device=device)  # [A, V]
            for j, i in enumerate(rows):
                allowed_mask[j, states[i].params.allowed_token_ids] = True

        logprobs_rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        return _BatchPlan(
            request_ids=key,
            states=states,
            all_greedy=all_greedy,
            greedy_mask=greedy_mask,
            temperature=temperature,
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=top_p,
            min_p=min_p,
            penalty_rows=penalty_rows,
            penalty_slots=penalty_slots,
            repetition=repetition,
            frequency=frequency,
            presence=presence,
            bias_index=bias_index,
            bias_values=bias_values,
            allowed_rows=allowed_rows,
            allowed_mask=allowed_mask,
            min_tokens_rows=[i for i, s in enumerate(states) if s.min_tokens_ids],
            bad_words_rows=[i for i, s in enumerate(states) if s.bad_words],
            seeded_rows=[i for i, s in enumerate(states) if s.generator is not None],
            logprobs_rows=logprobs_rows,
            logprobs_index=torch.tensor(logprobs_rows, dtype=torch.long, device=device) if logprobs_rows else None,
            max_num_logprobs=max((states[i].params.logprobs or 0 for i in logprobs_rows), default=0),
        )

    # -- per call -------------------------------------------------------------------------------

    def _process(self, plan: _BatchPlan, logits: torch.Tensor) -> torch.Tensor:
        """Penalties, then logit_bias, allowed_token_ids and min_tokens; returns `logits` itself
        when none apply."""
        mask_rows: list[int] = []
        mask_ids: list[int] = []
        for row in plan.min_tokens_rows:
            state = plan.states[row]
            if state.num_output_tokens < state.params.min_tokens:
                mask_rows += [row] * len(state.min_tokens_ids)
                mask_ids += state.min_tokens_ids
        for row in plan.bad_words_rows:
            banned = plan.states[row].banned()
            mask_rows += [row] * len(banned)
            mask_ids += banned
        if plan.penalty_rows is None and plan.bias_index is None and plan.allowed_rows is None and not mask_rows:
            return logits
        logits = logits.clone()  # [S, V]
        if plan.penalty_rows is not None:
            assert plan.penalty_slots is not None
            rows = logits[plan.penalty_rows]  # [P, V]
            counts = self._output_counts[plan.penalty_slots]  # [P, V] int32
            in_output = counts > 0  # [P, V]
            if plan.repetition is not None:
                seen = in_output | self._prompt_mask[plan.penalty_slots]  # [P, V]
                scale = torch.where(seen, plan.repetition, 1.0)  # [P, V]
                rows = torch.where(rows > 0, rows / scale, rows * scale)  # [P, V]
            if plan.frequency is not None:
                rows = rows - plan.frequency * counts  # [P, V]
            if plan.presence is not None:
                rows = rows - plan.presence * in_output  # [P, V]
            logits[plan.penalty_rows] = rows
        if plan.bias_index is not None:
            assert plan.bias_values is not None
            logits.index_put_(plan.bias_index, plan.bias_values, accumulate=True)
        if plan.allowed_rows is not None:
            assert plan.allowed_mask is not None
            logits[plan.allowed_rows] = logits[plan.allowed_rows].masked_fill(~plan.allowed_mask, float("-inf"))
        if mask_rows:
            rows_t = torch.tensor(mask_rows, dtype=torch.long, device=self.device)  # [M]
            ids_t = torch.tensor(mask_ids, dtype=torch.long, device=self.device)  # [M]
            logits[rows_t, ids_t] = float("-inf")
        return logits

    def _apply_grammar(self, request_ids: list[str], logits: torch.Tensor, processed: torch.Tensor,
                       grammar_bitmask: GrammarBitmask) -> torch.Tensor:
        """-inf on every token a constrained row's grammar does not allow (after penalties and
        biases, so they only reorder allowed tokens; before temperature, top-k/p, min-p)."""
        row_of = {request_id: row for row, request_id in enumerate(request_ids)}
        rows = torch.tensor([row_of[r] for r in grammar_bitmask.request_ids], dtype=torch.long,
                            device=self.device)  # [R]
        words = grammar_bitmask.bitmask  # [R, W] int32, on the CPU
        if self.device.type == "cpu" and sys.byteorder == "little":
            # Bit t of a little-endian int32 word is bit t % 8 of its byte t // 8: unpacking the
            # bytes least significant bit first gives the tokens in order (one pass, ~10x faster
            # than shifting every word 32 times).
            bits = np.unpackbits(words.numpy().view(np.uint8), axis=1, bitorder="little")  # [R, W * 32]
            allowed = torch.from_numpy(bits[:, : self.vocab_size])  # [R, V] uint8
        else:
            words = words.to(self.device, non_blocking=True)
            if self._bit_shifts is None or self._bit_shifts.device != words.device:
                self._bit_shifts = torch.arange(32, dtype=torch.int32, device=words.device)  # [32]
            allowed = ((words.unsqueeze(-1) >> self._bit_shifts) & 1).flatten(1)[:, : self.vocab_size]  # [R, V]
        if processed is logits:
            processed = logits.clone()  # [S, V]
        processed[rows] = processed[rows].masked_fill(allowed == 0, float("-inf"))
        return processed

    def _sample_random(self, plan: _BatchPlan, logits: torch.Tensor) -> torch.Tensor:
        assert plan.temperature is not None
        scaled = logits / plan.temperature  # [S, V]
        if plan.top_p is not None:
            scaled = _apply_top_k_top_p(scaled, plan.top_k, plan.top_p)  # [S, V]
        elif plan.top_k is not None:
            scaled = _apply_top_k(scaled, plan.top_k, plan.max_top_k)  # [S, V]
        probs = scaled.softmax(dim=-1)  # [S, V]
        if plan.min_p is not None:
            threshold = probs.amax(dim=-1, keepdim=True) * plan.min_p  # [S, 1]
            probs.masked_fill_(probs < threshold, 0.0)
        # Inverse-CDF sampling: one uniform draw per row picks token i with probability
        # probs[i] / sum(probs), so truncated rows need no renormalization, and a zero-probability
        # token (a flat step of the CDF) can never be hit. One draw per row, not one per token.
        u = torch.rand((probs.shape[0], 1), dtype=torch.float64, device=self.device, generator=self._generator)  # [S, 1]
        for row in plan.seeded_rows:
            # A seeded row's draw comes only from its own stream, so its tokens do not depend on
            # which requests share the batch.
            u[row] = torch.rand(1, dtype=torch.float64, device=self.device, generator=plan.states[row].generator)
        if self._inverse_cdf_sample is not None:
            sampled = self._inverse_cdf_sample(probs, u)  # [S], the same tokens as inverse_cdf_sample below
        else:
            sampled = inverse_cdf_sample(probs, u)  # [S]
        if plan.greedy_mask is not None:
            sampled = torch.where(plan.greedy_mask, self._argmax(logits), sampled)  # [S]
        return sampled

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [S, V] float32 -> [S] int64: `logits.argmax(dim=-1)`, by the kernels where they run."""
        if self._argmax_rows is not None:
            return self._argmax_rows(logits)
        return logits.argmax(dim=-1)

    def _record(self, plan: _BatchPlan, tokens: torch.Tensor) -> None:
        """Append each row's new token to its request's history (only what penalties/min_tokens read)."""
        if plan.penalty_rows is not None:
            assert plan.penalty_slots is not None
            ones = torch.ones(plan.penalty_slots.shape, dtype=torch.int32, device=self.device)  # [P]
            self._output_counts.index_put_((plan.penalty_slots, tokens[plan.penalty_rows]), ones, accumulate=True)
        for row in plan.min_tokens_rows:
            plan.states[row].num_output_tokens += 1
        if plan.bad_words_rows:
            token_ids = tokens.tolist()
            for row in plan.bad_words_rows:
                state = plan.states[row]
                assert state.recent is not None and state.bad_words is not None
                state.recent.append(token_ids[row])
                excess = len(state.recent) - max(len(word) for word in state.bad_words) + 1
                if excess > 0:
                    del state.recent[:excess]

    def _logprobs(self, plan: _BatchPlan, logits: torch.Tensor, tokens: torch.Tensor) -> list[TokenLogprobs | None]:
        """Raw logprobs (log_softmax of the model's logits) of the chosen and the top-N tokens."""
        assert plan.logprobs_index is not None
        logprobs = logits[plan.logprobs_index].log_softmax(dim=-1)  # [L, V]
        chosen_ids = tokens[plan.logprobs_index]  # [L]
        chosen = logprobs.gather(1, chosen_ids.unsqueeze(1)).squeeze(1).tolist()  # [L]
        top_values: list[list[float]] = [[] for _ in plan.logprobs_rows]
        top_ids: list[list[int]] = [[] for _ in plan.logprobs_rows]
        if plan.max_num_logprobs > 0:
            top = logprobs.topk(plan.max_num_logprobs, dim=-1)  # [L, N]
            top_values, top_ids = top.values.tolist(), top.indices.tolist()
        result: list[TokenLogprobs | None] = [None] * len(plan.states)
        for j, (row, token_id) in enumerate(zip(plan.logprobs_rows, chosen_ids.tolist())):
            n = plan.states[row].params.logprobs or 0
            result[row] = TokenLogprobs(token_id, chosen[j], list(zip(top_ids[j][:n], top_values[j][:n])))
        return result

    def _allocate_slot(self) -> int:
        if not self._free_slots:
            old = self._output_counts.shape[0]
            new = max(_INITIAL_PENALTY_SLOTS, 2 * old)
            counts = torch.zeros((new, self.vocab_size), dtype=torch.int32, device=self.device)  # [slots, V]
            counts[:old] = self._output_counts
            prompt = torch.zeros((new, self.vocab_size), dtype=torch.bool, device=self.device)  # [slots, V]
            prompt[:old] = self._prompt_mask
            self._output_counts, self._prompt_mask = counts, prompt
            self._free_slots = list(range(new - 1, old - 1, -1))
        return self._free_slots.pop()


def inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [S, V] (unnormalized, >= 0), u [S, 1] float64 uniform in [0, 1) -> [S] int64: the
    token whose CDF step holds (1 - u) x the row's mass (the reference of the kernels' version)."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # [S, V]
    target = (1.0 - u) * cdf[:, -1:]  # [S, 1], in (0, total mass]
    return torch.searchsorted(cdf, target).squeeze(1).clamp_max_(probs.shape[1] - 1)  # [S]


_TOP_P_CANDIDATES = 1024  # best tokens searched for the nucleus before a full sort


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
    """Keep each row's k largest logits (ties at the k-th value kept); k == V keeps all.

    `max_k` is the largest k below V, so topk reads only as many columns as a row needs.
    """
    vocab = logits.shape[-1]
    enabled = top_k < vocab  # [S]
    k = torch.where(enabled, top_k, 1)  # [S]; disabled rows read a dummy 1st value, masked below
    kth = logits.topk(max_k, dim=-1).values  # [S, max_k]
    index = (k - 1).unsqueeze(1)  # [S, 1]
    threshold = kth.gather(1, index).masked_fill_(~enabled.unsqueeze(1), float("-inf"))  # [S, 1]
    return logits.masked_fill(logits < threshold, float("-inf"))  # [S, V]


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k, then top-p over what top-k kept: the smallest set of best tokens whose mass >= p.

    A token is dropped when the tokens strictly above it already hold >= p (vLLM's rule); the
    best token always stays. Sorting the whole vocabulary is the slow part, so the nucleus is
    first looked for among the best `_TOP_P_CANDIDATES` tokens; rows whose nucleus (or top-k
    set) reaches past them fall back to the full sort. Both paths give the same result.
    """
    vocab = logits.shape[-1]
    num_candidates = min(vocab, _TOP_P_CANDIDATES)
    values, index = logits.topk(num_candidates, dim=-1)  # [S, C] best first, [S, C]
    if top_k is not None:
        enabled = (top_k < vocab).unsqueeze(1)  # [S, 1]
        k = torch.where(enabled, top_k.clamp_max(num_candidates).unsqueeze(1), num_candidates)  # [S, 1]
        kth = values.gather(1, k - 1).masked_fill_(~enabled, float("-inf"))  # [S, 1]
        # Every token top-k keeps must be a candidate: k inside, and no tie at the k-th value past them.
        complete = (~enabled | (top_k.unsqueeze(1) < num_candidates) & (values[:, -1:] < kth)).squeeze(1)  # [S]
        complete |= num_candidates == vocab
        values = values.masked_fill(values < kth, float("-inf"))  # [S, C]
        mass_logits = logits.masked_fill(logits < kth, float("-inf"))  # [S, V], what top-k kept
    else:
        complete = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)  # [S]
        mass_logits = logits
    total = torch.logsumexp(mass_logits, dim=-1, keepdim=True)  # [S, 1]
    probs = (values - total).exp()  # [S, C]
    cumulative = probs.cumsum(dim=-1)  # [S, C], mass of the best j + 1 tokens
    above = cumulative - probs  # [S, C], mass strictly above each candidate
    complete &= (cumulative[:, -1:] >= top_p).squeeze(1)  # the nucleus ends among the candidates
    values = values.masked_fill(above >= top_p, float("-inf"))  # [S, C]
    out = torch.full_like(logits, float("-inf")).scatter_(1, index, values)  # [S, V]
    if not bool(complete.all()):
        rows = (~complete).nonzero().squeeze(1)  # [R]
        out[rows] = _apply_top_k_top_p_sorted(
            logits[rows], None if top_k is None else top_k[rows], top_p[rows]
        )
    return out


def _apply_top_k_top_p_sorted(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """The reference: sort the whole vocabulary (ascending, as vLLM does) and cut."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)  # [S, V], [S, V]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k).unsqueeze(1))  # [S, 1]
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [S, V]
    drop = cumulative <= 1.0 - top_p  # [S, V]
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)  # [S, V]
