"""What crosses the edge of `EngineCore`: plain msgspec structs, nothing that holds a tensor or a
`Request`.

The same types serve the core in-process (`LLMEngine`) and in its own process (the server),
where they travel as msgpack over ZMQ (`core_process.py`). Times are `time.monotonic()`, which
on Linux is one clock for every process of the machine.
"""

from __future__ import annotations

import msgspec

from backfill.core.outputs import StepStats, TokenLogprobs
from backfill.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One sequence to generate (the front end splits an n > 1 request into n of these)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    arrival_time: float
    priority: int = 0
    group_id: str = ""  # the client request it belongs to; empty: a group of its own
    # time.monotonic() after which the core ends it ("timeout"); None: the core's
    # --request-timeout after arrival_time, if set
    deadline: float | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step did to one sequence: its new token (and logprobs), and whether it ended.

    `finish_reason` is "stop" (EOS or a stop token id, then in `stop_token_id`), "length", or
    "timeout" (its deadline passed: no new tokens; the front end turns it into an error).
    Stop strings are the front end's business: it sees text, the core sees token ids.
    `first_token_steps`, on a sequence's first token only: the engine steps from its arrival at
    the core to that token (1: the first step after it arrived).
    """

    request_id: str
    new_token_ids: list[int]
    token_time: float  # when the step that sampled them ended
    first_scheduled_time: float | None = None
    num_preemptions: int = 0
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_token_id: int | None = None
    # On a sequence's first output: its prompt tokens whose K/V came from the prefix cache.
    num_cached_tokens: int | None = None
    first_token_steps: int | None = None
    # On a sequence's first output, when it asked for them: the logprobs of its prompt's tokens
    # from the second on.
    prompt_logprobs: list[TokenLogprobs] | None = None


class CoreLoad(msgspec.Struct, array_like=True):
    """The core's queues and KV pool after it applied its inputs (and stepped, if it did)."""

    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks_used: int = 0
    num_kv_blocks_total: int = 0
    num_preemptions_total: int = 0
    num_steps: int = 0
    num_kv_blocks_cached_free: int = 0  # free blocks still holding a reusable prefix (not in _used)

    @property
    def kv_usage(self) -> float:
        return self.num_kv_blocks_used / max(self.num_kv_blocks_total, 1)


class CoreInputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """Front end -> core: requests to add, then ids to abort, applied between two steps."""

    add: list[EngineCoreRequest] = []
    abort: list[str] = []
    shutdown: bool = False


class CoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    """Core -> front end, once for every turn of its loop that applied inputs or stepped.

    `num_added` counts the sequences of `add` messages applied this turn (the front end's
    admission control counts the ones still in transit); `refused` names requests the core
    could not add, with why (a defect: the front end validates before sending).
    """

    outputs: list[EngineCoreOutput] = []
    stats: StepStats | None = None  # None: no step ran this turn
    load: CoreLoad = msgspec.field(default_factory=CoreLoad)
    num_added: int = 0
    refused: list[tuple[str, str]] = []


class CoreInfo(msgspec.Struct, array_like=True, tag=True):
    """What the front end needs to know about a loaded core (the process's first message)."""

    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]  # the model's own (the tokenizer may name more)
    max_num_seqs: int
    num_kv_blocks: int
    scheduling_policy: str = "fcfs"  # "priority": requests may set a priority
    block_size: int = 16  # tokens a KV block
    kv_cache_dtype: str = "float32"  # the KV cache's elements (resolved: never "auto")
    enable_prefix_caching: bool = True


class CoreFailed(msgspec.Struct, array_like=True, tag=True):
    """The core process's last message when loading or its loop raised."""

    error: str


CoreMessage = CoreInfo | CoreOutputs | CoreFailed
