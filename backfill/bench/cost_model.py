"""The planner's time model: what one engine step costs, fitted on this machine's measured steps.

A step's wall time is modelled on three counts of its work (plus a constant):

    step_s = intercept_s + per_token_s * num_tokens + per_seq_s * num_seqs + per_kv_token_s * num_kv_tokens
             + sum(per_token_above_s[k] * max(num_tokens - token_knots[k], 0))

`num_tokens`: the tokens computed (every linear layer runs once over them; the weights are
read once a step, which is most of the constant); `num_seqs`: the rows (each samples, and the
LM head runs once a row); `num_kv_tokens`: the KV entries attention reads (each row's context).
The cost of a token is not one number: matrix kernels switch strategy with the row count (a
fused small-batch path up to a few rows, register-blocked panels above), so the token term is
piecewise linear, its slope changing at `token_knots` (powers of two the measured steps span,
chosen by `choose_knots`); it never falls as tokens are added.
Padding rows of a static batch count as rows of one token, as they are computed, and their
context at PADDING_CONTEXT_COST of a real one's: a padding row attends over the scratch block
repeated (`worker/input_batch.py`), which stays in cache, so its attention pays the arithmetic
but not the memory traffic. The coefficients come from a least-absolute-relative-error fit over
steps the real engine ran (`calibrate.py`), the plain ones kept non-negative.

A served request also pays the front end: HTTP, JSON and tokenizing before its prompt reaches
the engine core, and the delivery of its tokens after. `frontend_s` adds that to every
arrival (so it also delays admission, as it does); `served_step_factor` scales step times for
a core whose machine it shares with the HTTP process and the benchmark client. Both come from
a probe of a running server (`calibrate.probe_server`); without one they are 0 and 1.

Nothing here imports torch: the planner runs wherever the control plane does.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from backfill.config import EngineConfig, default_num_kv_blocks
from backfill.core.outputs import SchedulerOutput

CALIBRATION_VERSION = 2
CANDIDATE_KNOTS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
MIN_STEPS_PER_SEGMENT = 3  # a knot is used only with this many measured steps on each side of it
# What a padding row's context costs against a real row's: the CPU decode attention over one
# cached block repeated took 0.37-0.58x the time over distinct blocks (16 rows at contexts of
# 200-700 tokens, Xeon Ice Lake, 2 threads: `python -m backfill.bench.decoder_step`).
PADDING_CONTEXT_COST = 0.5


@dataclass(frozen=True)
class StepShape:
    """The counts of one step's work that its time is fitted on."""

    num_tokens: int
    num_seqs: int
    num_kv_tokens: int
    num_sampled: int = 0  # sequences that get a token (not a feature of the fit: see Calibration)

    def features(self, token_knots: Sequence[int] = ()) -> list[float]:
        return [1.0, float(self.num_tokens), float(self.num_seqs), float(self.num_kv_tokens),
                *(float(max(self.num_tokens - knot, 0)) for knot in token_knots)]


def step_shape(output: SchedulerOutput) -> StepShape:
    """The shape of the step `output` schedules (its padding rows included)."""
    num_padding = len(output.padding_seq_lens)
    kv = sum(s.num_computed_tokens + s.num_tokens for s in output.scheduled) + round(
        PADDING_CONTEXT_COST * sum(output.padding_seq_lens))
    return StepShape(num_tokens=output.num_batched_tokens + num_padding,
                     num_seqs=len(output.scheduled) + num_padding, num_kv_tokens=kv,
                     num_sampled=sum(1 for s in output.scheduled if s.sample))


@dataclass(frozen=True)
class Calibration:
    """A fitted step-time model and the engine facts a simulated scheduler needs.

    `context_cost`, `max_position_embeddings` and `kv_bytes_per_token` are the model's (the
    simulated scheduler gets the same prefill budget units and KV pool as the real one);
    `samples` keeps the measured (shape, seconds) pairs the fit came from.
    """

    intercept_s: float
    per_token_s: float
    per_seq_s: float
    per_kv_token_s: float
    context_cost: float = 0.0
    max_position_embeddings: int = 2048
    kv_bytes_per_token: int = 0
    frontend_s: float = 0.0
    served_step_factor: float = 1.0
    token_knots: tuple[int, ...] = ()
    per_token_above_s: tuple[float, ...] = ()  # the token term's slope change at each knot
    # In-process (LLMEngine.step, as bench offline / compare run it): the output processing
    # (detokenizing) after the core's step, per step and per token it returns.
    offline_step_s: float = 0.0
    offline_token_s: float = 0.0
    description: dict[str, Any] = field(default_factory=dict)  # host, model, threads, fit quality
    samples: list[tuple[int, int, int, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("intercept_s", "per_token_s", "per_seq_s", "per_kv_token_s", "frontend_s", "offline_step_s",
                     "offline_token_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
        if not (self.served_step_factor > 0 and math.isfinite(self.served_step_factor)):
            raise ValueError(f"served_step_factor: must be > 0, got {self.served_step_factor!r}")
        if self.intercept_s + self.per_token_s + self.per_seq_s <= 0:
            raise ValueError("a step must cost some time: intercept_s, per_token_s and per_seq_s are all 0")
        if len(self.token_knots) != len(self.per_token_above_s) or list(self.token_knots) != sorted(
                set(self.token_knots)) or any(k < 1 for k in self.token_knots):
            raise ValueError("token_knots: increasing positive integers, one per_token_above_s each")
        if min(_segment_slopes(self.per_token_s, self.per_token_above_s), default=0.0) < -1e-12:
            raise ValueError("per_token_above_s: the token term must not fall as tokens are added")

    def step_time(self, shape: StepShape, served: bool = True) -> float:
        """Seconds the step takes: in a server's core process when `served` (times
        `served_step_factor`), else in-process with its output processing."""
        coefficients = (self.intercept_s, self.per_token_s, self.per_seq_s, self.per_kv_token_s, *self.per_token_above_s)
        seconds = sum(c * f for c, f in zip(coefficients, shape.features(self.token_knots)))
        if served:
            return seconds * self.served_step_factor
        return seconds + self.offline_step_s + self.offline_token_s * shape.num_sampled

    def num_kv_blocks(self, config: EngineConfig) -> int:
        """The KV pool a real engine of `config` allocates."""
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        return default_num_kv_blocks(config.max_num_seqs, config.max_model_len or self.max_position_embeddings,
                                     config.block_size, self.kv_bytes_per_token)

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"version": CALIBRATION_VERSION, **asdict(self)}, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """Read a saved calibration. Raises ValueError naming the file on a bad one."""
        try:
            data = json.loads(Path(path).read_text())
            if not isinstance(data, dict) or data.pop("version", None) != CALIBRATION_VERSION:
                raise ValueError(f"not a version-{CALIBRATION_VERSION} calibration (make a new one: backfill plan "
                                 "calibrate, or --recalibrate)")
            known = {f.name for f in fields(cls)}
            unknown = set(data) - known
            if unknown:
                raise ValueError(f"unknown field(s) {sorted(unknown)}")
            data["samples"] = [tuple(s) for s in data.get("samples", [])]
            for name in ("token_knots", "per_token_above_s"):
                data[name] = tuple(data.get(name, ()))
            return cls(**data)
        except (ValueError, TypeError) as error:
            raise ValueError(f"{path}: {error}") from error

    def with_server(self, frontend_s: float, served_step_factor: float) -> Calibration:
        return replace(self, frontend_s=frontend_s, served_step_factor=served_step_factor)


def fit_step_times(shapes: Sequence[StepShape], seconds: Sequence[float],
                   token_knots: Sequence[int] = ()) -> tuple[list[float], float]:
    """Least absolute relative error fit of `seconds` on the shapes' features, the four plain
    coefficients non-negative and the token term never falling (a knot whose slope would make it
    fall is dropped: its coefficient is 0). Returns (coefficients in
    StepShape.features(token_knots) order, median relative error of the fit).

    Relative: a 5 ms step off by 5 ms is as wrong as a 500 ms one off by 500. Least absolute
    (iteratively reweighted least squares): a step that a neighbour's burst of work slowed
    tenfold moves the fit no more than one a little slow, so the fit follows the typical step.
    """
    if len(shapes) != len(seconds) or len(shapes) < 4:
        raise ValueError(f"need at least 4 measured steps to fit, got {len(shapes)}")
    x = np.array([s.features(token_knots) for s in shapes])  # [num_steps, 4 + num_knots]
    y = np.array(seconds, dtype=float)  # [num_steps]
    scale = 1.0 / np.maximum(y, 1e-6)  # [num_steps]: residuals relative to each step's time
    weights = np.ones(len(y))  # [num_steps]
    for _ in range(30):
        root = np.sqrt(weights) * scale  # [num_steps]
        coefficients = _constrained_lstsq(x * root[:, None], y * root)
        relative = np.abs(x @ coefficients - y) * scale  # [num_steps]
        weights = 1.0 / np.maximum(relative, 1e-4)
    return [float(c) for c in coefficients], float(np.median(relative))


def _constrained_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin |x c - y| with c[:4] >= 0 and every slope of the token term (c[1] plus the
    changes c[4:] of the knots below) >= 0: drop the worst offender and refit until none is."""
    active = list(range(x.shape[1]))
    coefficients = np.zeros(x.shape[1])  # [num_features]
    while active:
        solution, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        full = np.zeros(x.shape[1])  # [num_features]
        full[active] = solution
        plain = [(full[i], i) for i in range(4) if i in active]
        slopes = _segment_slopes(full[1], full[4:])
        falling = [(slope, 4 + k) for k, slope in enumerate(slopes[1:]) if 4 + k in active]
        worst = min(plain + falling, default=(0.0, -1))
        if worst[0] >= 0:
            coefficients = full
            break
        active.remove(worst[1])
    return coefficients


def _segment_slopes(per_token: float, changes: Sequence[float]) -> list[float]:
    """The token term's slope below the first knot, then above each knot."""
    return [float(s) for s in np.cumsum([per_token, *changes])]


def choose_knots(shapes: Sequence[StepShape]) -> tuple[int, ...]:
    """The CANDIDATE_KNOTS with MIN_STEPS_PER_SEGMENT measured steps between each and its
    neighbours (and below the first, above the last): where the data can place a slope change."""
    tokens = sorted(s.num_tokens for s in shapes)
    knots: list[int] = []
    for knot in CANDIDATE_KNOTS:
        below = knots[-1] if knots else 0
        if sum(below < t <= knot for t in tokens) >= MIN_STEPS_PER_SEGMENT:
            knots.append(knot)
    # The last knot needs steps above it too
    while knots and sum(t > knots[-1] for t in tokens) < MIN_STEPS_PER_SEGMENT:
        knots.pop()
    return tuple(knots)


def calibration_from_steps(shapes: Sequence[StepShape], seconds: Sequence[float],
                           overheads: Sequence[float] | None = None, **facts: Any) -> Calibration:
    """Fit the step-time model on measured steps; `overheads`: each step's output processing
    in-process (seconds), fitted per step and per sampled token; `facts`: other Calibration fields."""
    knots = choose_knots(shapes)
    (intercept, per_token, per_seq, per_kv, *above), error = fit_step_times(shapes, seconds, knots)
    used = [k for k, c in enumerate(above) if c != 0.0]  # a dropped knot: no slope change there
    facts["token_knots"] = tuple(knots[k] for k in used)
    facts["per_token_above_s"] = tuple(above[k] for k in used)
    if overheads:
        x = np.array([[1.0, float(s.num_sampled)] for s in shapes])  # [num_steps, 2]
        facts["offline_step_s"], facts["offline_token_s"] = (
            float(c) for c in _constrained_lstsq(x, np.array(overheads, dtype=float)))
    description = {**facts.pop("description", {}), "num_steps": len(shapes), "median_relative_fit_error": error}
    samples = [(s.num_tokens, s.num_seqs, s.num_kv_tokens, float(t)) for s, t in zip(shapes, seconds)]
    return Calibration(intercept_s=intercept, per_token_s=per_token, per_seq_s=per_seq, per_kv_token_s=per_kv,
                       description=description, samples=samples, **facts)
