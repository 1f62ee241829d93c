"""`backfill bench structured`: what constrained decoding costs a batch.

One engine, one batch of requests run to the end twice per repeat, side by side: every request
unconstrained, then the same requests with a fraction of them constrained to a JSON schema.
Every request makes exactly `max_tokens` tokens in both runs (greedy, ignore_eos; the schema
asks for more items than fit in `max_tokens`, so the grammar never ends a request early), so
the two runs do the same model work and the ratio of their output throughputs is the cost of
the grammar: compiling, the per-step mask, and applying it. The mask's own time per step is
measured too, by timing the engine's calls that build it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from backfill.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from backfill.engine.llm_engine import LLMEngine

# A list of records: many tokens before the grammar could end (minItems), each item a few
# tokens of keys, a string and numbers: the mask changes state every token.
DEFAULT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"records": {"type": "array", "minItems": 200, "items": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 12},
                       "score": {"type": "number"}, "ok": {"type": "boolean"}},
        "required": ["id", "name", "score", "ok"], "additionalProperties": False}}},
    "required": ["records"],
}
PROMPTS = ["List the records as JSON.", "Here is a table of scores:", "Write a JSON document about cats.",
           "Give me data.", "Records of the experiment, one per line:", "The inventory is"]


@dataclass
class StructuredRun:
    label: str
    duration: float
    num_output_tokens: int
    num_steps: int
    mask_seconds: float  # time spent building the grammar masks
    num_mask_rows: int

    @property
    def output_throughput(self) -> float:
        return self.num_output_tokens / self.duration


def run_batch(engine: LLMEngine, batch_size: int, max_tokens: int, fraction: float,
              schema: dict[str, Any], label: str) -> StructuredRun:
    """Run `batch_size` requests to the end; the first `fraction` of them constrained."""
    manager = engine.core.structured_output
    num_constrained = round(batch_size * fraction)
    structured = StructuredOutputsParams(json=schema)
    mask_time = [0.0, 0]
    build = manager.bitmask

    def timed_bitmask(rows):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        result = build(rows)
        mask_time[0] += time.perf_counter() - start
        mask_time[1] += len(rows)
        return result

    manager.bitmask = timed_bitmask  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        for i in range(batch_size):
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                    structured_outputs=structured if i < num_constrained else None)
            engine.add_request(f"{label}-{time.monotonic_ns()}-{i}", PROMPTS[i % len(PROMPTS)], params)
        num_tokens = num_steps = 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    num_tokens += len(output.outputs[0].token_ids)
            num_steps += 1
        duration = time.perf_counter() - start
    finally:
        manager.bitmask = build  # type: ignore[method-assign]
    return StructuredRun(label, duration, num_tokens, num_steps, mask_time[0], int(mask_time[1]))


def run_structured_bench(engine: LLMEngine, batch_size: int, max_tokens: int, fraction: float, repeats: int,
                         schema: dict[str, Any] = DEFAULT_SCHEMA) -> dict[str, Any]:
    """Alternate unconstrained and constrained runs `repeats` times; medians and their ratio."""
    run_batch(engine, batch_size, 8, fraction, schema, "warmup")  # compiles the schema, warms the shapes
    free: list[StructuredRun] = []
    constrained: list[StructuredRun] = []
    for _ in range(repeats):
        free.append(run_batch(engine, batch_size, max_tokens, 0.0, schema, "free"))
        constrained.append(run_batch(engine, batch_size, max_tokens, fraction, schema, "constrained"))
    ratios = [c.output_throughput / f.output_throughput for f, c in zip(free, constrained)]
    return {
        "batch_size": batch_size, "max_tokens": max_tokens, "fraction_constrained": fraction, "repeats": repeats,
        "unconstrained_tok_s": [r.output_throughput for r in free],
        "constrained_tok_s": [r.output_throughput for r in constrained],
        "ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "mask_ms_per_step": statistics.median(1e3 * r.mask_seconds / r.num_steps for r in constrained),
        "mask_us_per_row": statistics.median(1e6 * r.mask_seconds / max(r.num_mask_rows, 1) for r in constrained),
        "step_ms_constrained": statistics.median(1e3 * r.duration / r.num_steps for r in constrained),
        "output_tokens_per_run": [r.num_output_tokens for r in free + constrained],
    }


def format_structured(result: dict[str, Any]) -> str:
    lines = [f"batch {result['batch_size']}, {result['max_tokens']} tokens each, "
             f"{100 * result['fraction_constrained']:.0f}% constrained to a JSON schema, {result['repeats']} repeats"]
    for i, (free, constrained, ratio) in enumerate(zip(result["unconstrained_tok_s"], result["constrained_tok_s"],
                                                       result["ratios"])):
        lines.append(f"  repeat {i + 1}: unconstrained {free:.1f} tok/s, constrained {constrained:.1f} tok/s, "
                     f"ratio {ratio:.3f}")
    lines.append(f"median ratio {result['median_ratio']:.3f} (constrained / unconstrained output throughput)")
    lines.append(f"grammar mask: {result['mask_ms_per_step']:.2f} ms per step "
                 f"({result['mask_us_per_row']:.0f} us per constrained row), "
                 f"of a {result['step_ms_constrained']:.1f} ms step")
    return "\n".join(lines)
