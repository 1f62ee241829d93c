"""PackedLinear (oneDNN-prepacked weights, CPU fp32) against F.linear, on both of its paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backfill.model.prepack import DENSE_MAX_ROWS, PackedLinear, prepack_linears, prepack_supported

pytestmark = pytest.mark.skipif(
    not prepack_supported(torch.float32, torch.device("cpu")), reason="torch built without oneDNN"
)


@pytest.mark.parametrize("bias", [False, True])
@torch.inference_mode()
def test_every_row_count_matches_f_linear(bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 40, generator=gen)  # [out, in]
    b = torch.randn(96, generator=gen) if bias else None
    packed = PackedLinear(weight, b)
    for rows in (*range(1, 2 * DENSE_MAX_ROWS + 2), 16, 33):  # both sides of the dense threshold
        x = torch.randn(rows, 40, generator=gen)
        torch.testing.assert_close(packed(x), F.linear(x, weight, b), atol=1e-5, rtol=1e-5)
    # a non-contiguous input (a column slice) on the packed path
    wide = torch.randn(16, 80, generator=gen)
    torch.testing.assert_close(packed(wide[:, :40]), F.linear(wide[:, :40], weight, b), atol=1e-5, rtol=1e-5)


def test_prepack_linears_replaces_nested_linears_only() -> None:
    net = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.ReLU(), nn.Linear(8, 4, bias=False)))
    with torch.inference_mode():
        x = torch.randn(5, 8)
        expected = net(x)
        assert prepack_linears(net) == 2
        assert isinstance(net[0], PackedLinear) and isinstance(net[1][1], PackedLinear)
        assert isinstance(net[1][0], nn.ReLU)
        torch.testing.assert_close(net(x), expected, atol=1e-5, rtol=1e-5)
