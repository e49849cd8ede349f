"""The ranks' process group: joined through a rendezvous file (no port to
collide on), gloo on the CPU and NCCL on CUDA devices; the collectives the
sharded model needs, and leaving the group.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def rank_device(device: str, rank: int) -> str:
    """Rank r computes on cuda:r on a GPU run; the CPU is shared."""
    return f"cuda:{rank}" if device.startswith("cuda") else device


@dataclass(frozen=True)
class Group:
    """One rank's membership of the TP group."""

    rank: int
    size: int
    backend: str

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (a row-parallel layer's partial output). Gloo sums
        half-precision tensors in float32 and casts back; NCCL sums in the dtype, as SGLang does."""
        if self.backend == "gloo" and x.dtype in (torch.float16, torch.bfloat16):
            wide = x.float()
            dist.all_reduce(wide)
            return wide.to(x.dtype)
        x = x.contiguous()
        dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` concatenated along the last dimension, in rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=-1)

    def gather_objects(self, obj) -> list | None:
        """Every rank's `obj` on rank 0 (None on the others)."""
        out = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out


def join(rank: int, size: int, init_file: str, device: str, timeout_s: float) -> Group:
    backend = backend_for(device)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:   # the ranks share the host's cores: one thread each, or they contend with each other's collectives
        torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))
    return Group(rank, size, backend)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
