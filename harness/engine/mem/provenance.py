"""KV provenance canary: every KV slot remembers the (request, position,
token) whose K/V a forward wrote into it. Each verify checks, against that
record, every prefix slot its kernel read (kv_indices) and every slot its
rows wrote (out_cache_loc). Free slots are marked free (and, in the pool,
poisoned with NaN), so a read of a slot no request owns is named even where
the mask hides it.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.engine.mem.allocator import PADDING_SLOT

FREE, UNKNOWN, BATCH_PADDING = -1, -2, -3   # owner codes besides a request id


class HandedWrong(ValueError):
    """The engine handed the canary slots that are no slot indices (a float tensor, one past the pool): the
    engine's bug, not the canary's (harness/check/crash.py attributes it past the canary's own frames)."""

    caller_is_at_fault = True


def _index(slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """slots  # [n] on the CPU, checked to be indices of the pool's slots."""
    s = torch.as_tensor(slots).cpu()
    if s.dtype in (torch.bool, torch.uint8) or s.is_floating_point() or s.is_complex():
        raise HandedWrong(f"KV slots of dtype {s.dtype} handed to the pool: slot indices are integers")
    if s.numel() and (int(s.min()) < -num_slots or int(s.max()) >= num_slots):
        raise HandedWrong(f"KV slot {int(s.max()) if int(s.max()) >= num_slots else int(s.min())} handed to a "
                          f"pool of {num_slots} slots")
    return s


@dataclass(frozen=True)
class ProvenanceFinding:
    step: int          # verify round; -1 for the prefill
    request: int       # the request whose read or write it is
    kind: str          # free-slot | other-request | batch-padding | position | token | clobber | write-free
    #                    | padding-write | freed-committed
    slot: int
    position: int      # the position the read expected (the prefix index), or the row's position for a write
    text: str

    def record(self, setting: str) -> dict:
        return {"kind": "provenance", "setting": setting, "step": self.step, "request": self.request,
                "finding": self.kind, "slot": self.slot, "position": self.position, "text": self.text,
                "verdict": "diverge"}


class SlotProvenance:
    """owner, position, token  # [num_slots] int64 on the CPU: who wrote each slot last."""

    def __init__(self, num_slots: int) -> None:
        self.owner = torch.full((num_slots,), FREE, dtype=torch.int64)
        self.position = torch.full((num_slots,), -1, dtype=torch.int64)
        self.token = torch.full((num_slots,), -1, dtype=torch.int64)
        if num_slots > PADDING_SLOT:   # a pool sized too small is the engine's to find (its alloc raises)
            self.owner[PADDING_SLOT] = BATCH_PADDING

    def stamp(self, slots: torch.Tensor, owners: torch.Tensor, positions: torch.Tensor,
              tokens: torch.Tensor) -> None:
        """Rows wrote their K/V: slots, owners, positions, tokens  # [rows], in write order (the last wins)."""
        for s, o, p, t in zip(slots.tolist(), owners.tolist(), positions.tolist(), tokens.tolist()):
            self.owner[s], self.position[s], self.token[s] = o, p, t

    def written(self, slots: torch.Tensor) -> None:
        """K/V written by something that does not say what (e.g. a port's set_kv_buffer)."""
        self.owner[_index(slots, self.owner.numel())] = UNKNOWN

    def freed(self, slots: torch.Tensor) -> None:
        s = _index(slots, self.owner.numel())
        self.owner[s], self.position[s], self.token[s] = FREE, -1, -1

    def move(self, tgt: torch.Tensor, src: torch.Tensor) -> None:
        """K/V copied src -> tgt (a compaction): the provenance goes with it."""
        t, s = tgt.cpu(), src.cpu()
        self.owner[t], self.position[t], self.token[t] = self.owner[s].clone(), self.position[s].clone(), \
            self.token[s].clone()

    def check_reads(self, step: int, rid: int, slots: torch.Tensor, tokens: list[int]) -> list[ProvenanceFinding]:
        """slots  # [prefix] what the kernel read for request `rid`'s positions 0..prefix-1;
        tokens  # [prefix] the request's committed tokens. The first bad position only."""
        s = slots.cpu()
        if s.numel() != len(tokens):
            return [ProvenanceFinding(step, rid, "position", -1, -1,
                                      f"request {rid} reads {s.numel()} prefix slots for {len(tokens)} committed "
                                      "positions")]
        owner, pos, tok = self.owner[s], self.position[s], self.token[s]
        want_tok = torch.tensor(tokens, dtype=torch.int64)
        bad = ((owner != rid) | (pos != torch.arange(s.numel())) | (tok != want_tok)) & (owner != UNKNOWN)
        if not bool(bad.any()):
            return []
        j = int(bad.nonzero()[0])
        slot, o, p, t = int(s[j]), int(owner[j]), int(pos[j]), int(tok[j])
        head = f"step {step}, request {rid}: position {j} reads KV slot {slot}, which "
        if o == FREE:
            kind, what = "free-slot", "is free (no request owns it)"
        elif o == BATCH_PADDING:
            kind, what = "batch-padding", "was last written by a graph batch-padding row"
        elif o != rid:
            kind, what = "other-request", f"holds request {o}'s position {p} (token {t})"
        elif p != j:
            kind, what = "position", f"holds this request's position {p} (token {t})"
        else:
            kind, what = "token", f"holds token {t} at that position, not the committed token {tokens[j]}"
        n = int(bad.sum())
        more = f"; {n} of {s.numel()} prefix slots are wrong" if n > 1 else ""
        return [ProvenanceFinding(step, rid, kind, slot, j, head + what + more)]

    def check_writes(self, step: int, slots: torch.Tensor, owners: torch.Tensor, positions: torch.Tensor,
                     allocated: frozenset[int], committed: dict[int, tuple[int, int]]) -> list[ProvenanceFinding]:
        """Before stamping a forward's writes: no row writes a free slot or a
        slot some request has committed, and no graph batch-padding row writes a
        slot a live row writes in the same forward. committed: slot -> (request, position)."""
        out: list[ProvenanceFinding] = []
        live = {s: (o, p) for s, o, p in zip(slots.tolist(), owners.tolist(), positions.tolist())
                if o != BATCH_PADDING}
        for s, o, p in zip(slots.tolist(), owners.tolist(), positions.tolist()):
            if s == PADDING_SLOT:
                continue
            who = "a graph batch-padding row" if o == BATCH_PADDING else f"request {o}'s row at position {p}"
            if o == BATCH_PADDING and s in live:
                r, rp = live[s]
                out.append(ProvenanceFinding(step, r, "padding-write", s, p, f"step {step}: a graph batch-padding "
                                             f"row writes KV slot {s} at position {p}, the slot request {r}'s row "
                                             f"at position {rp} writes in the same forward"))
            if s in committed:
                r, cp = committed[s]
                out.append(ProvenanceFinding(step, o, "clobber", s, p, f"step {step}: {who} writes KV slot {s}, "
                                             f"which holds request {r}'s committed position {cp}"))
            elif s not in allocated:
                out.append(ProvenanceFinding(step, o, "write-free", s, p, f"step {step}: {who} writes KV slot "
                                             f"{s}, which is free (not allocated to any request)"))
            if out:
                return out
        return out


def poison_slots(k_buffers: list[torch.Tensor], v_buffers: list[torch.Tensor], slots: torch.Tensor) -> None:
    """NaN into every layer's K and V at `slots`: a read of them shows, even
    through a zero attention weight (0 x NaN = NaN)."""
    for kb, vb in zip(k_buffers, v_buffers):
        idx = slots.to(kb.device)
        kb[idx] = float("nan")
        vb[idx] = float("nan")
