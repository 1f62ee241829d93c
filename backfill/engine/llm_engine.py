"""LLMEngine: the offline engine, an `EngineCore` in-process between the front end's two processors.

```
add_request ─▶ InputProcessor (tokenize, validate, n -> sequences) ─▶ EngineCore.add_request
step        ─▶ EngineCore.step() ─▶ OutputProcessor (detokenize, stop strings, n fan-in)
                     ▲                                   │ sequences a stop string ended
                     └──────────── EngineCore.abort ◀────┘
```

The server runs the same `EngineCore` in a process of its own (`core_process.py`) behind the
same two processors (`async_engine.py`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from backfill.config import EngineConfig
from backfill.core.outputs import StepStats
from backfill.core.scheduler import Scheduler
from backfill.engine.core import EngineCore
from backfill.engine.output_processor import OutputProcessor
from backfill.engine.processor import InputProcessor
from backfill.outputs import RequestOutput
from backfill.sampling_params import SamplingParams
from backfill.tokenizer import Tokenizer, load_tokenizer
from backfill.worker.model_runner import ModelRunner


class LLMEngine:
    """The synchronous engine: one `step()` is one iteration of continuous batching.

    Single-threaded and not thread-safe. Every test can drive it step by step.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.core = EngineCore(config)
        info = self.core.info
        self.tokenizer: Tokenizer = load_tokenizer(config.model)
        self.max_model_len = info.max_model_len
        self.model_name = info.model_name
        self.vocab_size = info.vocab_size
        self.processor = InputProcessor(self.tokenizer, info)
        self.output_processor = OutputProcessor(self.tokenizer.hf)
        self.last_step_stats: StepStats | None = None

    @property
    def runner(self) -> ModelRunner:
        return self.core.runner

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        group_id: str | None = None,
        deadline: float | None = None,
    ) -> None:
        """Queue a request. Raises `ValueError("<field>: ...")` for input the engine can't serve.

        `group_id`, `deadline`: see `InputProcessor.process` (a request past its deadline ends
        with finish reason "timeout").
        """
        if request_id in self.output_processor:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if params.structured_outputs is not None:  # a grammar that cannot compile is refused here
            self.core.structured_output.check(params.structured_outputs)
        request = self.processor.process(request_id, prompt, params, arrival_time or time.monotonic(),
                                         priority=priority, group_id=group_id, deadline=deadline)
        self.output_processor.add(request)
        for sequence in request.sequences:
            self.core.add_request(sequence)

    def abort_request(self, request_ids: Iterable[str]) -> None:
        """Cancel requests; their KV blocks are free before the next step. Unknown ids are ignored."""
        for request_id in list(request_ids):
            self.core.abort(self.output_processor.abort(request_id))

    def has_unfinished_requests(self) -> bool:
        return len(self.output_processor) > 0

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the model, sample, detokenize, check stops."""
        outputs, self.last_step_stats = self.core.step()
        request_outputs, stopped = self.output_processor.process(outputs)
        if stopped:
            self.core.abort(stopped)
        return request_outputs

    # ---- state for metrics -------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return self.core.scheduler.num_waiting

    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    @property
    def num_running(self) -> int:
        return self.core.scheduler.num_running

    @property
    def num_kv_blocks_used(self) -> int:
        return self.core.scheduler.kv_cache_manager.num_used_blocks

    @property
    def num_kv_blocks_total(self) -> int:
        return self.core.scheduler.kv_cache_manager.num_blocks

    @property
    def kv_usage(self) -> float:
        return self.num_kv_blocks_used / max(self.num_kv_blocks_total, 1)

    @property
    def num_preemptions_total(self) -> int:
        return self.core.scheduler.num_preemptions_total
