"""Weights as stored: linear and embedding matrices kept in their GGUF block formats.

A `QuantWeight` is a matrix [rows, cols] made of row segments, each a uint8 tensor of raw
ggml blocks ([segment_rows, row_bytes], the file's own bytes) and its ggml type. Fused
projections are several segments when their parts are stored in different types (a Q4_K_M
file keeps q/k in Q4_K and v in Q6_K): each segment is read by the kernel made for its type,
into its own output columns.

`dequantize()` is the reference: gguf's own numpy dequantizer, the numbers transformers sees
when it loads the same file. The fast path repacks the segments for the CPU kernels
(backfill/kernels) and never expands them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

# ggml type ids the CPU kernels read as stored (backfill/kernels/csrc/qtypes.h); any other type
# in a file (Q5_x, Q2_K/Q3_K/Q5_K, IQ*, BF16) is expanded to F32 at load time.
F32, F16, Q4_0, Q4_1, Q8_0, Q4_K, Q6_K = 0, 1, 2, 3, 8, 12, 14
KERNEL_TYPES: frozenset[int] = frozenset({F32, F16, Q4_0, Q4_1, Q8_0, Q4_K, Q6_K})


def type_name(qtype: int) -> str:
    from gguf.constants import GGMLQuantizationType

    return GGMLQuantizationType(qtype).name


def row_bytes(qtype: int, cols: int) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    if cols % block:
        raise ValueError(f"{cols} columns are not a whole number of {type_name(qtype)} blocks of {block}")
    return cols // block * size


@dataclass
class QuantSegment:
    raw: Tensor  # [rows, row_bytes] uint8, ggml blocks along each row
    qtype: int  # ggml type id

    @property
    def rows(self) -> int:
        return int(self.raw.shape[0])


@dataclass
class QuantWeight:
    """A [rows, cols] weight as stored: row segments stacked in order (see module docstring)."""

    segments: list[QuantSegment]
    cols: int

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.segments)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        return sum(s.raw.numel() for s in self.segments)

    def dequantize(self) -> Tensor:
        """[rows, cols] float32, computed by gguf's reference dequantizer."""
        return torch.cat([dequantize_raw(s.raw, s.qtype).reshape(-1, self.cols) for s in self.segments], dim=0)


def dequantize_raw(raw: Tensor | np.ndarray, qtype: int) -> Tensor:
    """Raw ggml data [..., row_bytes] (uint8, or the float dtype for F32/F16) -> fp32 [..., cols]."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    array = raw.numpy() if isinstance(raw, Tensor) else raw
    if qtype in (F32, F16) and array.dtype == np.uint8:
        array = array.view(np.float32 if qtype == F32 else np.float16)
    out = dequantize(array, GGMLQuantizationType(qtype))
    if not out.flags.writeable:
        out = out.copy()
    return torch.from_numpy(out.astype(np.float32, copy=False))


def as_raw_rows(array: np.ndarray, qtype: int) -> Tensor:
    """A GGUF tensor's array ([rows, row_bytes] uint8, or [rows, cols] f32/f16) as uint8 rows
    (zero-copy where the array allows it)."""
    if array.dtype != np.uint8:
        array = array.view(np.uint8)
    array = np.ascontiguousarray(array).reshape(array.shape[0], -1)
    with warnings.catch_warnings():  # a view of the read-only file map: nothing writes to it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def quantize_dense(weight: Tensor, qtype: int) -> QuantSegment:
    """A dense [rows, cols] weight in `qtype` (F32, F16 or Q8_0: the weight-only
    `quantization` options for Hugging Face folders), via gguf's reference quantizer."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize

    array = weight.detach().to(torch.float32).contiguous().numpy()
    if qtype == F32:
        data = array
    else:
        data = quantize(array, GGMLQuantizationType(qtype))
    return QuantSegment(as_raw_rows(data, qtype), qtype)


def merge_segments(parts: list[QuantSegment]) -> list[QuantSegment]:
    """Adjacent segments of one type become one (one kernel call instead of several)."""
    merged: list[QuantSegment] = []
    for part in parts:
        if merged and merged[-1].qtype == part.qtype:
            merged[-1] = QuantSegment(torch.cat([merged[-1].raw, part.raw], dim=0), part.qtype)
        else:
            merged.append(part)
    return merged
