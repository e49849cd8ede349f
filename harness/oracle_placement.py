"""Where the float64 oracle computes: `--oracle-device auto|cpu|cuda[:N]`.

auto: the run's GPU when the oracle's float64 weights fit there next to the
engine's (what the GPU has free now, less the engine's weights in the run
dtype and a reserve for activations, K/V and the kernels' workspace), else
the CPU with every core. float64 on the GPU is still float64: the oracle's
arithmetic and code are the same, only where they run changes.
"""
from __future__ import annotations

import torch

from ddschema import ModelConfig
from harness.runner.settings import RunSettings, UsageError

RESERVE_BYTES = 8 << 30   # activations, K/V pools, the float64 prefix cache, allocator slack
RESERVE_FRACTION = 0.10   # of the GPU's free memory


def weight_numel(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() for t in weights.values())


def choose_oracle_device(s: RunSettings, weights: dict[str, torch.Tensor]) -> str:
    """The device the oracle loads its float64 weights to (see the module doc)."""
    asked = s.oracle_device
    if asked != "auto":
        if asked.startswith("cuda") and not torch.cuda.is_available():
            raise UsageError(f"--oracle-device {asked}: no CUDA device here")
        return asked
    if not s.device.startswith("cuda"):
        return "cpu"
    numel = weight_numel(weights)
    need = numel * 8 + numel * s.torch_dtype.itemsize + RESERVE_BYTES
    free, _ = torch.cuda.mem_get_info(torch.device(s.device))
    return s.device if need <= free * (1 - RESERVE_FRACTION) else "cpu"


def float64_gib(weights: dict[str, torch.Tensor]) -> float:
    return weight_numel(weights) * 8 / (1 << 30)
