"""Roofline: what one decode step can cost at best on this machine, for the loaded model.

A decode step must read every weight once (and each sequence's KV cache), and must do
2 * params FLOPs per token. So for B sequences of C context tokens:

    ideal(B) = max((weight_bytes + B * C * kv_bytes_per_token) / read_bandwidth,
                   (2 * matmul_params * B + attention_flops(B, C)) / peak_flops)

peak_flops is the machine's fp32 FMA peak where the CPU kernels can time it (a register-only
FMA loop on every thread), else (or where it is higher) a large measured matmul in the dtype.

Small batches are memory-bound (the weights are read for one token each); past the ridge
point, compute-bound. Measured step times are reported against this bound.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from backfill.model_files import (GGUFHeader, gguf_model_config, hf_model_config, is_gguf, resolve_model_path,
                                  safetensors_shapes)

logger = logging.getLogger(__name__)

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def resolve_dtype(dtype: str, device: str = "cpu", quantization: str = "auto") -> str:
    """The dtype an engine of these EngineConfig fields computes in (worker/model_runner's
    compute_dtype): "auto" is float32 on the CPU kernels, else the device's fast dtype (bf16
    where it is native); `quantization="none"` asks for the dense model (as transformers runs).
    A loaded engine says what it really runs (`engine_model_shape`)."""
    if dtype != "auto":
        return dtype
    from backfill.config import EngineConfig
    from backfill.worker.model_runner import compute_dtype

    config = EngineConfig(dtype=dtype, device=device, quantization=quantization)
    return str(compute_dtype(config)).removeprefix("torch.")


@dataclass
class MachineRoofline:
    """Measured limits of one device: read / copy bandwidth (GB/s), matmul GFLOP/s per dtype and
    the fp32 FMA peak (GFLOP/s; None where the CPU kernels cannot time it, e.g. on CUDA), with
    the instruction set the CPU kernels ran it on (and run the model's steps on: "avx512",
    "avx2" or "scalar"; None with the peak)."""

    device: str
    num_threads: int
    read_gbps: float
    copy_gbps: float
    matmul_gflops: dict[str, float] = field(default_factory=dict)
    fma_peak_gflops: float | None = None
    kernels_isa: str | None = None

    def peak_gflops(self, dtype: str) -> float:
        """The compute ceiling for `dtype`: the best of its matmul and, for fp32, the FMA peak
        (torch's fp32 matmul reaches 85% of that peak on an Ice Lake Xeon and under half on a
        Zen 5 EPYC, where the packed kernels outrun it: no ceiling at all there)."""
        best = self.matmul_gflops[dtype]
        if dtype == "float32" and self.fma_peak_gflops is not None:
            best = max(best, self.fma_peak_gflops)
        return best

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MachineRoofline:
        return cls(**data)


def _best_time(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    fn()  # warm-up: page faults, kernel selection
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def measure_machine(
    device: str = "cpu",
    buffer_mb: int = 1024,
    matmul_n: int = 2048,
    dtypes: Sequence[str] = ("float32", "bfloat16"),
    repeats: int = 5,
) -> MachineRoofline:
    """Measure memory bandwidth and matmul throughput with torch (a few seconds on CPU).

    The buffer must exceed the last-level cache (this machine's L3 can be 260 MB), or the
    "memory" bandwidth is the cache's. Read bandwidth is the best of a reduction and a dot
    product over the buffer; copy counts bytes read plus bytes written.
    """
    import torch

    sync: Callable[[], None] = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    num_elements = buffer_mb * 1024 * 1024 // 4
    x = torch.ones(num_elements, dtype=torch.float32, device=device)  # [num_elements]
    y = torch.empty_like(x)
    num_bytes = x.numel() * x.element_size()
    read_s = min(_best_time(lambda: x.sum(), repeats, sync), _best_time(lambda: torch.dot(x, x), repeats, sync))
    copy_s = _best_time(lambda: y.copy_(x), repeats, sync)
    del x, y
    gflops: dict[str, float] = {}
    for name in dtypes:
        dtype = getattr(torch, name)
        a = torch.randn(matmul_n, matmul_n, device=device).to(dtype)  # [n, n]
        b = torch.randn(matmul_n, matmul_n, device=device).to(dtype)  # [n, n]
        seconds = _best_time(lambda: a @ b, max(2, repeats // 2), sync)
        gflops[name] = 2 * matmul_n**3 / seconds / 1e9
    return MachineRoofline(
        device=device,
        num_threads=torch.get_num_threads(),
        read_gbps=num_bytes / read_s / 1e9,
        copy_gbps=2 * num_bytes / copy_s / 1e9,
        matmul_gflops=gflops,
        **_fma_peak_and_isa(device),
    )


def _fma_peak_and_isa(device: str) -> dict[str, Any]:
    """fp32 FMA peak on every intra-op thread, from the CPU kernels, and the instruction set they
    run (nothing on other devices or where they are not built)."""
    if device != "cpu":
        return {}
    from backfill import kernels

    ext = kernels.extension()
    if ext is None:
        return {}
    return {"fma_peak_gflops": float(ext.fma_peak_gflops()), "kernels_isa": str(ext.isa())}  # type: ignore[attr-defined]


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs to know of a decoder-only transformer."""

    name: str
    num_params: int
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    # Bytes of weights one step reads in full (every linear and the LM head) where they are
    # not `matmul_params` of the compute dtype: the CPU kernels read a GGUF's blocks as stored.
    # None: dense weights in the compute dtype.
    weight_bytes_per_step: int | None = None
    # The KV cache's element type where it is not the compute dtype (`--kv-cache-dtype`).
    kv_dtype: str | None = None

    def weight_bytes(self, dtype: str) -> int:
        if self.weight_bytes_per_step is not None:
            return self.weight_bytes_per_step
        return self.matmul_params * DTYPE_BYTES[resolve_dtype(dtype)]

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def matmul_params(self) -> int:
        """Weights every token multiplies by: all but an untied embedding table (a lookup)."""
        return self.num_params if self.tie_word_embeddings else self.num_params - self.lm_head_params

    def kv_bytes_per_token(self, dtype: str) -> int:
        element = DTYPE_BYTES[self.kv_dtype or resolve_dtype(dtype)]
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element


def load_model_shape(model: str | None) -> ModelShape:
    """The shape of `model` (model_files.resolve_model_path's rules) from its ModelConfig and its
    tensor headers; no weights are read. A GGUF's per-step bytes are its matrices as stored
    (what the CPU kernels read); a Hugging Face folder's are left to the compute dtype."""
    path = resolve_model_path(model)
    if is_gguf(path):
        header = GGUFHeader(path)
        config = gguf_model_config(header)
        tensors = {info.name: info for info in header.tensors}
        num_params = sum(info.num_elements for info in header.tensors)
        head = tensors.get("output.weight", tensors["token_embd.weight"])
        stored: int | None = header.num_bytes(head) + sum(
            header.num_bytes(info) for info in header.tensors if info.name.startswith("blk."))
        name = Path(path).stem
    else:
        config = hf_model_config(path)
        num_params = sum(math.prod(shape) for shape in safetensors_shapes(path).values())
        stored = None
        name = Path(path).name
    return ModelShape(
        name=name,
        num_params=num_params,
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        vocab_size=config.vocab_size,
        tie_word_embeddings=config.tie_word_embeddings,
        weight_bytes_per_step=stored,
    )


def ideal_step(
    model: ModelShape,
    machine: MachineRoofline,
    dtype: str,
    num_tokens: int,
    num_seqs: int,
    num_context_tokens: int,
) -> dict[str, Any]:
    """Lower bound on one step computing `num_tokens` tokens of `num_seqs` sequences.

    `num_context_tokens` is the KV read by attention (sum over sequences of their lengths).
    Only each sequence's last token goes through the LM head.
    """
    dtype = resolve_dtype(dtype)
    body_params = model.matmul_params - model.lm_head_params
    weight_bytes = model.weight_bytes(dtype)
    kv_bytes = num_context_tokens * model.kv_bytes_per_token(dtype)
    # attention: q.k and p.v over the context, per layer and query head; prefill tokens see
    # fewer on average, so charging every token the mean context is an upper bound.
    mean_context = num_context_tokens / max(num_seqs, 1)
    attention_flops = 4 * model.num_layers * model.num_heads * model.head_dim * mean_context * num_tokens
    flops = 2 * body_params * num_tokens + 2 * model.lm_head_params * num_seqs + attention_flops
    memory_s = (weight_bytes + kv_bytes) / (machine.read_gbps * 1e9)
    compute_s = flops / (machine.peak_gflops(dtype) * 1e9)
    return {
        "ideal_s": max(memory_s, compute_s),
        "memory_s": memory_s,
        "compute_s": compute_s,
        "bound": "memory" if memory_s >= compute_s else "compute",
        "bytes": weight_bytes + kv_bytes,
        "flops": flops,
    }


def engine_model_shape(shape: ModelShape, engine: Any) -> tuple[ModelShape, str]:
    """`shape` with the bytes the engine's model really reads per step (its weights, its KV
    cache's elements), and the dtype it computes in (fp32 on the CPU kernels whatever
    `dtype="auto"` would pick for a dense model)."""
    runner = engine.runner
    dtype = str(runner.dtype).removeprefix("torch.")
    kv_dtype = str(runner.kv_dtype).removeprefix("torch.")
    return replace(shape, weight_bytes_per_step=int(runner.model.weight_bytes_per_step), kv_dtype=kv_dtype), dtype


def decode_roofline(
    model: ModelShape,
    machine: MachineRoofline,
    dtype: str,
    batch_sizes: Sequence[int],
    context_len: int,
    measured_s: dict[int, float] | None = None,
) -> list[dict[str, Any]]:
    """One row per batch size: ideal decode step (ms), its bound, ideal tokens/s, and the measured step beside it."""
    rows = []
    for batch in batch_sizes:
        ideal = ideal_step(model, machine, dtype, batch, batch, batch * context_len)
        row: dict[str, Any] = {
            "batch_size": batch,
            "context_len": context_len,
            "ideal_ms": ideal["ideal_s"] * 1000,
            "memory_ms": ideal["memory_s"] * 1000,
            "compute_ms": ideal["compute_s"] * 1000,
            "bound": ideal["bound"],
            "ideal_tokens_per_s": batch / ideal["ideal_s"],
        }
        if measured_s and batch in measured_s:
            row["measured_ms"] = measured_s[batch] * 1000
            row["measured_tokens_per_s"] = batch / measured_s[batch]
            row["measured_over_ideal"] = measured_s[batch] / ideal["ideal_s"]
        rows.append(row)
    return rows


def median_machine(machines: Sequence[MachineRoofline]) -> MachineRoofline:
    """One machine whose every figure is the median over `machines` (rounds on one device)."""
    first = machines[0]
    peaks = [m.fma_peak_gflops for m in machines if m.fma_peak_gflops is not None]
    return replace(
        first,
        read_gbps=statistics.median(m.read_gbps for m in machines),
        copy_gbps=statistics.median(m.copy_gbps for m in machines),
        matmul_gflops={k: statistics.median(m.matmul_gflops[k] for m in machines) for k in first.matmul_gflops},
        fma_peak_gflops=statistics.median(peaks) if peaks else None,
    )


def median_rounds(rounds: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """`decode_roofline` rows of several rounds (each round's machine and steps measured side by
    side, one after the other) as one row per batch size: every figure the median over the
    rounds, `measured_over_ideal` the median of the rounds' own ratios, which `ratios` lists.

    On a shared machine the bandwidth, the FMA peak and the step all move with the neighbours'
    load from second to second: a ratio of figures measured minutes apart mixes two machines."""
    rows = []
    for i, first in enumerate(rounds[0]):
        same = [r[i] for r in rounds]
        row = dict(first)  # batch size and context: the same in every round
        for key, value in first.items():
            if isinstance(value, float):  # the measured and derived figures
                row[key] = statistics.median(r[key] for r in same)
        row["bound"] = statistics.mode(r["bound"] for r in same)
        if "measured_over_ideal" in first:
            row["ratios"] = [r["measured_over_ideal"] for r in same]
        rows.append(row)
    return rows


def format_machine(machine: MachineRoofline) -> str:
    flops = ", ".join(f"{k} {v:.0f}" for k, v in machine.matmul_gflops.items())
    peak = "" if machine.fma_peak_gflops is None else f", fp32 FMA peak {machine.fma_peak_gflops:.0f} GFLOP/s"
    if machine.fma_peak_gflops is not None and machine.kernels_isa is not None:
        peak += f" ({machine.kernels_isa} kernels)"
    return (
        f"device {machine.device} ({machine.num_threads} threads): read {machine.read_gbps:.1f} GB/s, "
        f"copy {machine.copy_gbps:.1f} GB/s, matmul GFLOP/s: {flops}{peak}"
    )


def _ms(value: float) -> str:
    """Milliseconds: one decimal from 10 ms, two from 1 ms, three below (a GPU step takes under 1 ms)."""
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}" if value >= 1 else f"{value:.3f}"


def format_roofline_table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of `decode_roofline` rows."""
    measured = any("measured_ms" in r for r in rows)
    header = "| batch | context | ideal step (ms) | bound | ideal tok/s |"
    rule = "|---:|---:|---:|:---|---:|"
    if measured:
        header += " measured step (ms) | measured tok/s | measured / ideal |"
        rule += "---:|---:|---:|"
    lines = [header, rule]
    for r in rows:
        line = (
            f"| {r['batch_size']} | {r['context_len']} | {_ms(r['ideal_ms'])} | {r['bound']} | "
            f"{r['ideal_tokens_per_s']:.0f} |"
        )
        if measured:
            if "measured_ms" in r:
                line += f" {_ms(r['measured_ms'])} | {r['measured_tokens_per_s']:.0f} | {r['measured_over_ideal']:.2f}x |"
            else:
                line += " - | - | - |"
        lines.append(line)
    rounds = [r for r in rows if len(r.get("ratios", [])) > 1]
    if rounds:
        lines.append("")
        lines.append("measured / ideal, each round (the machine and the steps side by side; the table: the median):")
        lines.extend(f"- batch {r['batch_size']}: " + ", ".join(f"{x:.2f}x" for x in r["ratios"]) for r in rounds)
    return "\n".join(lines)


def describe_host() -> dict[str, Any]:
    """CPU model, core count, torch threads and load average: context every report carries.

    A load average above the core count means other work shared the machine during the run.
    """
    import os
    import platform

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info: dict[str, Any] = {"cpu": model, "num_cpus": os.cpu_count(), "platform": platform.platform()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    if hasattr(os, "getloadavg"):
        info["load_average_1m"] = round(os.getloadavg()[0], 2)
    return info
