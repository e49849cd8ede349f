"""Faults that exist only under tensor parallelism (--tp N): one rank's own
verify metadata goes wrong while the others' stay right, or the ranks hold
the wrong KV heads. Each is a per-rank stage (Pipeline.rank_stages) or a
KV-head layout (Pipeline.kv_head_layout); the ranks' agreement audit
(harness/engine/tp/audit.py) must name each.

Layer: faults. Imports the engine and below; never ports, check, report, workflows or cli."""
from __future__ import annotations

from dataclasses import replace

import torch

from harness.engine.pipeline import Pipeline
from harness.engine.tp.sharding import kv_heads_of_rank
from harness.faults.fault import Fault, all_of, two_steps


class _StaleMask:
    """The rank's verify inputs with the mask buffer of its previous round, read at this round's length
    (cut, or zero past the old buffer's end): the rank never refilled its mask."""

    def __init__(self, inner) -> None:
        self.inner, self.previous = inner, None

    def __call__(self, *args):
        vb = self.inner(*args)
        fresh = vb.attn.custom_mask   # flat, this round's
        if self.previous is not None:
            old = self.previous.to(fresh.dtype)
            stale = old[:fresh.numel()] if old.numel() >= fresh.numel() else \
                torch.cat([old, torch.zeros(fresh.numel() - old.numel(), dtype=fresh.dtype, device=old.device)])
            vb = replace(vb, attn=replace(vb.attn, custom_mask=stale))
        self.previous = fresh.clone()
        return vb


class _ShiftedKVIndices:
    """The rank's kv_indices one slot past the right ones: its heads read the neighbouring slots."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __call__(self, *args):
        vb = self.inner(*args)
        return replace(vb, attn=replace(vb.attn, kv_indices=vb.attn.kv_indices + 1))


def _stale_mask_on_last_rank(p: Pipeline, rank: int, tp: int) -> Pipeline:
    return replace(p, build_verify_batch=_StaleMask(p.build_verify_batch)) if rank == tp - 1 else p


def _shifted_kv_indices_on_last_rank(p: Pipeline, rank: int, tp: int) -> Pipeline:
    return replace(p, build_verify_batch=_ShiftedKVIndices(p.build_verify_batch)) if rank == tp - 1 else p


def _kv_heads_sharded(rank: int, tp: int, num_kv_heads: int) -> tuple[int, ...]:
    """Fewer KV heads than ranks dealt round-robin (rank % num_kv_heads) as if sharded, not replicated
    over each head's tp / num_kv_heads consecutive ranks."""
    if num_kv_heads >= tp:
        return kv_heads_of_rank(rank, tp, num_kv_heads)
    return (rank % num_kv_heads,)


def _tp(s, vocab: int) -> bool:
    return s.tp >= 2


def _kv_heads_fewer_than_ranks(s, vocab: int) -> bool:
    from harness.engine.model.presets import model_config
    return s.tp > model_config(s.model).num_kv_heads


TP_FAULTS = (
    Fault("tp-stale-mask", "one TP rank verifies with the previous round's mask buffer while the others refill theirs",
          "--tp >= 2, --max-new-tokens > --block-size + 1 (a second round)", "rank-stale-mask",
          lambda p: replace(p, rank_stages=_stale_mask_on_last_rank), all_of(_tp, two_steps)),
    Fault("tp-shifted-kv-indices", "one TP rank's kv_indices are one slot off: its heads read the neighbouring "
          "slots' K/V", "--tp >= 2", "rank-kv-indices",
          lambda p: replace(p, rank_stages=_shifted_kv_indices_on_last_rank), _tp),
    Fault("tp-kv-heads-sharded", "KV heads dealt round-robin over the ranks where they must be replicated: a rank's "
          "query heads read another group's K/V", "--tp greater than the model's KV heads (e.g. --tp 4 on tiny)",
          "kv-heads-sharded", lambda p: replace(p, kv_head_layout=_kv_heads_sharded),
          all_of(_tp, _kv_heads_fewer_than_ranks)),
)
