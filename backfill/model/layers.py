"""Building blocks of the decoder: RMSNorm, rotary embeddings, the SwiGLU MLP.

Every function here works on the flattened token dimension `T` (all tokens of a step), so the
caller runs each one once per layer for the whole batch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backfill.model.config import ModelConfig


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, statistics in fp32 (F.rms_norm upcasts half types)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))  # [hidden]
        self.eps = eps
        self.normalized_shape = (hidden_size,)

    def forward(self, x: Tensor) -> Tensor:
        # x: [T, hidden] -> [T, hidden]
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        # rows [0, I) are gate_proj, rows [I, 2I) are up_proj
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        # x: [T, hidden] -> [T, hidden]
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate]
        gate = gate_up[:, : self.intermediate_size]  # [T, intermediate] (view)
        up = gate_up[:, self.intermediate_size :]  # [T, intermediate] (view)
        return self.down_proj(F.silu(gate) * up)  # [T, hidden]


def compute_inv_freq(config: ModelConfig) -> Tensor:
    """Inverse rotary frequencies [head_dim // 2] in fp32, after any RoPE scaling.

    Mirrors transformers' `_compute_default_rope_parameters`, `_compute_linear_...` and
    `_compute_llama3_parameters` step by step so fp32 results agree bit for bit.
    """
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim  # [dim / 2]
    inv_freq = 1.0 / (config.rope_theta**exponents)  # [dim / 2]
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "freq_factors":
        factors = torch.tensor(scaling["freq_factors"], dtype=torch.float32)  # [dim / 2]
        if factors.shape != inv_freq.shape:
            raise ValueError(f"freq_factors has shape {tuple(factors.shape)}, expected {tuple(inv_freq.shape)}")
        return inv_freq / factors
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq  # [dim / 2]
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)  # [dim / 2]
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled  # [dim / 2]
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)  # [dim / 2]
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"rope_scaling: unsupported rope_type {rope_type!r}")


class RotaryEmbedding(nn.Module):
    """Per-step cos/sin tables for the rotate-half RoPE layout (the Hugging Face one).

    Tables are computed from the step's positions once per forward (a handful of small ops)
    instead of caching `max_position_embeddings` rows: no memory that grows with the context.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self._inv_freq: Tensor | None = None  # [head_dim / 2] fp32, built lazily on the device

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [T] int64 -> (cos [T, 1, head_dim], signed_sin [T, 1, head_dim]).

        `signed_sin` is sin with its first half negated, so that
        rotate_half(x) * sin == roll(x, head_dim / 2) * signed_sin (see apply_rope).
        """
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            self._inv_freq = compute_inv_freq(self.config).to(positions.device)
        freqs = positions[:, None].to(torch.float32) * self._inv_freq[None, :]  # [T, D/2]
        cos = freqs.cos()  # [T, D/2]
        sin = freqs.sin()  # [T, D/2]
        cos_full = torch.cat((cos, cos), dim=-1).to(dtype)  # [T, D]
        signed_sin = torch.cat((-sin, sin), dim=-1).to(dtype)  # [T, D]
        return cos_full[:, None, :], signed_sin[:, None, :]


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Rotate-half RoPE: x * cos + rotate_half(x) * sin, in three kernels.

    x: [T, num_heads, head_dim] (any strides), cos/signed_sin: [T, 1, head_dim]
    -> new contiguous [T, num_heads, head_dim].
    """
    # rotate_half(x) = cat(-x2, x1); roll gives cat(x2, x1) and signed_sin carries the minus.
    rolled = x.roll(x.shape[-1] // 2, dims=-1)  # [T, n, D]
    return torch.addcmul(x * cos, rolled, signed_sin)  # [T, n, D]
