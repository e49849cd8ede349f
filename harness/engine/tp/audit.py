"""The ranks' agreement audit. Every rank builds its own verify metadata, as
a server rank does; all ranks must build the same. Each round, every rank's
mask, kv_indices, positions and out_cache_loc are compared to those most
ranks hold (rank 0's with two ranks) and a rank that differs is named, with
what its difference looks like (the reference's mask of the previous round:
stale; its kv_indices shifted by a constant: shifted). At build, each rank's KV heads are checked against the KV heads
its query heads read under GQA (KV heads sharded where they must be
replicated).

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass

import torch

# the classes the audit names (the fault catalog's TP faults expect them)
RANK_CLASSES = ("rank-stale-mask", "rank-kv-indices", "kv-heads-sharded", "rank-mask", "rank-positions",
                "rank-out-cache-loc")
# each class's stage and first wrong quantity, in the localizer's words (check/localize/wrong.py)
RANK_WHERE = {"rank-stale-mask": ("mask", "custom_mask"), "rank-mask": ("mask", "custom_mask"),
              "rank-kv-indices": ("verify inputs", "kv_indices"), "rank-positions": ("verify inputs", "positions"),
              "rank-out-cache-loc": ("verify inputs", "out_cache_loc"), "kv-heads-sharded": ("model", "kv_heads")}


@dataclass(frozen=True)
class RankMeta:
    """One rank's verify metadata for one round (CPU tensors)."""

    custom_mask: torch.Tensor     # flat, as the kernel reads it
    kv_indices: torch.Tensor      # [sum prefix]
    positions: torch.Tensor       # [bs*q_len]
    out_cache_loc: torch.Tensor   # [bs*q_len]

    @staticmethod
    def of(vb) -> "RankMeta":
        a = vb.attn
        mask = a.custom_mask if a.custom_mask is not None else torch.zeros(0, dtype=torch.bool)
        return RankMeta(mask.detach().cpu().clone(), a.kv_indices.detach().cpu().clone(),
                        vb.positions.detach().cpu().clone(), a.out_cache_loc.detach().cpu().clone())


@dataclass(frozen=True)
class RankFinding:
    step: int
    rank: int
    cls: str          # one of RANK_CLASSES
    quantity: str     # custom_mask | kv_indices | positions | out_cache_loc | kv_heads
    text: str

    def __post_init__(self) -> None:
        if self.cls not in RANK_CLASSES:
            raise ValueError(f"unknown rank finding class {self.cls!r}")

    def record(self, setting: str) -> dict:
        return {"kind": "tp-rank", "setting": setting, "verdict": "diverge", "step": self.step, "rank": self.rank,
                "class": self.cls, "quantity": self.quantity, "text": self.text}


QUANTITIES = ("custom_mask", "kv_indices", "positions", "out_cache_loc")


def audit_ranks(step: int, metas: list[RankMeta], previous: list[RankMeta] | None) -> list[RankFinding]:
    """Every rank against the reference rank this round: the one whose metadata most ranks share (ties:
    the lowest, so rank 0 of two); `previous`: every rank's metadata of the round before (None: the first)."""
    k = reference_rank(metas)
    ref, out = metas[k], []
    for r, m in enumerate(metas):
        if r == k:
            continue
        if not _same(m.custom_mask, ref.custom_mask):
            stale = previous is not None and _same(_as_long_as(previous[k].custom_mask, ref.custom_mask),
                                                   m.custom_mask)
            cls = "rank-stale-mask" if stale else "rank-mask"
            what = f"rank {k}'s mask of the previous round" if stale else "a mask no other rank built"
            out.append(RankFinding(step, r, cls, "custom_mask",
                                   f"step {step}: rank {r}'s custom_mask differs from rank {k}'s at "
                                   f"{_first_diff(m.custom_mask, ref.custom_mask)}; it holds {what}"))
        if not _same(m.kv_indices, ref.kv_indices):
            shift = _constant_shift(m.kv_indices, ref.kv_indices)
            how = f"every slot shifted by {shift:+d}" if shift else "other slots"
            out.append(RankFinding(step, r, "rank-kv-indices", "kv_indices",
                                   f"step {step}: rank {r}'s kv_indices differ from rank {k}'s at "
                                   f"{_first_diff(m.kv_indices, ref.kv_indices)} ({how}): its heads read "
                                   "another prefix's K/V"))
        for q, cls in (("positions", "rank-positions"), ("out_cache_loc", "rank-out-cache-loc")):
            if not _same(getattr(m, q), getattr(ref, q)):
                out.append(RankFinding(step, r, cls, q, f"step {step}: rank {r}'s {q} differ from rank {k}'s at "
                                                        f"{_first_diff(getattr(m, q), getattr(ref, q))}"))
    return out


def reference_rank(metas: list[RankMeta]) -> int:
    """The rank whose metadata (every quantity) the most ranks hold; ties go to the lowest rank."""
    votes = [sum(all(_same(getattr(o, q), getattr(m, q)) for q in QUANTITIES) for o in metas) for m in metas]
    return votes.index(max(votes))


def audit_kv_heads(rank: int, q_heads: tuple[int, ...], kv_heads: tuple[int, ...],
                   reads: tuple[int, ...]) -> RankFinding | None:
    """A rank whose KV heads are not the ones its query heads read (`reads`)."""
    if tuple(kv_heads) == tuple(reads):
        return None
    return RankFinding(0, rank, "kv-heads-sharded", "kv_heads",
                       f"rank {rank} holds KV heads {list(kv_heads)} but its query heads {list(q_heads)} read KV "
                       f"heads {list(reads)}: KV heads sharded across ranks where they must be replicated")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a.to(b.dtype), b))


def _as_long_as(old: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A stale buffer read at `like`'s length: cut, or padded with zeros past its end."""
    flat = old.reshape(-1).to(like.dtype)
    if flat.numel() >= like.numel():
        return flat[:like.numel()]
    return torch.cat([flat, torch.zeros(like.numel() - flat.numel(), dtype=like.dtype)])


def _first_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape:
        return f"its length ({a.numel()} against {b.numel()})"
    idx = int((a.to(b.dtype) != b).nonzero()[0, 0])
    return f"index {idx} ({a[idx].item()} against {b[idx].item()})"


def _constant_shift(a: torch.Tensor, b: torch.Tensor) -> int | None:
    if a.shape != b.shape or a.numel() == 0:
        return None
    d = (a.to(torch.int64) - b.to(torch.int64)).unique()
    return int(d[0]) if d.numel() == 1 else None
