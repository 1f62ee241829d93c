"""The engine core's side of constrained decoding: compiles off the step, masks per step.

Each constrained sequence gets a `Grammar`: a compile running in a worker thread, then a
matcher that follows the tokens the sequence emits. The scheduler admits a sequence only once
its grammar is ready (others run meanwhile: a slow compile holds back only its own request),
feeds it every sampled token (`accept`) and finishes the sequence when the grammar can take no
more tokens (`terminated`). Before sampling, `StructuredOutputManager.bitmask` builds one row
of allowed tokens per constrained sequence that samples this step; the sampler applies it
after penalties and biases, before temperature, top-k/p and the draw, so every sampling
parameter works inside the grammar.

Preemption needs nothing: a preempted sequence keeps its output tokens, so its matcher stays
where it was. n > 1: each sequence is a request of its own with a copy of the compiled matcher.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from backfill.sampling_params import StructuredOutputsParams
from backfill.structured_output.compiler import GrammarCompiler

if TYPE_CHECKING:
    import llguidance

    from backfill.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# The most characters of a grammar engine message that reach the log (see log_line).
LOG_LINE_CHARS = 200


def log_line(message: str) -> str:
    """`message` as one bounded log line: its first line, non-printable characters escaped, cut
    at LOG_LINE_CHARS. llguidance's messages go on with its parser state and the request's whole
    grammar, text a user wrote: verbatim, any request could write lines of any length, or lines
    that look like the server's own, into its log."""
    lines = message.splitlines()
    first = lines[0] if lines else ""
    line = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in first)
    cut = len(line) > LOG_LINE_CHARS or len(lines) > 1
    return line[:LOG_LINE_CHARS] + (" [...]" if cut else "")

# Compiles run here, off the step; llguidance drops the GIL while it compiles. One thread: a
# compile is CPU work, and the step's matmuls already use the other cores.
NUM_COMPILE_THREADS = 1


class Grammar:
    """One sequence's grammar: compiling, then ready or failed. Duck-typed by the scheduler.

    `poll()` (the core calls it before each schedule) is the only place its state changes, so
    the scheduler sees one consistent answer for a whole step.
    """

    def __init__(self, future: Future[llguidance.LLMatcher]) -> None:
        self._future = future
        self._matcher: llguidance.LLMatcher | None = None
        self.ready = False  # compiled: the scheduler may admit the sequence
        self.error: str | None = None  # the compile failed: the core ends the sequence

    def poll(self) -> bool:
        """Take the compile's result if it is done; True once ready or failed."""
        if not self.ready and self.error is None and self._future.done():
            try:
                self._matcher = self._future.result()
                self.ready = True
            except ValueError as error:
                self.error = str(error)
        return self.ready or self.error is not None

    def wait(self, timeout: float) -> None:
        """Block until the compile is done or `timeout` seconds passed (no state change)."""
        with contextlib.suppress(Exception):
            self._future.result(timeout)

    @property
    def matcher(self) -> llguidance.LLMatcher:
        assert self._matcher is not None, "grammar used before it was ready"
        return self._matcher

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar rejects it or the grammar engine
        failed (`failure`): the mask allows only tokens it accepts, but its lexer or parser can
        still give up on one (a limit reached, a schema no output satisfies), and when every
        allowed token is masked by other settings the sampler takes a disallowed one."""
        return bool(self.matcher.consume_token(token_id)) and not self.matcher.is_error()

    @property
    def failure(self) -> str | None:
        """Why the grammar engine gave up on this sequence, as one log line (None: it has not)."""
        return log_line(self.matcher.get_error()) if self.matcher.is_error() else None

    @property
    def terminated(self) -> bool:
        """No token but EOS can follow: the output is complete (never after a failure)."""
        return bool(self.matcher.is_stopped()) and not self.matcher.is_error()


@dataclass
class GrammarBitmask:
    """The allowed tokens of the constrained sequences sampling this step."""

    request_ids: list[str]  # one per row of `bitmask`
    bitmask: torch.Tensor  # [R, ceil(V / 32)] int32, bit t of row r set: token t allowed


class StructuredOutputManager:
    """Compiles grammars for the core (lazily loading the tokenizer) and builds step masks."""

    def __init__(self, load_tokenizer: Callable[[], Tokenizer], vocab_size: int) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self._compiler: GrammarCompiler | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._bitmask = torch.zeros((0, (vocab_size + 31) // 32), dtype=torch.int32)

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(self._load_tokenizer(), self.vocab_size)
        return self._compiler

    @property
    def executor(self) -> ThreadPoolExecutor:
        """The compile thread, started on first use."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(NUM_COMPILE_THREADS, thread_name_prefix="grammar")
        return self._executor

    def grammar(self, params: StructuredOutputsParams) -> Grammar:
        """Start compiling `params` in the background; the grammar is ready when that ends."""
        return Grammar(self.executor.submit(self._compile, params))

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        return self.compiler.matcher(params)

    def check(self, params: StructuredOutputsParams) -> None:
        """Compile now (the result is cached); ValueError naming the field if it is rejected."""
        self.compiler.check(params)

    def warm_up(self) -> None:
        """Load the grammar engine's view of the tokenizer now, so the first constrained request
        does not wait for it. Before the core says it is ready, not in the background: building
        it holds the GIL for 1-2 s (49k tokens in Python), and a server's first requests, which
        arrive right then, ran their steps 5-14x slower (a 75-token prompt's step: 266-738 ms
        instead of 55 on a Zen 5 EPYC)."""
        self.compiler.warm_up()

    def bitmask(self, rows: Sequence[tuple[str, Grammar]]) -> GrammarBitmask | None:
        """One mask row per (request id, ready grammar) that samples this step."""
        if not rows:
            return None
        if self._bitmask.shape[0] < len(rows):
            self._bitmask = torch.zeros((max(len(rows), 2 * self._bitmask.shape[0]), self._bitmask.shape[1]),
                                        dtype=torch.int32)
        # NOTE: what llguidance.torch.fill_next_token_bitmask does, without importing that module:
        # it imports torch._dynamo (~1.5 s), which on the first constrained step held every
        # running stream of the core for as long.
        row_bytes = self._bitmask.shape[1] * self._bitmask.element_size()
        for index, (_, grammar) in enumerate(rows):
            grammar.matcher.unsafe_compute_mask_ptr(self._bitmask[index].data_ptr(), row_bytes)
        return GrammarBitmask([request_id for request_id, _ in rows], self._bitmask[: len(rows)])

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
