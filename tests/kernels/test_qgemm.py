"""The packed linear kernels (backfill/kernels/csrc) against their references.

For every weight type: the packed layout dequantizes bit-exactly to gguf's numbers; qlinear
matches a float64 matmul at fp32-accumulation accuracy; and y[i, n] is bit-identical whatever
the batch (M, the other rows), the thread count and the ISA (scalar, AVX2, AVX-512: every ISA
this CPU runs, switched at run time).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from backfill.kernels import extension

ext = extension()
pytestmark = pytest.mark.skipif(ext is None, reason="CPU kernels extension unavailable (no compiler, or disabled)")

TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}
# [N, K] per type: N not a multiple of 16; K spans several blocks and more than one column chunk
# of the panel kernel (192 / 256 columns).
# (the nibble types: 7 tiles, so one row runs a group of 4 tiles and one of 3 on AVX2, 6 and 1 on AVX-512)
SHAPES = {"F32": (37, 300), "F16": (37, 300), "Q4_0": (101, 416), "Q4_1": (101, 416), "Q8_0": (37, 416),
          "Q4_K": (101, 768), "Q6_K": (37, 768)}
MS = [1, 2, 3, 5, 7, 8, 9, 16, 17, 24, 32, 33, 64, 65, 100, 350]  # fused groups of <= 6 rows from 5 (AVX2; the panels past 64, fewer for the k-quants), of <= 16 from 17 (AVX-512); 350: several row chunks at K >= 416
ISAS = ["scalar", "avx2", "avx512"]


def random_raw(qtype: int, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Random GGUF rows, uint8 [rows, row_bytes]: random code bytes, finite fp16 scales of both
    signs (a few zero or subnormal), random 6-bit / int8 k-quant scales."""
    rng = np.random.default_rng(seed)
    if qtype == 0:
        return torch.from_numpy(rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint8))
    if qtype == 1:
        return torch.from_numpy(rng.standard_normal((rows, cols)).astype(np.float16).view(np.uint8))
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)  # [rows, blocks, bytes]

    def set_half(offset: int, scale: float) -> None:
        v = rng.uniform(0.1, 1.0, raw.shape[:2]) * scale * rng.choice([-1.0, 1.0], raw.shape[:2])
        v[rng.random(raw.shape[:2]) < 0.05] = 3e-6  # fp16 subnormal
        v[rng.random(raw.shape[:2]) < 0.02] = 0.0
        raw[:, :, offset : offset + 2] = v.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)

    offsets = {2: [0], 3: [0, 2], 8: [0], 12: [0, 2], 14: [208]}[qtype]
    for offset in offsets:
        set_half(offset, 0.05)
    return torch.from_numpy(raw.reshape(rows, -1))


def reference(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """gguf's own dequantization, fp32 [rows, cols]."""
    data = raw.numpy()
    if qtype in (0, 1):
        data = data.view(np.float32 if qtype == 0 else np.float16)
    return torch.from_numpy(dequantize(data, GGMLQuantizationType(qtype)).astype(np.float32))


@pytest.fixture
def restore_isa() -> Iterator[None]:
    before = ext.isa()
    yield
    ext.set_isa(before)


@pytest.fixture
def restore_subnormal() -> Iterator[None]:
    before = ext.subnormal_codes()
    yield
    ext.set_subnormal_codes(before)


@pytest.fixture
def fp32_chains() -> Iterator[None]:
    """The Q4_0 / Q4_1 / Q4_K / Q8_0 products as TileJob's fp32 chains, not in the digit form (digits.h), which
    is on by default where the CPU has AMX."""
    before = ext.digit_form()
    ext.set_digit_form(False)
    yield
    ext.set_digit_form(before)


def use_isa(name: str) -> None:
    if not ext.set_isa(name):
        pytest.skip(f"this CPU cannot run the {name} kernels")


def packed_case(name: str, seed: int = 0) -> tuple[int, int, int, torch.Tensor, torch.Tensor]:
    qtype = TYPES[name]
    n, k = SHAPES[name]
    raw = random_raw(qtype, n, k, seed)
    return qtype, n, k, raw, ext.repack(raw, qtype, k)


def assert_fp32_accurate(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """|y - x @ w^T| <= K u sum_k |x| |w| (u = 2^-24): the bound of any fp32 summation order."""
    y64 = x.double() @ w.double().T
    bound = (x.double().abs() @ w.double().abs().T) * x.shape[1] * 2.0**-24
    excess = (y.double() - y64).abs() - bound
    assert excess.max().item() <= 0.0, f"error exceeds the fp32 bound by {excess.max().item():.3g}"


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_packed_is_bit_exact(name: str) -> None:
    qtype, n, k, raw, packed = packed_case(name)
    ref = reference(raw, qtype)
    got = ext.dequantize_packed(packed, qtype, n, k)  # [N, K]
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
    assert torch.equal(ext.dequantize(raw, qtype, k).view(torch.int32), ref.view(torch.int32))
    ids = torch.tensor([n - 1, 0, 17, 17, 5])
    assert torch.equal(ext.dequantize_packed(packed, qtype, n, k, ids).view(torch.int32), ref[ids].view(torch.int32))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", TYPES)
def test_qlinear_accuracy_and_batch_invariance(name: str, isa: str, restore_isa: None) -> None:
    use_isa(isa)
    qtype, n, k, raw, packed = packed_case(name)
    w = reference(raw, qtype)
    x = torch.randn(max(MS), k, generator=torch.Generator().manual_seed(1))  # [M, K]
    full = ext.qlinear(x, packed, qtype, n, k)  # [M, N]
    assert_fp32_accurate(full, x, w)
    for m in MS:  # the first m rows alone: the same bits
        assert torch.equal(ext.qlinear(x[:m], packed, qtype, n, k), full[:m]), f"M={m}"
    for i in [0, 7, max(MS) - 1]:  # one row alone, and among other rows
        assert torch.equal(ext.qlinear(x[i : i + 1], packed, qtype, n, k), full[i : i + 1])
        others = torch.randn(5, k)
        others[3] = x[i]
        assert torch.equal(ext.qlinear(others, packed, qtype, n, k)[3], full[i])


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fp32 fma(a, b, c) through float64: a * b is exact there, and its sum with c rounds twice
    (to 53 bits, then 24), which differs from one rounding only where the first lands on an fp32
    tie: fixed data, so a fixed outcome."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def block_sum(x: np.ndarray) -> np.ndarray:
    """X_b of every row: x [rows, 32] summed as block_sum (packed.h) does (lanes l + l+16, then + l+8, ..)."""
    s = x[:, :16] + x[:, 16:]
    for h in (8, 4, 2, 1):
        s = s[:, :h] + s[:, h : 2 * h]
    return s[:, 0]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", ["Q4_1", "Q8_0"])
def test_block_types_compute_the_factored_sum(name: str, isa: str, restore_isa: None, fp32_chains: None) -> None:
    """TileJob's definition, written out from the GGUF blocks: y = fma(S_b, d_b, y), then
    y = fma(X_b, m_b, y) over the blocks, S_b the fma chain of x * code over the block (Q8_0's
    codes q + 128, its offset -128 d). (Q4_1 where the digit form is off: test_digits.py has
    that form's definition.)"""
    use_isa(isa)
    qtype, n, k, raw, packed = packed_case(name, seed=5)
    blocks = raw.numpy().reshape(n, k // 32, -1)  # [N, blocks, bytes]
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, blocks]
    if name == "Q4_1":
        m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[:, :, 4:20]
        codes = np.concatenate([qs & 0xF, qs >> 4], axis=2).astype(np.float32)  # [N, blocks, 32]
    else:  # the packed tiles hold q + 128 and each block the offset -128 d (packed.h: byte words)
        m = d * -128.0
        codes = blocks[:, :, 2:34].copy().view(np.int8).astype(np.float32) + 128.0
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(6))
    xn = x.numpy().reshape(3, k // 32, 32)
    want = np.zeros((3, n), np.float32)
    for b in range(k // 32):
        s = np.zeros((3, n), np.float32)
        for j in range(32):
            s = fma32(xn[:, b, j : j + 1], codes[None, :, b, j], s)
        want = fma32(s, d[None, :, b], want)
        want = fma32(block_sum(xn[:, b])[:, None], m[None, :, b], want)
    got = ext.qlinear(x, packed, qtype, n, k).numpy()
    assert np.array_equal(got.view(np.int32), want.view(np.int32))


@pytest.mark.parametrize("name", TYPES)
def test_isas_are_bit_identical(name: str, restore_isa: None) -> None:
    qtype, n, k, _, packed = packed_case(name, seed=2)
    x = torch.randn(33, k)
    bias = torch.randn(n)
    results = {}
    for isa in ISAS:
        if ext.set_isa(isa):
            results[isa] = [ext.qlinear(x[:m], packed, qtype, n, k, bias=bias) for m in (1, 5, 20, 33)]
    assert len(results) >= 1
    first = next(iter(results.values()))
    for isa, ys in results.items():
        assert all(torch.equal(a, b) for a, b in zip(ys, first)), isa


@pytest.mark.parametrize("subnormal", [False, True])
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q8_0"])
def test_scaled_code_types_agree_on_tiny_x(name: str, subnormal: bool, restore_isa: None, restore_subnormal: None) -> None:
    """The 4-bit types and Q6_K read column k's code as q 2^4c and scale x[k] by 2^-4c, Q8_0 its
    byte words' u 2^8c and x[k] by 2^-8c (packed.h: scaled_codes, code_x_scale): exact for normal
    x, and where x[k]'s scaled value leaves fp32's normal range (|x| < 2^-102) every ISA and every
    path (fused, halves, panels) rounds it alike. The same for the subnormal form (products
    x q 2^-85, below fp32's normal range for these rows): every ISA rounds them alike."""
    ext.set_subnormal_codes(subnormal)
    qtype, n, k, _, packed = packed_case(name, seed=3)
    x = torch.randn(33, k, generator=torch.Generator().manual_seed(4))
    x[0] *= 1e-32  # whole rows this small: x 2^-20 and x 2^-24 are subnormal, and their products
    x[3] *= 1e-34  # are the rows' whole sums (no larger term to hide the bits they lost)
    x[5:, 6::8] = 3e-38  # c = 6 in rows among normal ones
    results = {}
    for isa in ISAS:
        if ext.set_isa(isa):
            full = ext.qlinear(x, packed, qtype, n, k)
            results[isa] = full
            for m in (1, 5, 20):
                assert torch.equal(ext.qlinear(x[:m], packed, qtype, n, k), full[:m]), (isa, m)
    first = next(iter(results.values()))
    for isa, y in results.items():
        assert torch.equal(y, first), isa


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q8_0"])
def test_subnormal_form_gives_the_nibble_forms_bits(name: str, restore_isa: None, restore_subnormal: None) -> None:
    """The 4-bit types', Q6_K's and Q8_0's codes read as subnormal floats (packed.h: no int ->
    float conversion; x scaled by 2^(64 - s_c), d by 2^85) give the scaled codes' bits for every
    row whose products and code sums stay above 2^-41 (normal x: all of them), on every ISA and
    at every M."""
    qtype, n, k, raw, packed = packed_case(name, seed=6)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(7)) * 3.0
    x[4] *= 1e6  # large rows too (|x| < 2^64)
    x[9] *= 1e-6
    w = reference(raw, qtype)
    for isa in ISAS:
        if not ext.set_isa(isa):
            continue
        for m in (1, 2, 5, 16, 17, 40):
            ys = []
            for subnormal in (False, True):
                ext.set_subnormal_codes(subnormal)
                ys.append(ext.qlinear(x[:m], packed, qtype, n, k))
            assert torch.equal(ys[0], ys[1]), (isa, m)
            assert_fp32_accurate(ys[1], x[:m], w)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="MXCSR's DAZ bit: x86 only")
def test_subnormal_form_steps_aside_when_denormals_are_zero(restore_isa: None, restore_subnormal: None) -> None:
    """torch.set_flush_denormal(True) sets MXCSR.DAZ, which reads every subnormal input as 0: the
    kernels check it per job and take the nibble form instead (one thread: the job runs in the
    thread whose MXCSR was set)."""
    qtype, n, k, _, packed = packed_case("Q4_1", seed=8)
    x = torch.randn(3, k)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for isa in ISAS:
            if not ext.set_isa(isa):
                continue
            ext.set_subnormal_codes(False)
            want = ext.qlinear(x, packed, qtype, n, k)
            ext.set_subnormal_codes(True)
            assert torch.set_flush_denormal(True)
            try:
                got = ext.qlinear(x, packed, qtype, n, k)
            finally:
                torch.set_flush_denormal(False)
            assert torch.equal(got, want), isa
    finally:
        torch.set_num_threads(threads)


def test_subnormal_form_env_decides() -> None:
    code = "from backfill.kernels import extension; print(extension().subnormal_codes())"
    for value, want in (("0", "False"), ("1", "True")):
        env = dict(os.environ, BACKFILL_SUBNORMAL_CODES=value)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want


@pytest.mark.parametrize("name", ["F32", "Q4_1", "Q8_0", "Q4_K"])
def test_thread_count_invariance(name: str) -> None:
    qtype = TYPES[name]
    n, k = 301, SHAPES[name][1]
    raw = random_raw(qtype, n, k, seed=3)
    packed = ext.repack(raw, qtype, k)
    x = torch.randn(40, k)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [ext.qlinear(x[:m], packed, qtype, n, k) for m in (1, 4, 40)]
        torch.set_num_threads(max(2, threads))
        many = [ext.qlinear(x[:m], packed, qtype, n, k) for m in (1, 4, 40)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, many))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", ["F32", "F16", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_bias_strided_out_and_accumulate(name: str, isa: str, restore_isa: None) -> None:
    use_isa(isa)
    qtype, n, k, _, packed = packed_case(name, seed=4)
    for m in (1, 6, 20):
        x_big = torch.randn(m, k + 7)  # x rows with a stride > K
        x = x_big[:, 3 : 3 + k]
        bias = torch.randn(n)
        plain = ext.qlinear(x.contiguous(), packed, qtype, n, k)
        with_bias = ext.qlinear(x, packed, qtype, n, k, bias=bias)
        assert torch.equal(with_bias, plain + bias)  # one fp32 add, the same in every kernel
        out_big = torch.randn(m, n + 9)
        before = out_big.clone()
        out = out_big[:, 5 : 5 + n]
        ext.qlinear(x, packed, qtype, n, k, bias=bias, out=out, accumulate=True)
        assert torch.equal(out, before[:, 5 : 5 + n] + with_bias)
        assert torch.equal(out_big[:, :5], before[:, :5]) and torch.equal(out_big[:, 5 + n :], before[:, 5 + n :])
        ext.qlinear(x, packed, qtype, n, k, out=out)
        assert torch.equal(out, plain)


def test_bad_arguments_are_refused() -> None:
    qtype, n, k, raw, packed = packed_case("Q4_1")
    with pytest.raises(RuntimeError):
        ext.qlinear(torch.randn(2, k), packed[:-1].contiguous(), qtype, n, k)
    with pytest.raises(RuntimeError):
        ext.qlinear(torch.randn(2, k + 1), packed, qtype, n, k)
    with pytest.raises(RuntimeError):
        ext.repack(raw, qtype, k + 32)
    assert not ext.set_isa("avx1024")


def test_backfill_isa_env_lowers_the_choice() -> None:
    code = "from backfill.kernels import extension; print(extension().isa())"
    env = dict(os.environ, BACKFILL_ISA="scalar")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "scalar"


def test_default_model_tensors(restore_isa: None) -> None:
    """A Q4_1 matrix and the Q8_0 embedding / LM head of the default model, as shipped."""
    try:
        from backfill.model.loader import _GGUFFile
        from backfill.model_files import default_model_path

        f = _GGUFFile(default_model_path())
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    tensors = {t.name: t for t in f.tensors}
    for name in ["blk.0.ffn_down.weight", "token_embd.weight"]:
        info = tensors[name]
        k, n = info.dims
        raw = torch.from_numpy(np.array(f.tensor_data(info)))  # uint8 [N, row_bytes]
        packed = ext.repack(raw, info.ggml_type, k)
        ids = torch.randint(0, n, (300,), generator=torch.Generator().manual_seed(5))
        ids[0] = n - 1
        w = reference(raw[ids], info.ggml_type)  # [300, K]
        rows = ext.dequantize_packed(packed, info.ggml_type, n, k, ids)
        assert torch.equal(rows.view(torch.int32), w.view(torch.int32))
        x = torch.randn(7, k)
        results = []
        for isa in ISAS:
            if ext.set_isa(isa) and (isa != "scalar" or n < 10_000):
                y = ext.qlinear(x, packed, info.ggml_type, n, k)  # [7, N]
                assert_fp32_accurate(y[:, ids], x, w)
                assert torch.equal(ext.qlinear(x[2:3], packed, info.ggml_type, n, k), y[2:3])
                results.append(y)
        assert all(torch.equal(r, results[0]) for r in results)
