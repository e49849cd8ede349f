"""The model's own swappable stages (Pipeline.model_stages): where a verify
row's latent is rotated and written, and which row's hidden state the MoE
routes for each row. The defaults are the correct ones; a fault swaps one.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


def row_positions(positions: torch.Tensor, meta) -> torch.Tensor:
    """The latent's RoPE key is rotated at the row's own position (prefix + depth)."""
    return positions


def row_slots(out_cache_loc: torch.Tensor, meta) -> torch.Tensor:
    """Each row's latent goes to its own out_cache_loc slot."""
    return out_cache_loc


def own_rows(positions: torch.Tensor, meta) -> torch.Tensor:
    """Each row routes its own hidden state  # [T]."""
    return torch.arange(positions.numel(), device=positions.device)


def verify_rows(qo_indptr: torch.Tensor, n: int):
    """For each of n verify rows: (row index, its request, the request's first row, one past its last, whether the
    row lies inside a request at all: graph-bucket rows past qo_indptr[-1] do not), each [n]. Tensor ops only, no
    host read of the indptr: CUDA graphs capture it (a .tolist() there raises during capture)."""
    qo = qo_indptr.to(torch.long)                                     # [B + 1]
    r = torch.arange(n, device=qo.device)                             # [n]
    req = torch.searchsorted(qo[1:], r, right=True).clamp(max=qo.numel() - 2)
    return r, req, qo[req], qo[req + 1], r < qo[-1]


def padding_rows(positions: torch.Tensor, meta) -> torch.Tensor:
    """[T] bool: a verify row past its request's first that sits at the root's position
    (padding rows take the root's token and position; real draft rows are one deeper at least)."""
    if meta is None or meta.custom_mask is None:
        return torch.zeros(positions.numel(), dtype=torch.bool, device=positions.device)
    r, _, start, _, inside = verify_rows(meta.qo_indptr.to(positions.device), positions.numel())
    return inside & (r > start) & (positions == positions[start])


@dataclass(frozen=True)
class ModelStages:
    latent_rope_positions: Callable = row_positions   # (positions [T], meta) -> positions the latent key turns at
    latent_slots: Callable = row_slots                # (out_cache_loc [T], meta) -> slots the latents are written to
    moe_dispatch: Callable = own_rows                 # (positions [T], meta) -> [T] row each row's experts read
