"""The digit form of the Q4_0 / Q4_1 / Q4_K / Q8_0 products (backfill/kernels/csrc/digits.h): x on a 24-bit
fixed-point grid per 32-column block, exact integer sums, one rounding a block. Every kernel that
computes it (the portable one, AVX-512 VNNI, the AMX tile unit where the CPU has one) gives the
definition's bits, at every row count and thread count, so a process may switch kernels by row
count (AMX from a group of 16 rows) without breaking batch invariance.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from backfill.kernels import extension

sys.path.insert(0, os.path.dirname(__file__))
from test_qgemm import assert_fp32_accurate, random_raw, reference  # noqa: E402

ext = extension()
pytestmark = pytest.mark.skipif(ext is None, reason="CPU kernels extension unavailable (no compiler, or disabled)")

TYPES = {"Q4_0": 2, "Q4_1": 3, "Q4_K": 12, "Q8_0": 8}
# (a last tile of 5 rows; K of 13 blocks, Q4_K's 24 sub-blocks)
N, K = 101, 416
SHAPES = {"Q4_0": (N, K), "Q4_1": (N, K), "Q4_K": (N, 768), "Q8_0": (N, K)}
MS = [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 23, 24, 31, 32, 33, 40, 64, 65, 100, 350]
ISAS = ["scalar", "avx2", "avx512"]


@pytest.fixture
def digit_form() -> Iterator[None]:
    isa, before = ext.isa(), ext.digit_form()
    ext.set_digit_form(True)
    yield
    ext.set_digit_form(before)
    ext.set_isa(isa)


def use_isa(name: str) -> None:
    if not ext.set_isa(name):
        pytest.skip(f"this CPU cannot run the {name} kernels")


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fp32 fma through float64 (see test_qgemm.fma32)."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def digit_definition(raw: torch.Tensor, qtype: int, x: torch.Tensor) -> np.ndarray:
    """digits.h's numbers written out from the GGUF blocks, in numpy."""
    n, k = raw.shape[0], x.shape[1]
    nb = k // 32
    blocks = raw.numpy().reshape(n, nb, -1)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, nb]
    if qtype == 8:  # int8 codes, no offset
        m = np.zeros_like(d)
        codes = blocks[:, :, 2:34].copy().view(np.int8).astype(np.int64)  # [N, nb, 32]
    else:
        if qtype == 3:
            m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            qs = blocks[:, :, 4:20]
        else:
            m = d * np.float32(-8.0)
            qs = blocks[:, :, 2:18]
        codes = np.concatenate([qs & 0xF, qs >> 4], axis=2).astype(np.int64)  # [N, nb, 32]
    xb = x.numpy().reshape(x.shape[0], nb, 32)
    max_bits = (xb.view(np.uint32) & 0x7FFFFFFF).max(axis=2)  # [M, nb]
    e = (max_bits >> 23).astype(np.int64) - 127
    bad = e > 110
    e = np.maximum(np.where(bad, 0, e), -99)
    u = np.ldexp(np.float32(1.0), (e - 22).astype(np.int32)).astype(np.float32)  # [M, nb]
    scale = np.ldexp(1.0, (22 - e).astype(np.int32))
    big = np.rint(xb.astype(np.float64) * scale[..., None]).astype(np.int64)  # round half to even
    big = np.minimum(big, 2**23 - 1)  # (2^23 saturates)
    big[bad] = 0
    c = np.einsum("mbk,nbk->mnb", big, codes)  # [M, N, nb], exact
    s = c.astype(np.float32) * u[:, None, :]  # rounded once, then scaled exactly
    xs = big.sum(axis=2).astype(np.float32) * u
    xs[bad] = np.nan
    y = np.zeros((x.shape[0], n), np.float32)
    for b in range(nb):
        y = fma32(s[:, :, b], d[None, :, b], y)
        if qtype != 8:
            y = fma32(xs[:, b, None], m[None, :, b], y)
    return y


def case(name: str, seed: int = 0) -> tuple[int, torch.Tensor, torch.Tensor]:
    qtype = TYPES[name]
    raw = random_raw(qtype, N, SHAPES[name][1], seed)
    return qtype, raw, ext.repack(raw, qtype, SHAPES[name][1])


def awkward_x(rows: int, seed: int, k: int = K) -> torch.Tensor:
    """Rows of every scale: normal, tiny (below 2^-99: the grid's floor), subnormal, zero blocks,
    huge (2^100), and mixed magnitudes within a block (values far below the grid's unit)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    x[1::7] *= 1e-35
    x[2::7] *= 2.0**100
    x[3::7, :32] = 0.0
    x[4::7, 64:96] = 1e-41  # subnormal
    x[5::7, 5] = 3e4  # one large value: the block's others fall to a coarse grid
    return x


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])  # (Q4_K: against the portable kernel, below)
def test_digit_form_is_its_definition(name: str, isa: str, digit_form: None) -> None:
    use_isa(isa)
    qtype, raw, packed = case(name, seed=3)
    x = awkward_x(40, seed=4)
    got = ext.qlinear(x, packed, qtype, N, K).numpy()
    want = digit_definition(raw, qtype, x)
    assert np.array_equal(got.view(np.int32), want.view(np.int32))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", TYPES)
def test_digit_form_accuracy_and_batch_invariance(name: str, isa: str, digit_form: None) -> None:
    use_isa(isa)
    qtype, raw, packed = case(name)
    k = SHAPES[name][1]
    x = torch.randn(max(MS), k, generator=torch.Generator().manual_seed(1))
    full = ext.qlinear(x, packed, qtype, N, k)
    assert_fp32_accurate(full, x, reference(raw, qtype))
    for m in MS:
        assert torch.equal(ext.qlinear(x[:m], packed, qtype, N, k), full[:m]), f"M={m}"
    for i in [0, 16, 17, max(MS) - 1]:  # a row alone, and among 20 others (an AMX group and 4 rows)
        assert torch.equal(ext.qlinear(x[i : i + 1], packed, qtype, N, k), full[i : i + 1])
        others = torch.randn(21, k)
        others[18] = x[i]
        assert torch.equal(ext.qlinear(others, packed, qtype, N, k)[18], full[i])


@pytest.mark.parametrize("name", TYPES)
def test_digit_form_isas_threads_bias_and_accumulate_agree(name: str, digit_form: None) -> None:
    qtype, _, packed = case(name, seed=2)
    k = SHAPES[name][1]
    x = awkward_x(37, seed=5, k=k)
    bias = torch.randn(N)
    results = {}
    for isa in ISAS:
        if not ext.set_isa(isa):
            continue
        ys = [ext.qlinear(x[:m], packed, qtype, N, k, bias=bias) for m in (1, 5, 16, 20, 37)]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            ys.append(ext.qlinear(x, packed, qtype, N, k, bias=bias))
        finally:
            torch.set_num_threads(threads)
        out = torch.randn(37, N, generator=torch.Generator().manual_seed(6))
        want = out + ext.qlinear(x, packed, qtype, N, k, bias=bias)
        ext.qlinear(x, packed, qtype, N, k, bias=bias, out=out, accumulate=True)
        ys.append(out)
        ys.append(want)
        results[isa] = ys
    first = next(iter(results.values()))
    for isa, ys in results.items():
        assert all(torch.equal(a, b) for a, b in zip(ys, first, strict=True)), isa
    assert torch.equal(first[-3], first[4]), "one thread"
    assert torch.equal(first[-2], first[-1]), "accumulate"


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0"])
def test_digit_form_turns_non_finite_blocks_into_nan(name: str, digit_form: None) -> None:
    """A block whose largest |x| is inf, NaN or 2^111 and up gives NaN (its sum would overflow the
    grid), as an overflowing fp32 sum would give inf or NaN; the other rows are untouched."""
    qtype, _, packed = case(name)
    x = torch.randn(20, K)
    clean = ext.qlinear(x, packed, qtype, N, K)
    for value in (float("inf"), float("nan"), 2.0**111):
        bad = x.clone()
        bad[3, 40] = value
        bad[17, 300] = -value
        y = ext.qlinear(bad, packed, qtype, N, K)
        assert torch.isnan(y[3]).all() and torch.isnan(y[17]).all()
        keep = [i for i in range(20) if i not in (3, 17)]
        assert torch.equal(y[keep], clean[keep])
    big = x.clone()
    big[3] = 2.0**110  # the largest exponent the grid takes
    assert torch.isfinite(ext.qlinear(big, packed, qtype, N, K)[3]).all()


def test_digit_form_does_not_change_other_types(digit_form: None) -> None:
    raw = random_raw(14, 37, 512, 0)  # Q6_K
    packed = ext.repack(raw, 14, 512)
    x = torch.randn(20, 512)
    y = ext.qlinear(x, packed, 14, 37, 512)
    ext.set_digit_form(False)
    assert torch.equal(ext.qlinear(x, packed, 14, 37, 512), y)


@pytest.mark.skipif(ext is None or not ext.amx(), reason="no AMX tile unit in this process")
def test_amx_rows_setting_never_changes_the_numbers() -> None:
    """BACKFILL_AMX_ROWS moves rows between the tile unit and the vector dots: same bits."""
    code = (
        "import sys, torch; sys.path.insert(0, 'tests/kernels'); from test_qgemm import random_raw;"
        "from backfill.kernels import extension; ext = extension(); raw = random_raw(3, 101, 416, 0);"
        "p = ext.repack(raw, 3, 416); x = torch.randn(45, 416, generator=torch.Generator().manual_seed(9));"
        "y = torch.cat([ext.qlinear(x[:m], p, 3, 101, 416) for m in (1, 9, 16, 45)]);"
        "import hashlib; print(ext.amx(), hashlib.sha256(y.numpy().tobytes()).hexdigest())"
    )
    outputs = []
    for rows in ("0", "1", "16"):
        env = {**os.environ, "BACKFILL_AMX_ROWS": rows, "BACKFILL_DIGITS": "1"}
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                                cwd=os.path.join(os.path.dirname(__file__), "..", ".."))
        outputs.append(result.stdout.split(maxsplit=1))
    assert [o[0] for o in outputs] == ["False", "True", "True"]
    assert outputs[0][1] == outputs[1][1] == outputs[2][1]


def test_digit_form_is_on_by_default_exactly_where_the_tile_unit_runs() -> None:
    """With no setting, a process computes Q4_0 / Q4_1 / Q4_K / Q8_0 in the digit form on the tile unit where the
    CPU and OS run AMX (as a process that asks for the form finds), and in the fp32 chains elsewhere."""
    code = "from backfill.kernels import extension; ext = extension(); print(ext.digit_form(), ext.amx())"
    env = {k: v for k, v in os.environ.items() if k not in ("BACKFILL_DIGITS", "BACKFILL_AMX_ROWS", "BACKFILL_ISA")}
    default = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()
    asked = subprocess.run([sys.executable, "-c", code], env={**env, "BACKFILL_DIGITS": "1"}, capture_output=True,
                           text=True, check=True).stdout.split()
    assert asked[0] == "True"
    assert default == (["True", "True"] if asked[1] == "True" else ["False", "False"])
