"""CPU weight prepacking: linear layers whose weights sit in oneDNN's blocked layout.

A plain fp32 `F.linear` on CPU repacks its weight panels on every call. At decode sizes
(a few to a few dozen rows) that repacking costs as much as the arithmetic, and some row
counts fall on slow kernels: on a 2-core AVX-512 Xeon the 49,152 x 576 LM head took 15 ms
for 11 rows and 7.5 ms for 16. Reordering each weight once at load time into the layout the
oneDNN inner-product kernel reads (`mkldnn._reorder_linear_weight`) and calling that kernel
directly (`mkldnn._linear_pointwise`) makes the step's linear layers cost nearly the same for
5 or 16 rows, which is what continuous batching needs: a wide step must stay cheap.

The layout does not depend on the row count (`PACK_BATCH_HINT` only guides oneDNN's choice of
blocking), so one packed copy serves every batch shape. Only fp32 on CPU is packed: that is
the kernel measured here; GPUs and other dtypes keep `nn.Linear`.

The dense weight is kept too, for steps of at most `DENSE_MAX_ROWS` rows: there `F.linear`
takes a matrix-vector path that beats oneDNN (whose call also costs ~15 us more), and a
single-request decode step was 18% slower on packed weights alone. The price is a second copy
of the linear weights (420 MB for the default model; a tied LM head shares the embedding's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Rows oneDNN is told to expect when it picks the weight blocking (any row count works).
PACK_BATCH_HINT = 16
# Up to this many rows, the dense weight and F.linear are faster (measured per layer shape of
# SmolLM2-135M, weights out of cache: F.linear wins at 1-3 rows and loses by 1.5x at 4).
DENSE_MAX_ROWS = 3
# The op overload itself: skips resolving the overload packet on each of ~120 calls a step.
_LINEAR_POINTWISE = torch.ops.mkldnn._linear_pointwise.default if torch.backends.mkldnn.is_available() else None


def prepack_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `PackedLinear` applies: fp32 on a CPU build of torch with oneDNN."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W held in oneDNN's blocked layout (CPU, fp32, 2-D inputs), and
    dense for calls of at most DENSE_MAX_ROWS rows.

    NOTE: the packed weight is a plain attribute, not a parameter or buffer: an mkldnn tensor
    cannot be moved, copied into a state dict or viewed. The module is inference-only.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        # weight: [out, in] (kept, dense) and its copy in oneDNN's blocked layout (opaque); bias: [out] or None
        self.out_features, self.in_features = weight.shape
        self.weight = weight.detach()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.contiguous(), PACK_BATCH_HINT)
        self.bias = None if bias is None else bias.detach().contiguous()

    def forward(self, x: Tensor) -> Tensor:
        # x: [T, in] -> [T, out]
        if x.shape[0] <= DENSE_MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
        return _LINEAR_POINTWISE(x.contiguous(), self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def prepack_linears(module: nn.Module) -> int:
    """Replace every `nn.Linear` under `module` by a `PackedLinear` of the same weights.

    The dense weights are released once no one else holds them. Returns how many were packed.
    """
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child.weight, child.bias))
            count += 1
        else:
            count += prepack_linears(child)
    return count
