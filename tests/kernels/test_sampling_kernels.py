"""The sampler's kernels against their torch references: argmax_rows (greedy, on every ISA) and
inverse_cdf_sample (random rows)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from backfill.kernels import extension
from backfill.worker.sampler import inverse_cdf_sample

ext = extension()
pytestmark = pytest.mark.skipif(ext is None, reason="CPU kernels extension unavailable (no compiler, or disabled)")


@pytest.fixture(autouse=True)
def restore_isa() -> Iterator[None]:
    before = ext.isa()
    yield
    ext.set_isa(before)


def make_rows(kind: str, num_rows: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """[num_rows, vocab] float32 logits of one kind: plain, many ties, NaNs, -inf, signed zeros."""
    x = torch.randn(num_rows, vocab, generator=generator)  # [S, V]
    if kind == "ties":
        x = torch.randint(0, 3, (num_rows, vocab), generator=generator).float()
    elif kind == "nan":
        x[torch.rand(num_rows, vocab, generator=generator) < 0.01] = float("nan")
        x[0, -1] = float("nan")  # a row whose only NaN is in the tail
    elif kind == "neg_inf":  # rows masked everywhere (a grammar allowing nothing), one allowing one token
        x.fill_(float("-inf"))
        x[-1, vocab // 2] = 0.0
    elif kind == "signed_zeros":
        x = torch.where(torch.rand(num_rows, vocab, generator=generator) < 0.5, -0.0, 0.0)
    return x


@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
@pytest.mark.parametrize("kind", ["plain", "ties", "nan", "neg_inf", "signed_zeros"])
@pytest.mark.parametrize(("num_rows", "vocab"), [(1, 1), (3, 5), (2, 16), (4, 17), (5, 100), (33, 49152)])
def test_matches_torch_argmax(isa: str, kind: str, num_rows: int, vocab: int) -> None:
    if not ext.set_isa(isa):
        pytest.skip(f"this CPU cannot run the {isa} kernels")
    x = make_rows(kind, num_rows, vocab, torch.Generator().manual_seed(num_rows * vocab))
    assert torch.equal(ext.argmax_rows(x), x.argmax(dim=-1))
    if vocab > 1:  # a strided view
        assert torch.equal(ext.argmax_rows(x[:, 1:]), x[:, 1:].argmax(dim=-1))


def test_rejects_bad_input() -> None:
    with pytest.raises(RuntimeError):
        ext.argmax_rows(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError):
        ext.argmax_rows(torch.zeros(2, 0))


@pytest.mark.parametrize("vocab", [1, 5, 100, 49152])
@pytest.mark.parametrize("kind", ["plain", "truncated", "peaked", "nan"])
def test_inverse_cdf_sample_matches_reference(vocab: int, kind: str) -> None:
    generator = torch.Generator().manual_seed(vocab)
    for trial in range(20):
        logits = torch.randn(8, vocab, generator=generator) * (1 + trial)  # [S, V]
        probs = logits.softmax(dim=-1)  # [S, V]
        if kind == "truncated":  # min-p / top-k leave zeros, unnormalized
            probs.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * 0.2, 0.0)
        elif kind == "peaked":
            probs = (logits * 50).softmax(dim=-1)
        elif kind == "nan":
            probs[0] = float("nan")
        u = torch.rand((8, 1), dtype=torch.float64, generator=generator)  # [S, 1]
        u[0] = 0.0  # the whole mass: the last nonzero token
        assert torch.equal(ext.inverse_cdf_sample(probs, u), inverse_cdf_sample(probs, u))
        assert torch.equal(ext.inverse_cdf_sample(probs[:, :], u.view(-1)), inverse_cdf_sample(probs, u))
