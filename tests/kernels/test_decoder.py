"""The fused CPU decoder step (CpuDecoder) against LlamaForCausalLM: tiny random models of every
supported architecture feature over chained mixed steps, quantized weights in row segments,
batch, thread-count and chunking (preemption) invariance, every SIMD variant, and the real
default model's greedy output."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backfill import kernels
from backfill.model.config import ModelConfig
from backfill.model.cpu_decoder import CpuDecoder, LinearWeights, dense_weight
from backfill.model.quant import QuantSegment, QuantWeight
from backfill.model.llama import LlamaForCausalLM
from tests.kernels.test_attention_cpu import run_under_isa, split
from tests.model.paged_driver import PagedDriver

pytestmark = pytest.mark.skipif(not kernels.available(), reason="CPU kernels extension unavailable")

BASE = dict(
    vocab_size=101, hidden_size=64, intermediate_size=88, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=256,
    tie_word_embeddings=True, attention_bias=False, bos_token_id=None, eos_token_ids=(),
)
CONFIGS = {
    "gqa2_hd16": {},
    "mqa_hd32_untied": dict(num_kv_heads=1, head_dim=32, tie_word_embeddings=False),
    "qwen2_bias_hd64": dict(head_dim=64, attention_bias=True),
    "sliding_window": dict(sliding_window=7),
    "yarn": dict(head_dim=32, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
}
# (request id, new tokens) per step: fresh prompts, then decodes beside a chunk after a cached
# prefix and a fresh prompt, then decodes in another order, then a prompt beside decodes.
SCHEDULE = [
    [("a", 13), ("b", 5), ("c", 20)],
    [("a", 1), ("b", 1), ("c", 10), ("d", 9)],
    [("a", 1), ("b", 1), ("c", 1), ("d", 1)],
    [("d", 1), ("c", 1), ("a", 1), ("b", 1)],
    [("a", 1), ("e", 17), ("b", 1), ("c", 1), ("d", 1)],
]
LOGITS_ATOL = 1e-4


def tiny_model(name: str, seed: int = 0, **overrides: object) -> LlamaForCausalLM:
    config = ModelConfig(**{**BASE, **CONFIGS[name], **overrides})  # type: ignore[arg-type]
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    for pname, p in model.named_parameters():
        if "norm" in pname:
            p.uniform_(0.5, 1.5)
        elif p.dim() == 1:  # q/k/v bias
            p.normal_(0.0, 0.3)
        else:  # activations stay O(1): std 1 / sqrt(fan_in), the embedding O(1)
            p.normal_(0.0, 1.0 if "embed" in pname else p.shape[1] ** -0.5)
    return model


def token_batches(vocab: int, seed: int, schedule=SCHEDULE) -> list[list[tuple[str, list[int]]]]:
    gen = torch.Generator().manual_seed(seed)
    return [[(r, torch.randint(0, vocab, (n,), generator=gen).tolist()) for r, n in step] for step in schedule]


def run_twins(reference, fused, batches, block_size: int = 8) -> None:
    """Both models over the same steps and block tables: logits and KV caches agree each step."""
    ref_driver = PagedDriver(reference, num_blocks=48, block_size=block_size, seed=1)
    fused_driver = PagedDriver(fused, num_blocks=48, block_size=block_size, seed=1)
    for i, batch in enumerate(batches):
        expected = ref_driver.step(batch)  # [S, vocab]
        got = fused_driver.step(batch)  # [S, vocab]
        assert got.dtype == torch.float32 and got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=LOGITS_ATOL, rtol=1e-5, msg=lambda m: f"step {i}: {m}")
        for layer, ((rk, rv), fused_kv) in enumerate(zip(ref_driver.kv_caches, fused_driver.kv_caches)):
            fk, fv = fused.kv_rows(*fused_kv)  # [blocks, bs, Hkv, D] as the reference's
            torch.testing.assert_close(fk, rk, atol=1e-5, rtol=1e-5, msg=lambda m: f"step {i} layer {layer} K: {m}")
            torch.testing.assert_close(fv, rv, atol=1e-5, rtol=1e-5, msg=lambda m: f"step {i} layer {layer} V: {m}")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_llama_dense(name: str) -> None:
    model = tiny_model(name)
    run_twins(model, CpuDecoder.from_dense(model), token_batches(model.config.vocab_size, seed=2))


def quantize(weight: torch.Tensor, qtype: int) -> tuple[QuantSegment, torch.Tensor]:
    """[rows, cols] fp32 -> (ggml blocks of `qtype`, the fp32 values they stand for)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize
    from gguf.quants import quantize as gguf_quantize

    t = GGMLQuantizationType(qtype)
    raw = gguf_quantize(weight.numpy(), t)  # [rows, row_bytes] uint8
    values = torch.from_numpy(np.ascontiguousarray(dequantize(raw, t)))  # [rows, cols]
    return QuantSegment(torch.from_numpy(raw), qtype), values


def test_quantized_segments_match_llama() -> None:
    """Q8_0 / Q4_1 / F32 row segments in one linear (as Q4_K_M files mix Q4_K and Q6_K), a
    quantized embedding table and untied head; the reference runs on the same values in fp32."""
    q8, q41 = 8, 3
    # blocks of 32 along every input dimension: intermediate 96
    model = tiny_model("mqa_hd32_untied", intermediate_size=96, attention_bias=True)
    config = model.config
    state: dict[str, LinearWeights] = {}
    q_rows = config.num_heads * config.head_dim
    kv_rows = config.num_kv_heads * config.head_dim

    def segmented(pname: str, cuts: list[int], types: list[int]) -> None:
        weight = dict(model.named_parameters())[pname]  # [rows, cols]
        segments = []
        for (start, end), qtype in zip(zip(cuts[:-1], cuts[1:]), types):
            packed, values = quantize(weight[start:end].contiguous(), qtype) if qtype else (
                dense_weight(weight[start:end]).segments[0], weight[start:end])
            weight[start:end] = values
            segments.append(packed)
        state[pname] = QuantWeight(segments, weight.shape[1])

    for i in range(config.num_layers):
        pre = f"layers.{i}."
        segmented(pre + "self_attn.qkv_proj.weight", [0, q_rows, q_rows + kv_rows, q_rows + 2 * kv_rows], [q8, q41, 0])
        segmented(pre + "self_attn.o_proj.weight", [0, config.hidden_size], [q41])
        segmented(pre + "mlp.gate_up_proj.weight", [0, 96, 192], [q8, q41])
        segmented(pre + "mlp.down_proj.weight", [0, config.hidden_size], [q8])
    segmented("embed_tokens.weight", [0, config.vocab_size], [q8])
    segmented("lm_head.weight", [0, config.vocab_size], [q41])
    for pname, p in model.named_parameters():
        state.setdefault(pname, p.detach().clone())
    run_twins(model, CpuDecoder(config, state), token_batches(config.vocab_size, seed=4))


def q4_1_state(model: LlamaForCausalLM) -> dict[str, LinearWeights]:
    """The model's weights with its linears as Q4_1 blocks (the default model's type)."""
    config = model.config
    state: dict[str, LinearWeights] = {}
    for i in range(config.num_layers):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            pname = f"layers.{i}.{name}.weight"
            weight = dict(model.named_parameters())[pname]
            packed, _ = quantize(weight.detach().contiguous(), 3)
            state[pname] = QuantWeight([packed], weight.shape[1])
    for pname, p in model.named_parameters():
        state.setdefault(pname, p.detach().clone())
    return state


def check_kv_prefetch_changes_nothing() -> None:
    model = tiny_model("gqa2_hd16", num_layers=3, intermediate_size=96, hidden_size=128)
    config = model.config
    state = q4_1_state(model)
    with_prefetch, without = CpuDecoder(config, state), CpuDecoder(config, state)
    without.kv_prefetch_cap = 0
    assert with_prefetch.kv_prefetch_cap > 0
    # (request, new tokens) per step: 12 rows, 40, then 17 (AVX-512: the fused kernel, the panels,
    # two fused halves; AVX2: the panels at all three)
    schedule = [[("a", 7), ("b", 5)], [("a", 1), ("b", 1), ("c", 30), ("d", 8)],
                [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("e", 10), ("f", 3)]]
    drivers = [PagedDriver(d, num_blocks=64, block_size=8, seed=1) for d in (with_prefetch, without)]
    for i, batch in enumerate(token_batches(config.vocab_size, seed=8, schedule=schedule)):
        got, expected = (driver.step(batch) for driver in drivers)
        assert with_prefetch.last_kv_prefetch_blocks > 0 and without.last_kv_prefetch_blocks == 0, f"step {i}"
        assert torch.equal(got, expected), f"step {i}: the prefetch changed the logits"
        for layer, ((k1, v1), (k2, v2)) in enumerate(zip(drivers[0].kv_caches, drivers[1].kv_caches)):
            assert torch.equal(k1, k2) and torch.equal(v1, v2), f"step {i} layer {layer}: the caches differ"
    print("ok")


@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_kv_prefetch_changes_nothing(isa: str) -> None:
    """The next layer's K/V prefetched while a layer's MLP runs (steps of 12, 40 and 17 rows: every
    GEMM path that prefetches on this ISA) leaves every logit and cache entry as without it."""
    if isa == "native":
        check_kv_prefetch_changes_nothing()
    else:
        code = "from tests.kernels.test_decoder import check_kv_prefetch_changes_nothing as c; c()"
        assert run_under_isa(isa, code, timeout=300) == "ok"


def test_batch_invariant() -> None:
    """One sequence's logits, bit for bit: alone, batched with decodes and prompt chunks, reordered."""
    model = tiny_model("sliding_window")
    decoder = CpuDecoder.from_dense(model)
    gen = torch.Generator().manual_seed(5)
    x_tokens = torch.randint(0, 101, (16,), generator=gen).tolist()
    x_steps = [x_tokens[:11]] + [[t] for t in x_tokens[11:]]  # prompt, then 5 decodes

    def others(n: int) -> list[int]:
        return torch.randint(0, 101, (n,), generator=gen).tolist()

    alone_driver = PagedDriver(decoder, num_blocks=48, block_size=8, seed=2)
    alone = [alone_driver.step([("x", ids)])[0] for ids in x_steps]
    companions = [
        [("y", others(9)), ("x", None)],
        [("y", others(1)), ("w", others(12)), ("x", None)],
        [("x", None), ("w", others(1)), ("y", others(1))],
        [("v", others(20)), ("w", others(1)), ("x", None), ("y", others(1))],
        [("y", others(1)), ("x", None)],
        [("x", None), ("v", others(1))],
    ]
    driver = PagedDriver(decoder, num_blocks=48, block_size=8, seed=3)
    for i, batch in enumerate(companions):
        rows = [(r, x_steps[i] if ids is None else ids) for r, ids in batch]
        logits = driver.step(rows)  # [S, vocab]
        got = logits[[r for r, _ in batch].index("x")]
        assert torch.equal(got, alone[i]), f"step {i}: x's logits differ when batched"


def test_thread_count_invariant() -> None:
    model = tiny_model("gqa2_hd16")
    decoder = CpuDecoder.from_dense(model)
    batches = token_batches(101, seed=6)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            driver = PagedDriver(decoder, num_blocks=48, block_size=8, seed=1)
            results.append([driver.step(b) for b in batches])
    finally:
        torch.set_num_threads(threads)
    for i, (one, many) in enumerate(zip(*results)):
        assert torch.equal(one, many), f"step {i} differs between 1 and {max(2, threads)} threads"


@pytest.mark.parametrize("num_threads", [2, 3])
def test_row_shards_and_teams_change_nothing(num_threads: int) -> None:
    """Each thread taking its own sequences through every layer (row shards) gives every logit and
    cache entry the bits of each operation split over the threads, as one team (team_steps, the
    default) or forking torch's pool per operation; the automatic choice shards a step of
    decodes and short chunks and not one with a long prompt chunk. 3 threads: a team's shares
    of uneven size, more threads than a 2-core machine has cores."""
    model = tiny_model("gqa2_hd16", num_layers=3, intermediate_size=96, hidden_size=128)
    sharded, whole, forked = (CpuDecoder.from_dense(model) for _ in range(3))
    sharded.row_shards = whole.row_shards = forked.row_shards = 0
    sharded.row_shards = 1
    assert whole.team_steps
    forked.team_steps = False
    auto = CpuDecoder.from_dense(model)
    assert auto.row_shards == -1
    # 2 sequences, then 7 of decodes and chunks, 12 decodes, a long chunk beside decodes, a lone
    # decode, then 80 tokens (more than a norm's grain: its rows cut between a team's threads)
    decodes = [(f"d{i}", 1) for i in range(12)]
    schedule = [[("a", 7), ("b", 5)], [("a", 1), ("b", 3), ("c", 30), ("d", 8), ("e", 2), ("f", 1), ("g", 16)],
                [(r, 20) for r, _ in decodes], decodes, [("a", 1), ("h", 40), ("b", 1)], [("b", 1)],
                [("h", 30), ("i", 50)]]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(num_threads)
        drivers = [PagedDriver(d, num_blocks=96, block_size=8, seed=1) for d in (sharded, whole, forked, auto)]
        auto_shards = []
        for i, batch in enumerate(token_batches(model.config.vocab_size, seed=9, schedule=schedule)):
            got, expected, from_forked, from_auto = (driver.step(batch) for driver in drivers)
            for logits in (got, from_forked, from_auto):
                assert torch.equal(logits, expected), f"step {i}: logits differ"
            assert sharded.last_shards == min(len(batch), num_threads) and whole.last_shards == 1, f"step {i}"
            auto_shards.append(auto.last_shards)
            for other in (drivers[0], drivers[2]):
                for layer, ((k1, v1), (k2, v2)) in enumerate(zip(other.kv_caches, drivers[1].kv_caches)):
                    assert torch.equal(k1, k2) and torch.equal(v1, v2), f"step {i} layer {layer}: the caches differ"
    finally:
        torch.set_num_threads(threads)
    if num_threads == 2:  # (3 shards of 12 decodes are too thin: the step runs whole)
        assert auto_shards[3] > 1 and auto_shards[4] == auto_shards[5] == 1, auto_shards


def q4_1_decoder(model: LlamaForCausalLM) -> CpuDecoder:
    return CpuDecoder(model.config, q4_1_state(model))


@pytest.mark.parametrize("num_threads", [2, 3])
def test_digit_form_teams_shards_and_forks_agree(num_threads: int) -> None:
    """Q4_1 linears in the digit form (on by default where the CPU has AMX; forced on here): a team
    prepares x's AMX groups once, each thread its share of the blocks, and every thread reads the
    others' (qgemm.cpp); row shards and forked operations prepare their own. Every way gives the
    same logits and caches, at steps of one to three AMX groups (17, 40, 20 decodes: shards of 10)
    and below one; and a sequence's logits do not depend on its companions."""
    ext = kernels.extension()
    before = ext.digit_form()
    ext.set_digit_form(True)
    model = tiny_model("gqa2_hd16", num_layers=2, intermediate_size=96, hidden_size=128)
    sharded, whole, forked, auto = (q4_1_decoder(model) for _ in range(4))
    sharded.row_shards = whole.row_shards = forked.row_shards = 0
    sharded.row_shards = 1
    forked.team_steps = False
    decodes = [(f"d{i}", 1) for i in range(20)]
    schedule = [[("a", 7), ("b", 10)], [("a", 1), ("b", 1), ("c", 30), ("d", 8)], [(r, 5) for r, _ in decodes],
                decodes, [("a", 1), ("h", 44), ("b", 1)], [("a", 1)]]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(num_threads)
        drivers = [PagedDriver(d, num_blocks=128, block_size=8, seed=1) for d in (sharded, whole, forked, auto)]
        batches = token_batches(model.config.vocab_size, seed=11, schedule=schedule)
        among_others = []
        for i, batch in enumerate(batches):
            got, expected, from_forked, from_auto = (driver.step(batch) for driver in drivers)
            among_others.append(expected)
            for logits in (got, from_forked, from_auto):
                assert torch.equal(logits, expected), f"step {i}: logits differ"
            for other in (drivers[0], drivers[2], drivers[3]):
                for layer, ((k1, v1), (k2, v2)) in enumerate(zip(other.kv_caches, drivers[1].kv_caches)):
                    assert torch.equal(k1, k2) and torch.equal(v1, v2), f"step {i} layer {layer}: the caches differ"
        alone = PagedDriver(q4_1_decoder(model), num_blocks=32, block_size=8, seed=2)
        checked = 0
        for batch, logits in zip(batches, among_others):  # sequence "a" alone: the same logits
            names = [r for r, _ in batch]
            if "a" in names:
                assert torch.equal(alone.step([batch[names.index("a")]])[0], logits[names.index("a")])
                checked += 1
        assert checked == 4
    finally:
        torch.set_num_threads(threads)
        ext.set_digit_form(before)


def test_a_bad_block_in_a_shard_raises_and_the_next_step_runs() -> None:
    """An out-of-range block id in a sharded step is refused before any shard runs, naming the
    step's sequence (not its index within a shard), and the decoder serves the next step."""
    from backfill.model.attention import build_attention_metadata

    model = tiny_model("gqa2_hd16", num_layers=2, intermediate_size=96, hidden_size=128)
    decoder = CpuDecoder.from_dense(model)
    decoder.row_shards = 1
    caches = decoder.make_kv_caches(16, 8)
    positions, meta = build_attention_metadata([0] * 12, [1] * 12, [[i] for i in range(12)], 8, torch.device("cpu"))
    ids, rows = torch.randint(0, 101, (12,)), torch.arange(12)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        good = decoder.forward_logits(ids, positions, caches, meta, rows)
        meta.block_tables[7, 0] = 16  # one past the last block: sequence 7, in the second shard
        with pytest.raises(RuntimeError, match="sequence 7: block id 16 out of range"):
            decoder.forward_logits(ids, positions, caches, meta, rows)
        meta.block_tables[7, 0] = 7
        assert torch.equal(decoder.forward_logits(ids, positions, caches, meta, rows), good)
        assert decoder.last_shards == 2
    finally:
        torch.set_num_threads(threads)


def decode_step(driver: PagedDriver, batch: list[tuple[str, int]],
                greedy: bool) -> tuple[torch.Tensor | None, list[int]]:
    """A step of one decode a sequence through CpuDecoder.decode (its lists as the ModelRunner
    builds them), with the driver's block tables and caches."""
    decoder = driver.model
    assert isinstance(decoder, CpuDecoder)
    bs = driver.block_size
    for request_id, _ in batch:
        table = driver.block_tables[request_id]
        if len(table) * bs <= driver.num_computed[request_id]:
            table.append(driver.free_blocks.pop())
    positions = [driver.num_computed[r] for r, _ in batch]
    tables = [driver.block_tables[r] for r, _ in batch]
    out = decoder.decode([token for _, token in batch], positions, tables, driver.kv_caches,
                         decoder.config.sliding_window, greedy)
    for request_id, _ in batch:
        driver.num_computed[request_id] += 1
    return out


@pytest.mark.parametrize("name", ["gqa2_hd16", "sliding_window", "qwen2_bias_hd64"])
def test_decode_from_lists_matches_forward(name: str) -> None:
    """CpuDecoder.decode (a step of decodes from plain lists, the ModelRunner's decode-only
    steps) gives forward + compute_logits' logits bit for bit, writes the same KV caches, and
    with `greedy` each row's first argmax: sequences of different lengths in shuffled block
    tables, crossing blocks and the sliding window, in changing orders, one to three threads."""
    model = tiny_model(name)
    decoder, twin = CpuDecoder.from_dense(model), CpuDecoder.from_dense(model)
    gen = torch.Generator().manual_seed(3)
    drivers = [PagedDriver(d, num_blocks=64, block_size=8, seed=5) for d in (decoder, twin)]
    prompts = [("a", 13), ("b", 1), ("c", 30)]
    for driver in drivers:
        driver.step([(r, torch.randint(0, 101, (n,), generator=torch.Generator().manual_seed(n)).tolist())
                     for r, n in prompts])
    threads = torch.get_num_threads()
    try:
        for step in range(12):
            torch.set_num_threads(1 + step % 3)
            order = [["a", "b", "c"], ["c", "a", "b"], ["b", "c"]][step % 3]
            batch = [(r, int(torch.randint(0, 101, (1,), generator=gen))) for r in order]
            expected = drivers[1].step([(r, [t]) for r, t in batch])  # [S, vocab]
            if step % 2 == 0:
                logits, tokens = decode_step(drivers[0], batch, greedy=False)
                assert tokens == [] and logits is not None and torch.equal(logits, expected), f"step {step}"
            else:
                logits, tokens = decode_step(drivers[0], batch, greedy=True)
                assert logits is None and tokens == expected.argmax(dim=-1).tolist(), f"step {step}"
            for (k, v), (tk, tv) in zip(drivers[0].kv_caches, drivers[1].kv_caches):
                assert torch.equal(k, tk) and torch.equal(v, tv), f"step {step}: KV caches differ"
    finally:
        torch.set_num_threads(threads)


# The narrow caches and how far their logits may stray from the fp32 run's (times its largest):
# 8 / 11 / 4 / 3 significand bits.
NARROW_KV = {torch.bfloat16: 0.05, torch.float16: 0.05, torch.float8_e4m3fn: 0.25, torch.float8_e5m2: 0.5}


@pytest.mark.parametrize("dtype", list(NARROW_KV))
@pytest.mark.parametrize("name", ["gqa2_hd16", "sliding_window", "qwen2_bias_hd64"])
def test_narrow_kv_caches(name: str, dtype: torch.dtype) -> None:
    """kv_cache_dtype="bfloat16" / "float16" / "fp8_e4m3" / "fp8_e5m2": the decoder writes K and V
    rounded to nearest even (layer 0's, whose inputs are the same in both runs, equal the fp32
    run's .to(dtype) bit for bit), decode() over those caches gives forward's logits and caches
    bit for bit, and the logits stay near the fp32 ones (the rounding is the only change)."""
    model = tiny_model(name)
    decoders = [CpuDecoder.from_dense(model) for _ in range(3)]
    drivers = [PagedDriver(d, num_blocks=64, block_size=8, seed=5) for d in decoders]
    for driver in drivers[1:]:  # [1]: decode(), [2]: forward, both over bf16 caches
        driver.kv_caches = driver.model.make_kv_caches(64, 8, dtype)
    prompts = [(r, torch.randint(0, 101, (n,), generator=torch.Generator().manual_seed(n)).tolist())
               for r, n in [("a", 13), ("b", 1), ("c", 30)]]
    exact = drivers[0].step(prompts)
    approx = drivers[2].step(prompts)
    drivers[1].step(prompts)
    gen = torch.Generator().manual_seed(3)
    for step in range(10):
        batch = [(r, int(torch.randint(0, 101, (1,), generator=gen))) for r in ["a", "b", "c"][step % 2:]]
        fk, fv = drivers[0].kv_caches[0]
        bk, bv = drivers[2].kv_caches[0]
        assert bk.dtype == dtype and torch.equal(bk, fk.to(dtype)), f"step {step}: layer 0 K"
        assert torch.equal(bv, fv.to(dtype)), f"step {step}: layer 0 V"
        scale = float(exact.abs().max())
        assert float((approx - exact).abs().max()) < NARROW_KV[dtype] * scale, f"step {step}"
        exact = drivers[0].step([(r, [t]) for r, t in batch])
        approx = drivers[2].step([(r, [t]) for r, t in batch])
        logits, _ = decode_step(drivers[1], batch, greedy=False)
        assert logits is not None and torch.equal(logits, approx), f"step {step}: decode() differs from forward"
        for (k, v), (tk, tv) in zip(drivers[1].kv_caches, drivers[2].kv_caches):
            assert torch.equal(k, tk) and torch.equal(v, tv), f"step {step}: KV caches differ"


@pytest.mark.parametrize(("dtype", "largest"), [(torch.float16, 65504.0), (torch.float8_e4m3fn, 448.0),
                                               (torch.float8_e5m2, 57344.0)])
def test_narrow_kv_cache_clamps_what_it_cannot_hold(dtype: torch.dtype, largest: float) -> None:
    """K and V past an fp16 / fp8 cache's range are written as its largest finite value, not as
    infinities (or E4M3's NaNs) that would turn attention into NaNs."""
    model = tiny_model("gqa2_hd16")
    q_size = model.config.num_heads * model.config.head_dim
    model.layers[0].self_attn.qkv_proj.weight[q_size:] *= 1e6  # layer 0's K and V rows
    decoder = CpuDecoder.from_dense(model)
    driver = PagedDriver(decoder, num_blocks=8, block_size=8, seed=1)
    driver.kv_caches = decoder.make_kv_caches(8, 8, dtype)
    logits = driver.step([("a", [5, 17, 3, 88, 41, 9])])
    k, v = (c.float() for c in driver.kv_caches[0])
    assert float(k.abs().max()) == largest and float(v.abs().max()) == largest
    assert torch.isfinite(k).all() and torch.isfinite(v).all() and torch.isfinite(logits).all()


def test_decode_refuses_bad_lists_and_the_next_step_runs() -> None:
    """CpuDecoder.decode checks every list before it writes a cache: an unknown token id, a slot or
    block id past the cache, lists of different lengths are refused (RuntimeError), and the next
    good step gives the logits it would have."""
    decoder = CpuDecoder.from_dense(tiny_model("gqa2_hd16"))
    caches = decoder.make_kv_caches(4, 8)
    good = ([5, 7], [3, 9], [[0], [1, 2]])
    expected, _ = decoder.decode(*good, caches, None, False)
    for bad, match in [
        (([5, 101], *good[1:]), "input id 101 out of range"),
        (([5, 7], [3, 16], good[2]), "position 16 past its block table"),
        (([5, 7], [3, -1], good[2]), "position -1 past its block table"),
        (([5, 7], [3, 9], [[0], [1, 4]]), "block id 4 out of range"),
        (([5, 7], [3, 9], [[0], [1, 2**62]]), "block id 4611686018427387904 out of range"),
        (([5, 7], [3, 9], [[0], [4, 2]]), "block id 4 out of range"),
        (([5], *good[1:]), "one per sequence"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            decoder.decode(*bad, caches, None, False)
    logits, _ = decoder.decode(*good, caches, None, False)
    assert torch.equal(logits, expected)


def run_sequence(decoder: CpuDecoder, tokens: list[int], sizes: list[int], seed: int, companion: bool,
                 greedy: int = 0) -> tuple[list[int], dict[int, torch.Tensor]]:
    """Feeds request x's `tokens` as steps of `sizes` tokens, then `greedy` more tokens one decode
    at a time, each the argmax of the last logits; beside another request's decodes (placed first
    or last by turns) when `companion`. Returns x's tokens and its logits [vocab] at the last
    position of every step, by position."""
    gen = torch.Generator().manual_seed(seed)
    driver = PagedDriver(decoder, num_blocks=160, block_size=8, seed=seed)
    if companion:
        driver.step([("y", torch.randint(0, 101, (37,), generator=gen).tolist())])
    tokens, logits, done = list(tokens), {}, 0
    for i, n in enumerate(sizes + [1] * greedy):
        if done == len(tokens):
            tokens.append(int(logits[done - 1].argmax()))
        batch = [("x", tokens[done:done + n])]
        if companion:
            batch.insert(i % 2, ("y", torch.randint(0, 101, (1,), generator=gen).tolist()))
        rows = driver.step(batch)  # [S, vocab]
        done += n
        logits[done - 1] = rows[[r for r, _ in batch].index("x")]
    return tokens, logits


def check_preempted_recompute(name: str) -> None:
    """A preempted request is recomputed later: its prompt and the tokens it had generated come
    back as prompt chunks (one, or many of any size), then it decodes on. Its logits at every
    position the runs share are bit-identical to the uninterrupted run's (prompt in chunks of 16
    beside decodes, then one decode a token), and so its greedy tokens."""
    model = tiny_model(name, max_position_embeddings=512)
    decoder = CpuDecoder.from_dense(model)
    gen = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, 101, (230,), generator=gen).tolist()
    num_new = 40  # the decodes cross position 256, a key partition
    tokens, original = run_sequence(decoder, prompt, split(len(prompt), [16]), seed=1, companion=True,
                                    greedy=num_new)
    assert len(tokens) == len(prompt) + num_new
    for preempted_after, pattern in [(1, [1000]), (17, [16]), (33, [1, 2, 3, 7, 16, 64, 200]), (39, [100, 1, 5])]:
        recomputed = len(prompt) + preempted_after
        again, logits = run_sequence(decoder, tokens[:recomputed], split(recomputed, pattern), seed=preempted_after,
                                     companion=preempted_after % 2 == 1, greedy=num_new - preempted_after)
        assert again == tokens, f"preempted after {preempted_after}: greedy tokens differ"
        for pos in sorted(set(logits) & set(original)):
            assert torch.equal(logits[pos], original[pos]), f"preempted after {preempted_after}: position {pos}"


@pytest.mark.parametrize("name", ["gqa2_hd16", "sliding_window", "qwen2_bias_hd64"])
def test_preempted_recompute_matches(name: str) -> None:
    check_preempted_recompute(name)


def check_lower_isa() -> None:
    """Run by test_lower_isa in a subprocess with BACKFILL_ISA set: the dense comparison again."""
    model = tiny_model("qwen2_bias_hd64")
    decoder = CpuDecoder.from_dense(model)
    run_twins(model, decoder, token_batches(101, seed=2))
    check_preempted_recompute("sliding_window")
    check_preempted_recompute("qwen2_bias_hd64")
    print(decoder.kernels)


@pytest.mark.parametrize(("isa", "expected"), [("avx2", "avx2/avx2"), ("scalar", "sse/sse")])
def test_lower_isa(isa: str, expected: str) -> None:
    """The AVX2 and baseline kernels (the ones an AVX2-only EPYC or an old CPU runs) in full."""
    code = "from tests.kernels.test_decoder import check_lower_isa; check_lower_isa()"
    assert run_under_isa(isa, code, timeout=240) == expected


def test_real_model_greedy_matches_python_path(our_model: LlamaForCausalLM, gguf_path: str,
                                                prompt_ids: list[list[int]]) -> None:
    """The default GGUF read as stored (Q4_1 layers, Q8_0 embedding) greedily continues two
    prompts, batched and prefilled in chunks, exactly as the dense fp32 Python path does."""
    from backfill.model.cpu_decoder import load_cpu_decoder

    decoder = load_cpu_decoder(gguf_path)  # loader.load_stored_weights: the file's own blocks
    assert decoder.config == our_model.config
    prompts = prompt_ids[:2]  # the chat prompt (two chunks) and a plain one
    expected = PagedDriver(our_model).greedy(prompts, max_new_tokens=16, chunk=24)
    got = PagedDriver(decoder).greedy(prompts, max_new_tokens=16, chunk=24)
    assert got == expected


def test_from_prepacked_model() -> None:
    """from_dense reads a model whose linears were prepacked for oneDNN (weights and q/k/v bias
    held as attributes, the LM head moved to packed_lm_head)."""
    from backfill.model.prepack import prepack_supported

    if not prepack_supported(torch.float32, torch.device("cpu")):
        pytest.skip("no oneDNN prepacking in this torch build")
    model = tiny_model("qwen2_bias_hd64", tie_word_embeddings=False)
    reference = CpuDecoder.from_dense(model)
    model.prepack_weights()
    batches = token_batches(101, seed=7)
    got = PagedDriver(CpuDecoder.from_dense(model), num_blocks=48, block_size=8, seed=1)
    expected = PagedDriver(reference, num_blocks=48, block_size=8, seed=1)
    for batch in batches:
        assert torch.equal(got.step(batch), expected.step(batch))


def test_drops_into_the_model_runner() -> None:
    """The ModelRunner's contract (model(...) -> hidden, compute_logits, config, fp32 KV caches):
    swapping CpuDecoder in for the model gives the same greedy tokens through the whole engine,
    chunked prefill and a mixed batch included."""
    from backfill.engine.llm import LLM
    from backfill.model.cpu_decoder import load_cpu_decoder
    from backfill.sampling_params import SamplingParams

    llm = LLM(dtype="float32", max_num_seqs=4, max_num_batched_tokens=8, seed=0)
    runner = llm.engine.runner
    assert isinstance(runner.model, CpuDecoder)
    # the runner allocates the decoder's own layout: K [blocks, Hkv, D, bs], V [blocks, Hkv, bs, D]
    num_blocks, config = runner.kv_caches[0][0].shape[0], runner.model.config
    assert runner.model.kv_cache_shapes(num_blocks, runner.block_size) == (
        (num_blocks, config.num_kv_heads, config.head_dim, runner.block_size),
        (num_blocks, config.num_kv_heads, runner.block_size, config.head_dim))
    for k_cache, v_cache in runner.kv_caches:
        assert (tuple(k_cache.shape), tuple(v_cache.shape)) == runner.model.kv_cache_shapes(num_blocks, runner.block_size)
    prompts = ["The capital of France is", "def add(a, b):"]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    llm.engine.runner.model = load_cpu_decoder(None)  # type: ignore[assignment]
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_decode_only_steps_through_lists_match_the_batch_path(policy: str) -> None:
    """The ModelRunner runs a step of decodes only through CpuDecoder.decode (plain lists; plain
    greedy rows take their argmax there): through the whole engine, with every kind of request
    (greedy, seeded sampling, logprobs, penalties, min_tokens) beside chunked prompts, the tokens
    and logprobs equal those of the same steps through build_batch; static batches too, whose
    finished requests' slots run padding rows."""
    from backfill.engine.llm import LLM
    from backfill.sampling_params import SamplingParams

    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3,"]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0, logprobs=2, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0, repetition_penalty=1.3, min_tokens=3, max_tokens=9)]
    llm = LLM(max_num_seqs=4, max_num_batched_tokens=8, seed=0, policy=policy)
    runner = llm.engine.runner
    assert isinstance(runner.model, CpuDecoder)
    fast_steps = []
    execute_decodes = runner._execute_decodes

    def counted(scheduler_output, *args, **kwargs):  # type: ignore[no-untyped-def]
        fast_steps.append(len(scheduler_output.padding_seq_lens))
        return execute_decodes(scheduler_output, *args, **kwargs)

    runner._execute_decodes = counted  # type: ignore[method-assign]
    results = {}
    for fast in (True, False):
        runner.fast_decodes = fast
        fast_steps.clear()
        outputs = [llm.generate([p], q)[0] for p, q in zip(prompts, params)]
        outputs += llm.generate(prompts, params)  # all four at once, prompts in chunks beside decodes
        results[fast] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]
        assert (len(fast_steps) > 20) == fast, len(fast_steps)
        if fast and policy == "static":
            assert any(fast_steps), "no fast step ran padding rows"
    assert results[True] == results[False]
