"""Micro-benchmark of one engine step: the fused C++ decoder (CpuDecoder) vs the Python path
(LlamaForCausalLM, fp32, oneDNN-prepacked as the ModelRunner runs it), and the CPU attention
kernel alone vs the Python paged attention.

    python -m backfill.bench.decoder_step [--batches 1 8 32] [--context 128] [--repeats 5] [--threads N]
                                          [--paths python fused-q fused-q-int8 fused-f32]
                                          [--kv-cache-dtypes bfloat16 float16 fp8_e4m3 fp8_e5m2]

A step is forward + LM head over the last row of each sequence, every sequence decoding one
token after `context` cached tokens. The fused step runs three ways: on the GGUF's own blocks
(Q4_1 / Q8_0, the product path), the same with int8 activations (the opt-in
`--activation-quantization int8`), and on F32 blocks (CpuDecoder.from_dense); `--kv-cache-dtypes`
adds the first over caches of those types (`--kv-cache-dtype`). Its time is split
into linears (LM head included), attention and the rest (norms, RoPE + KV write, SiLU,
embedding), measured inside the C++ step; the Python path's row shows its linears timed alone
and the rest (total - linears). Figures are min / median over interleaved repeats. Last, a
static batch's padding rows' attention against real rows'.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from backfill import kernels
from backfill.config import KV_CACHE_DTYPES
from backfill.model.attention import build_attention_metadata, paged_attention
from backfill.model.cpu_decoder import CpuDecoder
from backfill.model.loader import kv_cache_torch_dtype, load_model, load_stored_weights


def _timed(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


PATHS = ("python", "fused-q", "fused-q-int8", "fused-f32")


def bench_steps(batches: list[int], context: int, repeats: int, block_size: int = 16,
                paths: tuple[str, ...] = PATHS, kv_cache_dtypes: tuple[str, ...] = ()) -> None:
    model = load_model(None, torch.float32, torch.device("cpu"))
    fused_f32 = CpuDecoder.from_dense(model)
    model.prepack_weights()
    config, state = load_stored_weights(None)
    fused_q = CpuDecoder(config, state)
    fused_i8 = CpuDecoder(config, state, activation_quantization="int8")  # opt-in, not exact
    print(f"fused step kernels: {fused_q.kernels} (linears: {kernels.extension().isa()}), "
          f"{torch.get_num_threads()} threads, context {context}")
    blocks_per_seq = -(-(context + 1) // block_size)
    print(f"{'batch':>5} {'path':>20} {'min ms':>9} {'median ms':>10} {'linear':>8} {'attention':>10} {'other':>7}")
    for batch in batches:
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
        positions, meta = build_attention_metadata([context] * batch, [1] * batch, tables, block_size,
                                                   torch.device("cpu"))
        input_ids = torch.randint(0, config.vocab_size, (batch,))  # [B]
        rows = torch.arange(batch)  # [B], every row samples
        # each fused path: its decoder and its caches' type ("auto": fp32)
        fused = {name: (d, "auto") for name, d in (("fused-q", fused_q), ("fused-q-int8", fused_i8),
                                                   ("fused-f32", fused_f32)) if name in paths}
        fused.update({f"fused-q kv {kv}": (fused_q, kv) for kv in kv_cache_dtypes})
        decoders = {name: d for name, (d, _) in fused.items()}
        caches = {name: d.make_kv_caches(batch * blocks_per_seq, block_size, kv_cache_torch_dtype(kv, torch.float32))
                  for name, (d, kv) in fused.items()}
        caches["python"] = model.make_kv_caches(batch * blocks_per_seq, block_size)
        for cache in caches.values():
            for k, v in cache:
                k.copy_(torch.randn(k.shape))
                v.copy_(torch.randn(v.shape))

        @torch.inference_mode()
        def python_step() -> None:
            hidden = model(input_ids, positions, caches["python"], meta)  # [B, hidden]
            model.compute_logits(hidden[rows])

        def fused_step(decoder: CpuDecoder, name: str) -> Callable[[], object]:
            return lambda: decoder.forward_logits(input_ids, positions, caches[name], meta, rows)

        steps = {name: fused_step(d, name) for name, d in decoders.items()}
        if "python" in paths:
            steps = {"python": python_step, **steps}
        for step in steps.values():  # warm-up: scratch buffers, caches
            step()
        results: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(repeats):  # interleaved, so machine noise hits every path alike
            for name, step in steps.items():
                results[name].append(_timed(step, 1)[0])
        linears = _python_linears(model, batch, repeats) if "python" in paths else 0.0
        for name, times in results.items():
            split = f"{linears * 1e3:8.2f} {'':>10} {(min(times) - linears) * 1e3:7.2f}" if name == "python" else ""
            if name != "python":
                decoder = decoders[name]
                decoder.set_profile(True)
                steps[name]()
                prof = decoder.profile()
                decoder.set_profile(False)
                split = f"{prof['linear'] * 1e3:8.2f} {prof['attention'] * 1e3:10.2f} {prof['other'] * 1e3:7.2f}"
            print(f"{batch:>5} {name:>20} {min(times) * 1e3:9.2f} {statistics.median(times) * 1e3:10.2f} {split}")


@torch.inference_mode()
def _python_linears(model: torch.nn.Module, batch: int, repeats: int) -> float:
    """Min seconds of the Python path's linear layers alone (every layer's four, the LM head) on
    `batch` rows: what its step costs besides them is the eager-op overhead the fused step removes."""
    hidden = model.config.hidden_size
    x = torch.randn(batch, hidden)  # [B, hidden]
    attn = torch.randn(batch, model.config.num_heads * model.config.head_dim)  # [B, H * D]
    act = torch.randn(batch, model.config.intermediate_size)  # [B, intermediate]

    def run() -> None:
        for layer in model.layers:
            layer.self_attn.qkv_proj(x)
            layer.self_attn.o_proj(attn)
            layer.mlp.gate_up_proj(x)
            layer.mlp.down_proj(act)
        model.compute_logits(x)

    run()
    return _timed(run, repeats)[0]


def bench_attention(repeats: int, block_size: int = 16) -> None:
    """One layer's attention of the default model's shape (9 heads, 3 KV heads, head_dim 64)."""
    ext = kernels.extension()
    heads, kv_heads, head_dim = 9, 3, 64
    cases = [("decode 1 x 128", [128], [1]), ("decode 1 x 4000", [4000], [1]), ("decode 32 x 128", [128] * 32, [1] * 32),
             ("decode 32 x 1000", [1000] * 32, [1] * 32), ("prompt 512", [0], [512]),
             ("chunk 512 after 2048", [2048], [512]), ("chunk 512 after 7488", [7488], [512])]
    print(f"\nattention, one layer ({heads} heads, {kv_heads} KV heads, head_dim {head_dim}), min ms")
    print(f"{'case':>22} {'fused':>8} {'python':>8}")
    for name, num_computed, query_lens in cases:
        tables, next_block = [], 0
        for nc, q in zip(num_computed, query_lens):
            n = -(-(nc + q) // block_size)
            tables.append(list(range(next_block, next_block + n)))
            next_block += n
        _, meta = build_attention_metadata(num_computed, query_lens, tables, block_size, torch.device("cpu"))
        shape = (next_block, block_size, kv_heads, head_dim)
        k_cache, v_cache = torch.randn(shape), torch.randn(shape)  # [blocks, bs, Hkv, D]
        k_panels, v_panels = CpuDecoder.kv_panels(k_cache, v_cache)
        q = torch.randn(sum(query_lens), heads, head_dim)  # [T, H, D]
        scale = head_dim**-0.5
        reps = repeats if sum(query_lens) < 512 else max(2, repeats // 3)
        fused = _timed(lambda: ext.paged_attention(q, k_panels, v_panels, meta.block_tables, meta.seq_lens,
                                                   meta.query_start, scale, 0), reps)[0]
        python = _timed(lambda: paged_attention(q, k_cache, v_cache, meta, scale), reps)[0]
        print(f"{name:>22} {fused * 1e3:8.2f} {python * 1e3:8.2f}")


def bench_padding_rows(repeats: int, block_size: int = 16, rows: int = 16) -> None:
    """A static batch's padding rows attend over one scratch block repeated (it stays in cache):
    their attention against real rows' over distinct blocks, all 30 layers of the default model
    (the planner charges a padding row's context at cost_model.PADDING_CONTEXT_COST)."""
    ext = kernels.extension()
    heads, kv_heads, head_dim, layers = 9, 3, 64, 30
    print(f"\npadding rows: {rows} decodes x {layers} layers, min ms")
    print(f"{'context':>8} {'real':>8} {'padding':>8} {'ratio':>6}")
    for context in (200, 450, 700):
        n = -(-(context + 1) // block_size)
        times: dict[str, float] = {}
        for name, tables in (("real", [list(range(r * n, (r + 1) * n)) for r in range(rows)]),
                             ("padding", [[0] * n for _ in range(rows)])):
            _, meta = build_attention_metadata([context] * rows, [1] * rows, tables, block_size, torch.device("cpu"))
            # K [blocks, Hkv, D, bs], V [blocks, Hkv, bs, D]: the kernel's layout
            caches = [(torch.randn(rows * n, kv_heads, head_dim, block_size),
                       torch.randn(rows * n, kv_heads, block_size, head_dim)) for _ in range(layers)]
            q = torch.randn(rows, heads, head_dim)

            times[name] = _timed(lambda: [ext.paged_attention(q, k, v, meta.block_tables, meta.seq_lens,
                                                              meta.query_start, head_dim**-0.5, 0)
                                          for k, v in caches], repeats)[0]
        print(f"{context:>8} {times['real'] * 1e3:8.2f} {times['padding'] * 1e3:8.2f} "
              f"{times['padding'] / times['real']:6.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--skip-steps", action="store_true", help="only the attention comparison")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS), help="the steps to time")
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=[], choices=[k for k in KV_CACHE_DTYPES if k != "auto"],
                        help="also the fused step on the GGUF's blocks over KV caches of these types")
    parser.add_argument("--skip-attention", action="store_true", help="only the steps")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if not kernels.available():
        print("the CPU kernels extension is unavailable")
        return 1
    if not args.skip_steps:
        bench_steps(args.batches, args.context, args.repeats, paths=tuple(args.paths),
                    kv_cache_dtypes=tuple(args.kv_cache_dtypes))
    if not args.skip_attention:
        bench_attention(args.repeats * 4)
        bench_padding_rows(args.repeats * 3)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
