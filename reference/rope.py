"""RoPE inverse frequencies in float64, plain or with Llama 3.1's scaling.

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
