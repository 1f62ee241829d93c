"""`python -m backfill.kernels.bench_qgemm`: the packed linear kernels on the default model's
matrices, against this machine's limits.

One "step" runs every linear layer of one decoder step of SmolLM2-135M as the engine does: 30 x
(qkv [960, 576], o [576, 576], gate_up [3072, 576], down [576, 1536]) in Q4_1 and the tied Q8_0
LM head [49152, 576], 121 matrices (~96 MB packed) cycled in order, so every weight comes from
memory, not cache. For each M (rows of x) it prints the step time (min over repeats), the packed
bytes read per second and GFLOP/s, side by side with the memory bound (bytes / read bandwidth),
torch's fp32 `F.linear` on the dequantized weights (MKL / oneDNN), and the fp32 matmul peak
(`torch.mm` 2048^3). The scalar fallback runs the M = 1 step once.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from backfill.kernels import extension
from backfill.model.loader import _GGUFFile
from backfill.model_files import default_model_path


@dataclass(frozen=True)
class Matrix:
    name: str
    qtype: int
    rows: int  # N, output features
    cols: int  # K, input features
    packed: torch.Tensor  # uint8 [packed_bytes]
    dense: torch.Tensor  # fp32 [N, K], the reference dequantization


def load_step_matrices(ext: object) -> list[Matrix]:
    """The 121 matrices of one decoder step, q/k/v and gate/up fused as the engine fuses them."""
    f = _GGUFFile(default_model_path())
    by_name = {t.name: t for t in f.tensors}

    def raw(name: str) -> tuple[torch.Tensor, int, int]:
        info = by_name[name]
        k = info.dims[0]
        return torch.from_numpy(np.array(f.tensor_data(info))), info.ggml_type, k

    def make(name: str, parts: list[str]) -> Matrix:
        tensors = [raw(p) for p in parts]
        qtype, k = tensors[0][1], tensors[0][2]
        rows = torch.cat([t[0] for t in tensors])  # uint8 [N, row_bytes]
        packed = ext.repack(rows, qtype, k)  # type: ignore[attr-defined]
        dense = ext.dequantize(rows, qtype, k)  # type: ignore[attr-defined]
        return Matrix(name, qtype, rows.shape[0], k, packed, dense)

    num_layers = int(f.metadata["llama.block_count"])  # type: ignore[call-overload]
    out = []
    for layer in range(num_layers):
        p = f"blk.{layer}."
        out.append(make(p + "qkv", [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]))
        out.append(make(p + "o", [p + "attn_output.weight"]))
        out.append(make(p + "gate_up", [p + "ffn_gate.weight", p + "ffn_up.weight"]))
        out.append(make(p + "down", [p + "ffn_down.weight"]))
    out.append(make("lm_head", ["token_embd.weight"]))
    return out


def cpu_idle_fraction(seconds: float = 0.25) -> float:
    """Share of all CPUs' time spent idle over `seconds` (/proc/stat; 1.0 where unreadable)."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return v[3] + v[4], sum(v)

    try:
        idle0, total0 = sample()
        time.sleep(seconds)
        idle1, total1 = sample()
    except OSError:
        return 1.0
    return (idle1 - idle0) / max(1, total1 - total0)


WAIT_IDLE_S = 0.0  # --wait-idle: wait up to this long for idle CPUs before each burst of calls
ROUNDS = 1  # --rounds: bursts of timed calls (each after an idle window when waiting)


def time_min(fn: Callable[[], None], repeats: int) -> tuple[float, float]:
    """(min, median) seconds over ROUNDS bursts of one warm-up and `repeats` timed calls. On a
    shared machine (--wait-idle) each burst first waits for the CPUs to be >= 90% idle: a
    parallel region waits a whole scheduler slice for a descheduled worker thread."""
    times = []
    for _ in range(ROUNDS):
        deadline = time.monotonic() + WAIT_IDLE_S
        while WAIT_IDLE_S > 0 and time.monotonic() < deadline and cpu_idle_fraction() < 0.9:
            pass
        fn()
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def read_bandwidth() -> float:
    """Bytes per second of a multi-threaded fp32 sum over 512 MB (the machine's read limit)."""
    a = torch.ones(128 * 1024 * 1024)
    best, _ = time_min(lambda: a.sum(), 5)
    return a.numel() * 4 / best


def mm_peak() -> float:
    """fp32 FLOP/s of torch.mm on 2048^3 (MKL)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    c = torch.empty(2048, 2048)
    best, _ = time_min(lambda: torch.mm(a, b, out=c), 5)
    return 2 * 2048**3 / best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", default="1,2,4,8,16,32,64,512", help="rows of x, comma-separated")
    parser.add_argument("--isa", default="avx512,avx2", help="kernels to time (those this CPU runs)")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per M (big M: fewer)")
    parser.add_argument("--no-torch", action="store_true", help="skip torch F.linear")
    parser.add_argument("--no-scalar", action="store_true", help="skip the scalar fallback")
    parser.add_argument("--per-matrix", action="store_true", help="also time each kind of matrix at M = 1")
    parser.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                        help="before each burst of timed calls wait up to S seconds for idle CPUs (shared machines)")
    parser.add_argument("--rounds", type=int, default=1, help="bursts of timed calls per measurement (min over all)")
    args = parser.parse_args()
    global WAIT_IDLE_S, ROUNDS
    WAIT_IDLE_S, ROUNDS = args.wait_idle, args.rounds

    ext = extension()
    if ext is None:
        raise SystemExit("the CPU kernels are unavailable")
    torch.manual_seed(0)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    mats = load_step_matrices(ext)
    step_bytes = sum(m.packed.numel() for m in mats)
    weights = sum(m.rows * m.cols for m in mats)
    bw, peak = read_bandwidth(), mm_peak()
    print(f"CPU {cpu}, {torch.get_num_threads()} threads, best ISA {ext.isa()}")
    print(f"step: {len(mats)} matrices, {weights / 1e6:.1f} M weights, {step_bytes / 1e6:.1f} MB packed "
          f"({8 * step_bytes / weights:.2f} bits/weight), {4 * weights / 1e6:.0f} MB as fp32")
    print(f"machine: read {bw / 1e9:.1f} GB/s (memory bound of a step {step_bytes / bw * 1e3:.2f} ms), "
          f"torch.mm fp32 peak {peak / 1e9:.0f} GFLOP/s")

    ms = [int(v) for v in args.m.split(",")]
    xs = {k: torch.randn(max(ms), k) for k in {m.cols for m in mats}}  # fp32 [M, K]
    outs = {n: torch.empty(max(ms), n) for n in {m.rows for m in mats}}  # fp32 [M, N]

    def step(m: int) -> Callable[[], None]:
        def run() -> None:
            for w in mats:
                ext.qlinear(xs[w.cols][:m], w.packed, w.qtype, w.rows, w.cols, out=outs[w.rows][:m])
        return run

    def torch_step(m: int) -> Callable[[], None]:
        def run() -> None:
            for w in mats:
                torch.mm(xs[w.cols][:m], w.dense.T, out=outs[w.rows][:m])
        return run

    def reps(m: int) -> int:
        return max(2, args.repeats if m <= 64 else args.repeats // 4)


    isas = [i for i in args.isa.split(",") if ext.set_isa(i)]
    header = f"{'M':>5} {'ISA':>7} {'ms':>8} {'med ms':>8} {'GB/s':>6} {'GFLOP/s':>8} {'%peak':>6} {'x mem':>6}"
    if not args.no_torch:
        header += f" | {'torch ms':>8} {'GFLOP/s':>8} {'speedup':>7}"
    print(header)
    for m in ms:
        flops = 2 * m * weights
        t_torch = time_min(torch_step(m), reps(m))[0] if not args.no_torch else None
        for isa in isas:
            ext.set_isa(isa)
            best, med = time_min(step(m), reps(m))
            line = (f"{m:>5} {isa:>7} {best * 1e3:>8.2f} {med * 1e3:>8.2f} {step_bytes / best / 1e9:>6.1f} "
                    f"{flops / best / 1e9:>8.1f} {100 * flops / best / peak:>5.0f}% {best * bw / step_bytes:>6.2f}")
            if t_torch is not None:
                line += f" | {t_torch * 1e3:>8.2f} {flops / t_torch / 1e9:>8.1f} {t_torch / best:>6.2f}x"
            print(line, flush=True)
    if not args.no_scalar and ext.set_isa("scalar"):
        best, _ = time_min(step(1), 1)
        print(f"    1  scalar {best * 1e3:>8.1f} ms (the portable fallback: unpack, reference dequantization, fmaf)")

    if args.per_matrix:
        print("per matrix at M = 1 (each kind cycled over its 30 copies; us per matrix, GB/s):")
        for isa in isas:
            ext.set_isa(isa)
            for kind in ["qkv", "o", "gate_up", "down", "lm_head"]:
                group = [w for w in mats if w.name.endswith(kind)]

                def run(group: list[Matrix] = group) -> None:
                    for w in group:
                        ext.qlinear(xs[w.cols][:1], w.packed, w.qtype, w.rows, w.cols, out=outs[w.rows][:1])

                best, _ = time_min(run, args.repeats)
                nbytes = sum(w.packed.numel() for w in group)
                print(f"  {isa:>7} {kind:>8} {best / len(group) * 1e6:8.1f} us {nbytes / best / 1e9:6.1f} GB/s")
    ext.set_isa("avx512") or ext.set_isa("avx2")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
