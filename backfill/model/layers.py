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
    if rope_type == "yarn":
        return _yarn_inv_freq(config, scaling)
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


def _yarn_factor(config: ModelConfig, scaling: dict) -> float:
    # DeepSeek-style configs leave `factor` out: the context extension ratio stands in.
    factor = scaling.get("factor")
    if factor is None:
        factor = config.max_position_embeddings / _yarn_original_len(config, scaling)
    return float(factor)


def _yarn_original_len(config: ModelConfig, scaling: dict) -> float:
    return float(scaling.get("original_max_position_embeddings") or config.max_position_embeddings)


def _yarn_inv_freq(config: ModelConfig, scaling: dict) -> Tensor:
    """YaRN (arXiv 2309.00071): interpolated frequencies for the long wavelengths, the original
    ones for the short, a linear ramp between; mirrors transformers' `_compute_yarn_parameters`."""
    dim, base = config.head_dim, config.rope_theta
    factor = _yarn_factor(config, scaling)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    original_len = _yarn_original_len(config, scaling)

    def correction_dim(num_rotations: float) -> float:
        # the dimension whose wavelength fits `num_rotations` times in the original context
        return (dim * math.log(original_len / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)  # [dim / 2]
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)  # [dim / 2]
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor cos and sin are multiplied by: 1.0 except for YaRN, whose attention
    temperature is 0.1 ln(factor) + 1 (or the config's `attention_factor` / mscale ratio)."""
    scaling = config.rope_scaling
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(config, scaling)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return float(mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"]))
    return mscale(factor)


class RotaryEmbedding(nn.Module):
    """Per-step cos/sin tables for the rotate-half RoPE layout (the Hugging Face one).

    Tables are computed from the step's positions once per forward (a handful of small ops)
    instead of caching `max_position_embeddings` rows: no memory that grows with the context.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self._inv_freq: Tensor | None = None  # [head_dim / 2] fp32, built lazily on the device
        self.attention_factor = rope_attention_factor(config)  # scales cos and sin (YaRN)

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
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
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
