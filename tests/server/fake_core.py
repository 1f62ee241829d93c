"""A fake `EngineCore` for the front-end tests: it runs in a real core process (`CoreProcess`)
and keeps EngineCore's contract (one token per running sequence per step, outputs only for
sequences that got one, nothing after an abort), with no model."""

from __future__ import annotations

import functools
import time

from backfill.core.outputs import StepStats
from backfill.engine.core_process import CoreProcess
from backfill.engine.messages import CoreInfo, CoreLoad, EngineCoreOutput, EngineCoreRequest

INFO = CoreInfo(model_name="fake", max_model_len=1 << 20, vocab_size=49152, eos_token_ids=(),
                max_num_seqs=4, num_kv_blocks=100)


class FakeCore:
    def __init__(self, max_running: int = 4, step_time: float = 0.002, fail_at_step: int | None = None,
                 refuse_token: int | None = None) -> None:
        self.info = CoreInfo(**{**{f: getattr(INFO, f) for f in INFO.__struct_fields__}, "max_num_seqs": max_running})
        self.max_running = max_running
        self.step_time = step_time
        self.fail_at_step = fail_at_step
        self.refuse_token = refuse_token
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.state: dict[str, tuple[EngineCoreRequest, list[int]]] = {}
        self.num_steps = 0

    def add_request(self, request: EngineCoreRequest) -> None:
        if self.refuse_token is not None and self.refuse_token in request.prompt_token_ids:
            raise RuntimeError("a defect")
        assert request.request_id not in self.state
        self.state[request.request_id] = (request, [])
        self.waiting.append(request.request_id)

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if self.state.pop(request_id, None) is not None:
                for queue in (self.waiting, self.running):
                    if request_id in queue:
                        queue.remove(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.state)

    def step(self) -> tuple[list[EngineCoreOutput], StepStats]:
        self.num_steps += 1
        if self.fail_at_step is not None and self.num_steps >= self.fail_at_step:
            raise RuntimeError("boom")
        time.sleep(self.step_time)
        while self.waiting and len(self.running) < self.max_running:
            self.running.append(self.waiting.pop(0))
        outputs = []
        now = time.monotonic()
        for request_id, (request, _) in list(self.state.items()):  # deadlines, as the Scheduler
            if request.deadline is not None and request.deadline <= now:
                outputs.append(EngineCoreOutput(request_id, [], now, finish_reason="timeout"))
                self.abort([request_id])
        for request_id in list(self.running):
            request, tokens = self.state[request_id]
            tokens.append(100 + len(tokens))
            done = request.params.max_tokens is not None and len(tokens) >= request.params.max_tokens
            outputs.append(EngineCoreOutput(request_id, [tokens[-1]], now, finish_reason="length" if done else None))
            if done:
                self.running.remove(request_id)
                del self.state[request_id]
        stats = StepStats(step=self.num_steps, start_time=now, duration=self.step_time,
                          num_batched_tokens=len(outputs), num_prefill_tokens=0, num_decode_tokens=len(outputs),
                          num_running=len(self.running), num_waiting=len(self.waiting), num_kv_blocks_used=0,
                          num_kv_blocks_total=100, num_preempted=0, num_slots=self.max_running,
                          num_slots_useful=len(outputs), num_slots_idle=0)
        return outputs, stats

    def load(self) -> CoreLoad:
        return CoreLoad(num_running=len(self.running), num_waiting=len(self.waiting),
                        num_kv_blocks_used=len(self.running), num_kv_blocks_total=100, num_steps=self.num_steps)


def failing_factory() -> FakeCore:
    raise ValueError("model: no such file")


def start_fake_core(**kwargs: object) -> tuple[CoreProcess, CoreInfo]:
    """A started core process running `FakeCore(**kwargs)`."""
    core = CoreProcess(functools.partial(FakeCore, **kwargs))
    return core, core.start(timeout=120)
