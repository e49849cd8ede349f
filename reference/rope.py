"""RoPE inverse frequencies in float64, plain, with Llama 3.1's scaling, or YaRN's.

llama3 scaling, in wavelengths (wavelength = 2*pi / inv_freq), with
L = original_max_position:
  * wavelength < L / high_freq_factor (high frequencies): unchanged;
  * wavelength > L / low_freq_factor (low frequencies): inv_freq / factor;
  * between: a linear blend in s = (L / wavelength - low_freq_factor)
    / (high_freq_factor - low_freq_factor) of the two,
    (1 - s) * inv_freq / factor + s * inv_freq.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ddschema.config import RopeScaling

DTYPE = torch.float64


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> Tensor:
    """[head_dim / 2] float64 inverse frequencies, scaled when `scaling` is set."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=DTYPE) / head_dim))  # [d/2]
    if scaling is None:
        return inv_freq
    span = scaling.original_max_position
    scaled = []
    for f in inv_freq.tolist():
        wavelength = 2 * math.pi / f
        if wavelength < span / scaling.high_freq_factor:
            scaled.append(f)
        elif wavelength > span / scaling.low_freq_factor:
            scaled.append(f / scaling.factor)
        else:
            s = (span / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
            scaled.append((1 - s) * f / scaling.factor + s * f)
    return torch.tensor(scaled, dtype=DTYPE)  # [d/2]


# --- YaRN (DeepSeek-V3, Kimi K2) --------------------------------------------
# With d rotary dimensions, base theta and L = original_max_position:
#   * dim(r) = d * ln(L / (2 pi r)) / (2 ln theta), the rotary dimension that
#     turns r times over L; low = floor(dim(beta_fast)), high = ceil(dim(beta_slow)),
#     clamped to [0, d - 1] (a ramp of zero width is widened by 0.001);
#   * ramp(i) = clamp((i - low) / (high - low), 0, 1) for pair i = 0 .. d/2 - 1;
#   * inv_freq(i) = plain(i) / factor * ramp(i) + plain(i) * (1 - ramp(i)):
#     fast pairs (many turns) keep their frequency, slow ones are divided by factor;
#   * cos and sin are multiplied by mscale(factor, mscale) / mscale(factor, mscale_all_dim)
#     and the softmax scale by mscale(factor, mscale_all_dim)^2,
#     mscale(s, m) = 0.1 m ln(s) + 1 for s > 1, else 1 (DeepSeek's own modeling code).

def yarn_mscale(factor: float, m: float) -> float:
    """YaRN's magnitude correction 0.1 * m * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def yarn_inv_freq(rotary_dim: int, theta: float, scaling) -> Tensor:
    """[rotary_dim / 2] float64 YaRN inverse frequencies (`scaling`: a ddschema YarnScaling)."""
    plain = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=DTYPE) / rotary_dim))  # [d/2]

    def turns_dim(turns: float) -> float:
        return rotary_dim * math.log(scaling.original_max_position / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(turns_dim(scaling.beta_fast)), 0)
    high = min(math.ceil(turns_dim(scaling.beta_slow)), rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=DTYPE) - low) / (high - low)).clamp(0, 1)  # [d/2]
    return plain / scaling.factor * ramp + plain * (1 - ramp)


def yarn_cos_sin_scale(scaling) -> float:
    """What YaRN multiplies cos and sin by."""
    return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim)


def yarn_softmax_factor(scaling) -> float:
    """What YaRN multiplies the attention's softmax scale by (1 with no scaling)."""
    return 1.0 if scaling is None else yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2
