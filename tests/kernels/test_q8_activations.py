"""The opt-in int8-activation kernels (csrc/q8.h, `qlinear(..., q8_activations=True)`): the
numbers they define, the same on every ISA and batch, and the types they leave exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.kernels.test_qgemm import ISAS, TYPES, ext, fma32, packed_case, random_raw, reference, use_isa
from tests.kernels.test_qgemm import restore_isa  # noqa: F401, F811 (the fixture, used by name)

pytestmark = pytest.mark.skipif(ext is None, reason="CPU kernels extension unavailable (no compiler, or disabled)")

Q8_TYPES = ["Q4_0", "Q4_1", "Q4_K"]
MS = [1, 2, 3, 4, 5, 9, 33, 300]


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q8.h's quantization in torch: per 32-column block, scale = max|x| / 127 (fp32),
    q = round-half-even(x * (1 / scale)) clamped to +-127. Returns q [M, K] int32 (column order),
    scale [M, K/32] and s = scale * sum(q) [M, K/32], fp32."""
    m, k = x.shape
    xb = x.view(m, k // 32, 32)
    scale = xb.abs().amax(dim=-1) / torch.tensor(127.0)  # [M, nb]
    inv = torch.where(scale > 0, torch.tensor(1.0) / scale, torch.zeros(()))
    q = torch.round(xb * inv[..., None]).clamp(-127, 127).to(torch.int32)  # [M, nb, 32]
    s = scale * q.sum(dim=-1).to(torch.float32)
    return q.view(m, k), scale, s


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1"])
def test_the_defined_numbers(name: str, isa: str, restore_isa: None) -> None:
    """q8.h's definition written out from the GGUF blocks: per block the exact integer sum S of
    code * q, then y = fma(S, d_w * scale, y), y = fma(m_w, s, y) in block order."""
    use_isa(isa)
    qtype, n, k, raw, packed = packed_case(name, seed=7)
    blocks = raw.numpy().reshape(n, k // 32, -1)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, nb]
    qs = blocks[:, :, (4 if name == "Q4_1" else 2):][..., :16]
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=2).astype(np.int64)  # [N, nb, 32]
    m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if name == "Q4_1" else d * np.float32(-8)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(8))
    x[1] = 0.0  # an all-zero row: zero scales, zero sums
    x[2, :32] *= 1e-30  # a block of tiny values (its own scale)
    q, scale, s = (t.numpy() for t in quantize(x))
    qb = q.reshape(5, k // 32, 32).astype(np.int64)
    want = np.zeros((5, n), np.float32)
    for b in range(k // 32):
        sums = (qb[:, None, b, :] * codes[None, :, b, :]).sum(-1).astype(np.float32)  # [M, N], exact
        want = fma32(sums, (d[None, :, b] * scale[:, b, None]).astype(np.float32), want)
        want = fma32(m[None, :, b], s[:, b, None], want)
    got = ext.qlinear(x, packed, qtype, n, k, q8_activations=True).numpy()
    assert np.array_equal(got.view(np.int32), want.view(np.int32))
    assert not got[1].any()


@pytest.mark.parametrize("name", Q8_TYPES)
def test_close_to_the_quantized_product(name: str) -> None:
    """Against x's quantized values times the reference weights in float64: only fp32 rounding
    apart; and against fp32 x within what int8 loses (half a step of each block's scale)."""
    qtype, n, k, raw, packed = packed_case(name, seed=9)
    w = reference(raw, qtype).double()
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(10)) * 3
    q, scale, _ = quantize(x)
    xq = q.double().view(40, k // 32, 32) * scale.double()[..., None]  # [M, nb, 32]
    y = ext.qlinear(x, packed, qtype, n, k, q8_activations=True).double()
    want = xq.view(40, k) @ w.T
    bound = (xq.view(40, k).abs() @ w.abs().T) * (k + 64) * 2.0**-24
    assert ((y - want).abs() - bound).max().item() <= 0
    step = (scale.double() / 2).repeat_interleave(32, dim=1)  # [M, K]: |x - xq| <= scale / 2
    assert ((x.double() - xq.view(40, k)).abs() <= step * (1 + 1e-6)).all()
    assert ((y - x.double() @ w.T).abs() - step @ w.abs().T - bound).max().item() <= 0


@pytest.mark.parametrize("name", Q8_TYPES)
def test_isas_batches_and_threads_give_the_same_bits(name: str, restore_isa: None) -> None:
    qtype, n, k, _, packed = packed_case(name, seed=11)
    x = torch.randn(max(MS), k, generator=torch.Generator().manual_seed(12))
    bias = torch.randn(n)
    ref = None
    for isa in ISAS:
        if not ext.set_isa(isa):
            continue
        full = ext.qlinear(x, packed, qtype, n, k, bias=bias, q8_activations=True)
        ref = full if ref is None else ref
        assert torch.equal(full, ref), isa
        for m in MS:
            assert torch.equal(ext.qlinear(x[:m], packed, qtype, n, k, bias=bias, q8_activations=True), full[:m])
        others = torch.randn(6, k)
        others[4] = x[17]
        assert torch.equal(ext.qlinear(others, packed, qtype, n, k, bias=bias, q8_activations=True)[4], full[17])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ext.qlinear(x, packed, qtype, n, k, bias=bias, q8_activations=True)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, ref)


@pytest.mark.parametrize("isa", ISAS)
def test_accumulate_into_a_strided_out(isa: str, restore_isa: None) -> None:
    use_isa(isa)
    qtype, n, k, _, packed = packed_case("Q4_1", seed=13)
    x = torch.randn(7, k)
    plain = ext.qlinear(x, packed, qtype, n, k, q8_activations=True)
    base = torch.randn(7, n + 5)
    out = base.clone()[:, 2 : 2 + n]
    ext.qlinear(x, packed, qtype, n, k, out=out, accumulate=True, q8_activations=True)
    assert torch.equal(out, base[:, 2 : 2 + n] + plain)


@pytest.mark.parametrize("name", ["F32", "F16", "Q8_0", "Q6_K"])
def test_other_types_stay_exact(name: str) -> None:
    qtype, n, k, _, packed = packed_case(name, seed=14)
    x = torch.randn(9, k)
    assert torch.equal(ext.qlinear(x, packed, qtype, n, k, q8_activations=True), ext.qlinear(x, packed, qtype, n, k))


@pytest.mark.parametrize("isa", ISAS)
def test_non_finite_x_gives_non_finite_rows_only(isa: str, restore_isa: None) -> None:
    use_isa(isa)
    qtype = TYPES["Q4_1"]
    n, k = 20, 64
    packed = ext.repack(random_raw(qtype, n, k, seed=15), qtype, k)
    x = torch.randn(4, k)
    x[1, 40] = float("nan")
    x[2, 3] = float("inf")
    y = ext.qlinear(x, packed, qtype, n, k, q8_activations=True)
    assert torch.isfinite(y[0]).all() and torch.isfinite(y[3]).all()
    assert not torch.isfinite(y[1]).any() and not torch.isfinite(y[2]).any()


def test_q8_isa_names_the_kernels() -> None:
    assert ext.q8_isa() in ("avx512vnni", "avx2", "scalar")
