"""Where the float64 oracle computes: `--oracle-device auto|cpu|cuda[:N]`.

auto: the run's GPU when the oracle's float64 weights fit there next to the
engine's (what the GPU has free now, less the engine's weights in the run
dtype and a reserve for activations, K/V and the kernels' workspace), else
the CPU with every core. float64 on the GPU is still float64: the oracle's
arithmetic and code are the same, only where they run changes.


Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

import torch

from harness.engine.settings import RunSettings, UsageError

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
    need = weight_numel(weights) * 8 + engine_bytes_to_come(weights, s.device, s.torch_dtype) + RESERVE_BYTES
    free, _ = torch.cuda.mem_get_info(torch.device(s.device))   # the weights placed there already count in it
    return s.device if need <= free * (1 - RESERVE_FRACTION) else "cpu"


def on_device(t: torch.Tensor, device: torch.device) -> bool:
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


def engine_bytes_to_come(weights: dict[str, torch.Tensor], device: str, dtype: torch.dtype) -> int:
    """What the engine's weights will still add on `device`: nothing for a
    tensor already there in the run's dtype (the engine keeps it as it is),
    a copy in the run's dtype for any other."""
    dev = torch.device(device)
    return sum(t.numel() * dtype.itemsize for t in weights.values() if not (on_device(t, dev) and t.dtype == dtype))


def place_weights(weights: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    """The engine's tensors on the run's device, in the checkpoint's dtype,
    one tensor at a time: the finiteness and agreement checks then run where
    the engine computes (a bf16 8B checkpoint: seconds on the GPU, not a
    minute of host passes), and the engine takes them without a second copy.
    Consumes `weights` off the CPU (each host tensor is let go once moved)."""
    if device == "cpu":
        return weights
    return {name: weights.pop(name).to(device) for name in list(weights)}
