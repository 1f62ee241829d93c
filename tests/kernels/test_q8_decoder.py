"""The fused decoder with int8 activations (CpuDecoder.activation_quantization = "int8"): a tiny
random model in 4-bit blocks keeps the guarantees the exact path has (batch, thread, team and
decode-from-lists invariance, bit for bit) and stays near the fp32 path's logits."""

from __future__ import annotations

import pytest
import torch

from backfill import kernels
from backfill.model.cpu_decoder import CpuDecoder, LinearWeights
from backfill.model.quant import QuantWeight
from tests.kernels.test_attention_cpu import run_under_isa
from tests.kernels.test_decoder import decode_step, quantize, tiny_model, token_batches
from tests.model.paged_driver import PagedDriver

pytestmark = pytest.mark.skipif(not kernels.available(), reason="CPU kernels extension unavailable")

Q4_0, Q4_1, Q8_0 = 2, 3, 8
SCHEDULE = [
    [("a", 13), ("b", 5), ("c", 20)],
    [("a", 1), ("b", 1), ("c", 10), ("d", 9)],
    [("d", 1), ("c", 1), ("a", 1), ("b", 1)],
    [("a", 1), ("e", 17), ("b", 1), ("c", 1), ("d", 1)],
]


def quantized_decoders(count: int, mode: str = "int8") -> tuple[list[CpuDecoder], int]:
    """`count` decoders of one tiny model, its linears and untied LM head Q4_1 / Q4_0 (gguf cannot
    write Q4_K: the kernel tests cover it), its embedding Q8_0, activations as `mode` says; and
    its vocab."""
    model = tiny_model("mqa_hd32_untied", intermediate_size=96)
    config = model.config
    state: dict[str, LinearWeights] = {}
    params = dict(model.named_parameters())
    for pname, qtype in [("embed_tokens.weight", Q8_0), ("lm_head.weight", Q4_1)] + [
        (f"layers.{i}.{name}", qtype) for i in range(config.num_layers)
        for name, qtype in [("self_attn.qkv_proj.weight", Q4_1), ("self_attn.o_proj.weight", Q4_1),
                            ("mlp.gate_up_proj.weight", Q4_1), ("mlp.down_proj.weight", Q4_0)]
    ]:
        segment, _ = quantize(params[pname].detach(), qtype)
        state[pname] = QuantWeight([segment], params[pname].shape[1])
    for pname, p in params.items():
        state.setdefault(pname, p.detach().clone())
    decoders = [CpuDecoder(config, state, activation_quantization=mode) for _ in range(count)]
    return decoders, config.vocab_size


def test_int8_is_near_fp32_and_not_the_same() -> None:
    (exact, approx), vocab = quantized_decoders(2, "none")
    approx.activation_quantization = "int8"
    assert approx.activation_quantization == "int8" and "+int8 x (" in approx.kernels and "int8" not in exact.kernels
    drivers = [PagedDriver(d, num_blocks=48, block_size=8, seed=1) for d in (exact, approx)]
    for i, batch in enumerate(token_batches(vocab, seed=2, schedule=SCHEDULE)):
        want, got = (driver.step(batch) for driver in drivers)
        assert not torch.equal(got, want), f"step {i}: int8 activations changed nothing"
        scale = want.abs().max()
        assert (got - want).abs().max() <= 0.05 * scale, f"step {i}"
    with pytest.raises(ValueError, match="activation_quantization"):
        approx.activation_quantization = "int4"


@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_int8_keeps_batch_team_and_decode_invariance(num_threads: int) -> None:
    """Sequence x's logits alone and among companions; each step through a team, row shards and
    forked operations; decode-from-lists against forward: the same bits."""
    (alone_dec, whole, sharded, forked, listed), vocab = quantized_decoders(5)
    whole.row_shards = forked.row_shards = 0
    sharded.row_shards = 1
    forked.team_steps = False
    gen = torch.Generator().manual_seed(5)
    x_tokens = torch.randint(0, vocab, (14,), generator=gen).tolist()
    x_steps = [x_tokens[:9]] + [[t] for t in x_tokens[9:]]

    def others(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(num_threads)
        alone_driver = PagedDriver(alone_dec, num_blocks=64, block_size=8, seed=2)
        alone = [alone_driver.step([("x", ids)])[0] for ids in x_steps]
        drivers = [PagedDriver(d, num_blocks=64, block_size=8, seed=3) for d in (whole, sharded, forked, listed)]
        companions = [[("y", others(9)), ("x", None)], [("y", others(1)), ("w", others(12)), ("x", None)],
                      [("x", None), ("w", others(1)), ("y", others(1))], [("y", others(1)), ("x", None)],
                      [("x", None), ("w", others(1)), ("y", others(1))], [("w", others(1)), ("x", None)]]
        for i, batch in enumerate(companions):
            rows = [(r, x_steps[i] if ids is None else ids) for r, ids in batch]
            results = [driver.step(rows) for driver in drivers[:3]]
            if all(len(ids) == 1 for _, ids in rows):  # a step of decodes: the lists path too
                logits, _ = decode_step(drivers[3], [(r, ids[0]) for r, ids in rows], greedy=False)
                results.append(logits)
            else:
                results.append(drivers[3].step(rows))
            for logits in results[1:]:
                assert torch.equal(logits, results[0]), f"step {i}"
            assert torch.equal(results[0][[r for r, _ in batch].index("x")], alone[i]), f"step {i}: x differs batched"
    finally:
        torch.set_num_threads(threads)


def check_int8_lower_isa() -> None:
    """Run by test_int8_lower_isa in a subprocess with BACKFILL_ISA set."""
    test_int8_is_near_fp32_and_not_the_same()
    test_int8_keeps_batch_team_and_decode_invariance(2)
    print(quantized_decoders(1)[0][0].kernels)


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_int8_lower_isa(isa: str) -> None:
    """The AVX2 and portable int8 kernels (an AVX2-only EPYC, an old CPU) keep the same guarantees."""
    code = "from tests.kernels.test_q8_decoder import check_int8_lower_isa; check_int8_lower_isa()"
    assert run_under_isa(isa, code, timeout=240).endswith(f"+int8 x ({isa})")
