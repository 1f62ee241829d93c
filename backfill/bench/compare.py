"""`bench compare`: one workload through backfill continuous, backfill static and transformers
`generate()` on padded static batches, in one process, same model and dtype, same batch size.

Every system is loaded once and warmed up; then the workload runs `repeats` rounds, each
system once a round (side by side: the machine's speed drifts over minutes). The report gives
each figure's median over the repeats, and each ratio between systems as the median over the
rounds of that round's ratio.
"""

from __future__ import annotations

import functools
import gc
import logging
import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from backfill.bench.offline import (
    DEFAULT_MAX_MODEL_LEN,
    OfflineRun,
    make_engine,
    run_offline_workload,
    summarize_offline,
    warm_up,
)
from backfill.bench.roofline import MachineRoofline, ModelShape, describe_host, engine_model_shape, resolve_dtype
from backfill.bench.workloads import WorkloadRequest, describe_workload
from backfill.config import EngineConfig, Policy

logger = logging.getLogger(__name__)

SYSTEMS: tuple[str, ...] = ("continuous", "static", "static_compact", "hf")
DEFAULT_SYSTEMS: tuple[str, ...] = ("continuous", "static", "hf")
# What continuous is compared against, in report order.
BASELINES: tuple[str, ...] = tuple(s for s in SYSTEMS if s != "continuous")
SYSTEM_LABELS: dict[str, str] = {
    "continuous": "backfill continuous",
    "static": "backfill static",  # fixed-shape batches: a finished slot is still computed
    "static_compact": "backfill static, compact",  # finished slots skipped: shrinks every step
    "hf": "transformers generate()",
}
# The backfill systems: name -> (policy, static_padding).
ENGINE_SYSTEMS: dict[str, tuple[Policy, bool]] = {
    "continuous": ("continuous", True),
    "static": ("static", True),
    "static_compact": ("static", False),
}
# Figures reported as medians over repeats (all higher-is-better throughputs or ms latencies).
HEADLINE_FIELDS: tuple[str, ...] = (
    "duration", "output_throughput", "request_throughput", "total_output_tokens",
    "median_e2el_ms", "p50_e2el_ms", "p99_e2el_ms", "median_ttft_ms", "p99_ttft_ms",
    "median_tpot_ms", "p99_itl_ms", "useful_slot_share", "idle_slot_share", "empty_slot_share",
    "num_steps", "median_step_ms", "roofline_efficiency", "prefix_cache_hit_rate",
)


# A loaded system: run(token-id workload, label) -> (the run, its summary); and its tokenizer.
Runner = Callable[[list[WorkloadRequest], str], tuple[OfflineRun, dict[str, Any]]]
Encode = Callable[[str], list[int]]


def _default_engine() -> EngineConfig:
    return EngineConfig(max_num_seqs=16, max_model_len=DEFAULT_MAX_MODEL_LEN)


@dataclass(frozen=True)
class CompareConfig:
    # Every backfill system's engine but its policy and static_padding (ENGINE_SYSTEMS'), and
    # what transformers shares of it: the model, dtype, device, threads and batch size.
    # `quantization` is backfill's weight storage (transformers always runs dense).
    engine: EngineConfig = field(default_factory=_default_engine)
    repeats: int = 3
    systems: tuple[str, ...] = DEFAULT_SYSTEMS
    price_per_hour: float | None = None
    show_progress: bool = True

    @property
    def batch_size(self) -> int:
        """Every system's batch: backfill's max_num_seqs, generate()'s batch size."""
        return self.engine.max_num_seqs

    def __post_init__(self) -> None:
        unknown = set(self.systems) - set(SYSTEMS)
        if unknown or not self.systems:
            raise ValueError(f"systems: choose from {SYSTEMS}, got {self.systems}")
        if self.repeats < 1:
            raise ValueError(f"repeats: must be >= 1, got {self.repeats}")


def tokenize_workload(requests: Sequence[WorkloadRequest], encode: Any) -> list[WorkloadRequest]:
    """Token-id copies of `requests`, so every system sees exactly the same prompt ids."""
    return [
        WorkloadRequest(r.max_tokens, None, list(r.prompt_token_ids) if r.prompt is None else list(encode(r.prompt)),
                        r.arrival_time)
        for r in requests
    ]


def _strip(summary: dict[str, Any]) -> dict[str, Any]:
    """Drop the per-token lists (large) from a stored per-repeat summary; keep per-request ones."""
    return {k: v for k, v in summary.items() if k not in ("itls",)}


def median_summary(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in HEADLINE_FIELDS:
        values = [s[key] for s in summaries if isinstance(s.get(key), (int, float))]
        if values:
            out[key] = statistics.median(values)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compute_ratios(medians: dict[str, dict[str, Any]],
                   runs: dict[str, Sequence[dict[str, Any]]] | None = None) -> dict[str, float | None]:
    """Throughput ratios (continuous over the others) and tail-latency ratios (others over
    continuous). With `runs` (each system's summaries, one a round), each ratio is the median
    over the rounds both systems ran of that round's ratio; else the ratio of the medians."""
    runs = runs or {}
    ratios: dict[str, float | None] = {}

    def ratio(key: str, numerator: str, denominator: str) -> float | None:
        rounds = zip(runs.get(numerator, ()), runs.get(denominator, ()))
        paired = [r for r in (_ratio(n.get(key), d.get(key)) for n, d in rounds) if r is not None]
        if paired:
            return statistics.median(paired)
        return _ratio(medians[numerator].get(key), medians[denominator].get(key))

    for other in BASELINES:
        if not medians.get("continuous") or not medians.get(other):
            continue
        ratios[f"continuous_vs_{other}_output_throughput"] = ratio("output_throughput", "continuous", other)
        ratios[f"{other}_vs_continuous_p50_e2el"] = ratio("p50_e2el_ms", other, "continuous")
        ratios[f"{other}_vs_continuous_p99_e2el"] = ratio("p99_e2el_ms", other, "continuous")
    return ratios


def run_compare(
    requests: Sequence[WorkloadRequest],
    config: CompareConfig,
    machine: MachineRoofline | None = None,
    model_shape: ModelShape | None = None,
    checkpoint: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[dict[str, Any], dict[str, OfflineRun]]:
    """Run every system; returns (report, each system's median-throughput repeat, for plots).

    Every system is loaded (and warmed up) first; then the repeats run in rounds, each system
    once a round, the order rotating from one round to the next: the machine's speed drifts
    over minutes, and rounds put each pair of runs side by side. `checkpoint`, when given,
    receives the report so far after every run, so a run that is interrupted keeps what it
    measured.
    """
    host_before = describe_host()
    systems = [name for name in SYSTEMS if name in config.systems]
    runners: dict[str, Callable[[str], tuple[OfflineRun, dict[str, Any]]]] = {}  # each a Runner, the workload bound
    tokenized: list[WorkloadRequest] | None = None
    for name in systems:
        runner, encode = (_hf_runner(config) if name == "hf"
                          else _engine_runner(name, config, machine, model_shape))
        if tokenized is None:  # every system gets the first one's token ids
            tokenized = tokenize_workload(requests, encode)
        runners[name] = functools.partial(runner, tokenized)
    per_system: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
    all_runs: dict[str, list[OfflineRun]] = {name: [] for name in systems}
    for repeat in range(config.repeats):
        for name in systems[repeat % len(systems):] + systems[:repeat % len(systems)]:
            run, summary = runners[name](f"{name} #{repeat + 1}")
            all_runs[name].append(run)
            per_system[name].append(summary)
            logger.info("%s repeat %d: %.1f output tok/s", name, repeat + 1, summary["output_throughput"])
            if checkpoint is not None:
                checkpoint(build_report(requests, config, machine, host_before, per_system))
    runners.clear()
    gc.collect()
    report = build_report(requests, config, machine, host_before, per_system)
    representative = {}
    for name, runs in all_runs.items():
        index = median_index([s["output_throughput"] for s in per_system[name]])
        report["medians"][name]["representative_repeat"] = index
        representative[name] = runs[index]
    return report, representative


def _engine_runner(name: str, config: CompareConfig, machine: MachineRoofline | None, model_shape: ModelShape | None
                   ) -> tuple[Runner, Encode]:
    """A loaded, warmed-up backfill engine of system `name`: (run(tokenized, label), encode)."""
    policy, static_padding = ENGINE_SYSTEMS[name]
    engine = make_engine(replace(config.engine, policy=policy, static_padding=static_padding))
    warm_up(engine)
    roofline = None
    if machine is not None and model_shape is not None:
        engine_shape, engine_dtype = engine_model_shape(model_shape, engine)
        roofline = (engine_shape, machine, engine_dtype, engine.config.block_size)

    def run(tokenized: list[WorkloadRequest], label: str) -> tuple[OfflineRun, dict[str, Any]]:
        result = run_offline_workload(engine, tokenized, label, config.show_progress)
        return result, summarize_offline(result, roofline=roofline, price_per_hour=config.price_per_hour)

    return run, lambda text: engine.tokenizer.encode(text, add_special_tokens=True)


def _hf_runner(config: CompareConfig) -> tuple[Runner, Encode]:
    """transformers `generate()` on padded static batches, loaded and warmed up."""
    from backfill.bench.hf_baseline import load_hf_model, pad_token_id, run_hf_static

    if config.engine.num_threads is not None:
        import torch

        torch.set_num_threads(config.engine.num_threads)
    hf_model, tokenizer = load_hf_model(config.engine.model, config.engine.dtype, config.engine.device)
    pad_id = pad_token_id(tokenizer)
    warm = [tokenizer.encode("Warm up the model, please.") or [1]] * config.batch_size
    run_hf_static(hf_model, warm, [4] * config.batch_size, config.batch_size, pad_id)  # warm-up

    def run(tokenized: list[WorkloadRequest], label: str) -> tuple[OfflineRun, dict[str, Any]]:
        result = run_hf_static(hf_model, [list(r.prompt_token_ids or []) for r in tokenized],
                               [r.max_tokens for r in tokenized], config.batch_size, pad_id,
                               [r.arrival_s for r in tokenized], label, config.show_progress)
        return result, summarize_offline(result, price_per_hour=config.price_per_hour)

    return run, tokenizer.encode


def median_index(values: Sequence[float]) -> int:
    """Index of the median value (the lower middle for an even count): the repeat to show."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    return order[(len(order) - 1) // 2]


def build_report(
    requests: Sequence[WorkloadRequest],
    config: CompareConfig,
    machine: MachineRoofline | None,
    host_before: dict[str, Any],
    per_system: dict[str, list[dict[str, Any]]],
) -> dict[str, Any]:
    """The report of the repeats run so far (also written as a checkpoint after each repeat)."""
    medians = {name: median_summary(summaries) for name, summaries in per_system.items() if summaries}
    if config.price_per_hour is not None:
        for name, summaries in per_system.items():
            if summaries:
                medians[name]["cost_per_million_output_tokens"] = statistics.median(
                    s["economics"]["cost_per_million_output_tokens"] for s in summaries)
                medians[name]["idle_slot_cost_per_million_output_tokens"] = statistics.median(
                    s["economics"]["idle_slot_cost_per_million_output_tokens"] for s in summaries)
    engine = config.engine
    return {
        "config": {
            "model": engine.model or "default (SmolLM2-135M-Instruct Q4_1 GGUF)",
            "dtype": resolve_dtype(engine.dtype, engine.device, engine.quantization),
            "quantization": engine.quantization,
            "device": engine.device,
            "batch_size": config.batch_size,
            "repeats": config.repeats,
            "systems": list(config.systems),
            "max_model_len": engine.max_model_len,
            "price_per_hour": config.price_per_hour,
            "num_threads": engine.num_threads or describe_host().get("torch_threads"),
        },
        "workload": describe_workload(list(requests)),
        "machine": machine.to_json() if machine is not None else None,
        "host": {**host_before, "load_average_1m_after": describe_host().get("load_average_1m")},
        "medians": medians,
        "ratios": compute_ratios(medians, per_system),
        "runs": {name: [_strip(s) for s in summaries] for name, summaries in per_system.items()},
    }


def format_compare(report: dict[str, Any]) -> str:
    """The comparison table and ratio lines, as printed by the CLI (Markdown)."""
    medians: dict[str, dict[str, Any]] = report["medians"]
    with_cost = report["config"].get("price_per_hour") is not None
    header = "| system | output tok/s | req/s | p50 e2el (ms) | p99 e2el (ms) | p50 TTFT (ms) | p99 TTFT (ms) | useful slot-steps |"
    rule = "|:---|---:|---:|---:|---:|---:|---:|---:|"
    if with_cost:
        header += " USD / M tokens | of which idle |"
        rule += "---:|---:|"
    lines = [header, rule]
    for name, m in medians.items():
        line = (
            f"| {SYSTEM_LABELS[name]} | {m['output_throughput']:.1f} | {m['request_throughput']:.2f} | "
            f"{m['p50_e2el_ms']:.0f} | {m['p99_e2el_ms']:.0f} | {m['median_ttft_ms']:.0f} | {m['p99_ttft_ms']:.0f} | "
            f"{100 * m.get('useful_slot_share', 0.0):.0f}% |"
        )
        if with_cost:
            line += f" {m['cost_per_million_output_tokens']:.3f} | {m['idle_slot_cost_per_million_output_tokens']:.3f} |"
        lines.append(line)
    ratios = report["ratios"]
    lines.append("")
    hit_rates = {name: m.get("prefix_cache_hit_rate") for name, m in medians.items()}
    if any(hit_rates.values()):
        lines.append("prefix cache hit rate: " + ", ".join(
            f"{SYSTEM_LABELS[name]} {100 * (rate or 0.0):.1f}%" for name, rate in hit_rates.items()))
    for other in BASELINES:
        key = f"continuous_vs_{other}_output_throughput"
        if ratios.get(key) is not None:
            lines.append(
                f"continuous vs {SYSTEM_LABELS[other]}: {ratios[key]:.2f}x output throughput; "
                f"{SYSTEM_LABELS[other]} p50 / p99 end-to-end latency is "
                f"{ratios[f'{other}_vs_continuous_p50_e2el']:.2f}x / {ratios[f'{other}_vs_continuous_p99_e2el']:.2f}x continuous's"
            )
    host = report.get("host") or {}
    lines.append(f"(medians over {report['config']['repeats']} round(s), each system once a round, each ratio the "
                 f"median of the rounds'; dtype {report['config']['dtype']}, batch size {report['config']['batch_size']}, "
                 f"{report['config'].get('num_threads')} thread(s); {host.get('cpu', '?')}, {host.get('num_cpus', '?')} CPUs, "
                 f"load average {host.get('load_average_1m', '?')} before / {host.get('load_average_1m_after', '?')} after)")
    return "\n".join(lines)
