"""The baseline most people start from: transformers `model.generate()` on padded static batches.

Requests are taken in arrival order, `batch_size` at a time; a batch starts when the previous
one has returned and all its members have arrived. Prompts are left-padded, decoding is
greedy, and `min_new_tokens = max_new_tokens = the batch's longest request` forces every row
to run to the end (so lengths are as asked, and short requests ride along as padding). A
streamer times each step; a request's tokens are usable from the step that made them, but the
caller gets them only when `generate()` returns, which is its end-to-end latency.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Sequence

from tqdm import tqdm

from backfill.bench.metrics import RequestResult, result_from_token_times
from backfill.bench.offline import OfflineRun
from backfill.bench.roofline import resolve_dtype
from backfill.core.outputs import StepStats
from backfill.model_files import is_gguf, resolve_model_path

logger = logging.getLogger(__name__)


def load_hf_model(model: str | None, dtype: str, device: str = "cpu") -> tuple[Any, Any]:
    """(model, tokenizer) from a Hugging Face folder or a .gguf file (needs `accelerate` for GGUF)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(resolve_model_path(model))
    kwargs: dict[str, Any] = {}
    if is_gguf(str(path)):
        kwargs["gguf_file"] = path.name
        path = path.parent
    tokenizer = AutoTokenizer.from_pretrained(str(path), **kwargs)
    # transformers runs the dense model: "auto" is the dense engine's dtype.
    torch_dtype = getattr(torch, resolve_dtype(dtype, device, quantization="none"))
    hf_model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype, **kwargs)
    hf_model.to(device).eval()
    return hf_model, tokenizer


def _step_timer() -> Any:
    from transformers.generation.streamers import BaseStreamer

    class StepTimer(BaseStreamer):  # type: ignore[misc]
        """Records when generate() hands over the prompt (first put) and each new token column."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value: Any) -> None:
            self.times.append(time.monotonic())

        def end(self) -> None:
            pass

    return StepTimer()


def _left_pad(prompts: Sequence[list[int]], pad_id: int, device: str) -> tuple[Any, Any]:
    import torch

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [batch, width]
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [batch, width]
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt):] = 1
    return input_ids.to(device), attention_mask.to(device)


def generate_batch(hf_model: Any, prompts: Sequence[list[int]], max_new_tokens: int, pad_id: int) -> tuple[Any, list[float]]:
    """One padded, greedy, forced-length generate(); returns (new token ids [batch, n], step end times)."""
    import torch

    device = str(next(hf_model.parameters()).device)
    input_ids, attention_mask = _left_pad(prompts, pad_id, device)
    timer = _step_timer()
    with torch.inference_mode():
        output = hf_model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=pad_id,
            streamer=timer,
        )  # [batch, width + max_new_tokens]
    new_tokens = output[:, input_ids.shape[1]:]  # [batch, max_new_tokens]
    if new_tokens.shape[1] != max_new_tokens:
        raise RuntimeError(f"generate() made {new_tokens.shape[1]} tokens, {max_new_tokens} forced")
    return new_tokens, timer.times[1:]  # the first put is the prompt


def pad_token_id(tokenizer: Any) -> int:
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    return int(tokenizer.eos_token_id)


def run_hf_static(
    hf_model: Any,
    prompts: Sequence[list[int]],
    max_tokens: Sequence[int],
    batch_size: int,
    pad_id: int,
    arrivals: Sequence[float] | None = None,
    label: str = "hf-generate",
    show_progress: bool = False,
) -> OfflineRun:
    """Run every request through padded static batches; step stats mark padding rows' slots idle."""
    if len(prompts) != len(max_tokens):
        raise ValueError("prompts: need one max_tokens per prompt")
    arrivals = list(arrivals) if arrivals is not None else [0.0] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    results: list[RequestResult | None] = [None] * len(prompts)
    steps: list[StepStats] = []
    progress = tqdm(total=len(prompts), desc=label, disable=not show_progress)
    start = time.monotonic()
    for first in range(0, len(order), batch_size):
        batch = order[first:first + batch_size]
        ready = start + max(arrivals[i] for i in batch)
        if ready > time.monotonic():
            time.sleep(ready - time.monotonic())
        longest = max(max_tokens[i] for i in batch)
        batch_start = time.monotonic()
        _, times = generate_batch(hf_model, [prompts[i] for i in batch], longest, pad_id)
        batch_end = time.monotonic()
        if len(times) != longest:
            raise RuntimeError(f"the step timer saw {len(times)} steps for {longest} tokens")
        for i in batch:
            results[i] = result_from_token_times(
                start + arrivals[i], times[: max_tokens[i]], max_tokens[i], max_tokens[i],
                prompt_len=len(prompts[i]), end_time=batch_end,
            )
        previous = batch_start
        for k, stamp in enumerate(times):
            states = ["useful" if k < max_tokens[i] else "idle" for i in batch]
            states += ["empty"] * (batch_size - len(batch))
            num_useful = states.count("useful")
            steps.append(StepStats(
                step=len(steps) + 1, start_time=previous, duration=stamp - previous,
                num_batched_tokens=len(batch) * (max(len(prompts[i]) for i in batch) if k == 0 else 1),
                num_prefill_tokens=len(batch) * max(len(prompts[i]) for i in batch) if k == 0 else 0,
                num_decode_tokens=0 if k == 0 else len(batch),
                num_running=len(batch), num_waiting=len(order) - first - len(batch),
                num_kv_blocks_used=0, num_kv_blocks_total=0, num_preempted=0,
                num_slots=batch_size, num_slots_useful=num_useful, num_slots_idle=states.count("idle"),
                slot_request_ids=[f"hf-{i}" for i in batch] + [None] * (batch_size - len(batch)),
                slot_states=states,
            ))
            previous = stamp
        progress.update(len(batch))
    progress.close()
    duration = time.monotonic() - start
    return OfflineRun(label, [r for r in results if r is not None], steps, duration,
                      extra={"note": "e2el is when generate() returned for the whole batch"})
