"""Which float64 oracle a run takes and where it computes:
`--oracle auto|dense|streamed` and `--oracle-device auto|cpu|cuda[:N]`.

`decide` plans both. The dense oracle holds the whole model in float64 (8
bytes a parameter: 560 GB for a 70B model); the streamed one holds one
decoder layer and a slice of the output projection at a time, reading them
from the checkpoint as it goes (slower per step, a fraction of the memory).
auto takes, in this order, the first that fits: the dense oracle on the
run's GPU, the streamed one there, the dense one in host memory, the
streamed one in host memory (and the streamed one on the CPU when nothing
fits: it holds least). The summary records the oracle and why.

auto: the run's GPU when the oracle's float64 weights fit there next to the
engine's (what the GPU has free now, less the engine's weights in the run
dtype and a reserve for activations, K/V and the kernels' workspace), else
the CPU with every core. float64 on the GPU is still float64: the oracle's
arithmetic and code are the same, only where they run changes.


Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from harness.engine.settings import RunSettings, UsageError

RESERVE_BYTES = 8 << 30   # activations, K/V pools, the float64 prefix cache, allocator slack
RESERVE_FRACTION = 0.10   # of the GPU's free memory
HOST_RESERVE_BYTES = 1 << 30   # the host's: activations, the prefix cache (the engine's weights are there already)


def weight_numel(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() for t in weights.values())


def choose_oracle_device(s: RunSettings, weights: dict[str, torch.Tensor]) -> str:
    """The device the dense oracle loads its float64 weights to (`decide` for --oracle dense)."""
    return decide(replace(s, oracle="dense"), weights).device


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


VOCAB_SLICE_ROWS = 32768   # output-projection rows the streamed oracle holds at once (reference/streamed.py)


@dataclass(frozen=True)
class OracleNeeds:
    """Bytes each oracle holds for a model, before activations (float64: 8 a parameter)."""

    dense: int      # every tensor
    streamed: int   # the largest decoder layer twice (one computed, the next read) plus one output-projection slice

    def __post_init__(self) -> None:
        if not 0 <= self.streamed <= self.dense:
            raise ValueError(f"the streamed oracle holds part of the dense one's bytes, got {self.streamed} "
                             f"of {self.dense}")

    def of(self, name: str) -> int:
        return self.dense if name == "dense" else self.streamed


@dataclass(frozen=True)
class OraclePlan:
    """The oracle a run loads (`name`, a `ddcheck.oracles` entry point), where it computes, and why."""

    name: str
    device: str
    reason: str

    def __post_init__(self) -> None:
        if self.name not in ("dense", "streamed"):
            raise ValueError(f"an oracle plan names dense or streamed, not {self.name!r}")
        if not self.reason:
            raise ValueError("an oracle plan says why it was chosen")


def needs_of(weights: dict[str, torch.Tensor]) -> OracleNeeds:
    """What each oracle holds for the engine's reading of the model (names as Hugging Face's)."""
    layers: dict[str, int] = {}
    for name, t in weights.items():
        if name.startswith("model.layers."):
            layer = name.split(".")[2]
            layers[layer] = layers.get(layer, 0) + t.numel()
    head = weights.get("lm_head.weight", weights.get("model.embed_tokens.weight"))
    head_slice = 0 if head is None else min(head.shape[0], VOCAB_SLICE_ROWS) * head[0].numel()
    streamed = min(weight_numel(weights), 2 * max(layers.values(), default=0) + head_slice)   # with prefetch
    return OracleNeeds(8 * weight_numel(weights), 8 * streamed)


def host_free_bytes() -> int:
    """Host memory available now (Linux's MemAvailable; free pages elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_oracle(asked: str, devices: list[str], needs: OracleNeeds, room: dict[str, int]) -> OraclePlan:
    """The plan for `--oracle asked` over candidate devices in order of
    preference (`room`: bytes each leaves the oracle's weights, reserves and
    the engine's weights still to come taken off); see the module doc.
    Every model the oracles read streams (multi-head latent attention and
    routed experts included: reference/streamed_mla.py)."""
    names = ["dense", "streamed"] if asked == "auto" else [asked]
    gib = 1 << 30
    for device in devices:
        for name in names:
            if needs.of(name) <= room[device]:
                return OraclePlan(name, device, f"{name}: {needs.of(name) / gib:.2f} GiB of float64 weights fit "
                                                f"{device} ({room[device] / gib:.1f} GiB of room)"
                                                + ("" if name == "dense" or asked != "auto" else
                                                   f"; the whole model's {needs.dense / gib:.2f} GiB do not"))
    name = "streamed" if asked == "auto" else asked
    return OraclePlan(name, devices[-1], f"{name}: {needs.of(name) / gib:.2f} GiB of float64 weights fit none of "
                                         f"{', '.join(devices)}; {devices[-1]} is the last resort"
                                         + (" (the streamed oracle holds least)" if name == "streamed" and asked == "auto" else ""))


def decide(s: RunSettings, weights: dict[str, torch.Tensor]) -> OraclePlan:
    """Which oracle the run loads and on which device (`--oracle`, `--oracle-device`)."""
    asked = s.oracle_device
    if asked.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--oracle-device {asked}: no CUDA device here")
    if asked != "auto" and s.oracle != "auto":
        return OraclePlan(s.oracle, asked, f"{s.oracle} on {asked}, as asked")
    devices = [asked] if asked != "auto" else ([s.device, "cpu"] if s.device.startswith("cuda") else ["cpu"])
    room = {}
    for device in devices:
        if device.startswith("cuda"):
            free, _ = torch.cuda.mem_get_info(torch.device(device))   # the weights placed there already count in it
            engine = engine_bytes_to_come(weights, s.device, s.torch_dtype) if device == s.device else 0
            room[device] = int(free * (1 - RESERVE_FRACTION)) - engine - RESERVE_BYTES
        else:
            room[device] = int(host_free_bytes() * (1 - RESERVE_FRACTION)) - HOST_RESERVE_BYTES
    return plan_oracle(s.oracle, devices, needs_of(weights), room)
