"""KV audit, run after every verify round of a localization re-run: the
slot bookkeeping invariants, then the cached K/V of every committed position
against the oracle's K/V at that position.

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Violation:
    step: int
    kind: str   # alias | kv_indices | commit | freed-referenced (rejected slots kept) | referenced-free
    text: str


@dataclass
class KVAudit:
    violations: list[Violation] = field(default_factory=list)
    first_bad_step: int | None = None
    first_bad_request: int | None = None
    first_bad_position: int | None = None
    first_bad_layer: int | None = None
    rel_err: float | None = None
    first_bad_slot: int | None = None
    held_position: int | None = None   # the committed position whose K/V that slot holds (None: none matches)

    def to_record(self) -> dict:
        return {"violations": [f"step {v.step}: {v.text}" for v in self.violations],
                "violation_kinds": sorted({v.kind for v in self.violations}),
                "first_bad_step": self.first_bad_step, "first_bad_request": self.first_bad_request,
                "first_bad_position": self.first_bad_position, "first_bad_layer": self.first_bad_layer,
                "rel_err": self.rel_err, "first_bad_slot": self.first_bad_slot,
                "held_position": self.held_position}

    def kinds(self) -> set[str]:
        return {v.kind for v in self.violations}


def audit_invariants(engine, result, kernel_kv_indices: torch.Tensor, audit: KVAudit,
                     read_r2t: torch.Tensor | None = None) -> None:
    """State is the engine's right after the round's commit (before any
    request retires). kernel_kv_indices: what the kernel read (the static
    buffer for graph runs); read_r2t: req_to_token as the round's verify read it, before its commit (a paged
    commit moves a prefix's tail page; None: the state after the commit)."""
    step, vb = result.step, result.batch
    r2t = engine.req_pool.req_to_token.cpu()
    read = read_r2t if read_r2t is not None else r2t   # [reqs, max_context] the prefixes the verify read
    owned = engine.pool.allocator.owned
    live = {r.rid: r for r in engine.requests if not r.finished}
    loc = vb.attn.out_cache_loc.cpu().tolist()
    committed_before = {int(s) for rs in result.requests
                        for s in read[live[rs.rid].req_pool_idx, :len(rs.prefix)].tolist()}
    dup = sorted({s for s in loc if loc.count(s) > 1})
    if dup:
        rows = [i for i, s in enumerate(loc) if s == dup[0]]
        audit.violations.append(Violation(step, "alias", f"out_cache_loc is not unique: slot {dup[0]} is written by "
                                                         f"rows {rows} (q_len {vb.q_len}); {len(dup)} slots aliased"))
    clobbered = sorted(set(loc) & committed_before)
    if clobbered:
        audit.violations.append(Violation(step, "alias", f"out_cache_loc writes committed slots {clobbered[:6]}"))
    kvp = vb.attn.kv_indptr.tolist()
    for b, rs in enumerate(result.requests):
        r = live[rs.rid]
        old, acc = len(rs.prefix), rs.acceptance
        want = read[r.req_pool_idx, :old]
        got = kernel_kv_indices[kvp[b]:kvp[b + 1]].cpu()
        if got.numel() != want.numel() or not bool((got == want).all()):
            bad = (got != want).nonzero().flatten().tolist() if got.numel() == want.numel() else []
            audit.violations.append(Violation(step, "kv_indices", f"request {rs.rid}: the kernel's kv_indices differ "
                                              f"from req_to_token[:{old}] at positions {bad[:6]}"))
        slots = torch.tensor(rs.row_slots)
        new = r2t[r.req_pool_idx, old:old + len(acc.rows)]
        if engine.s.page_size > 1:   # a compaction copies K/V: each position's slot holds its own token's
            _paged_commit(engine, rs, r, step, audit)
        elif not bool((new == slots[list(acc.rows)]).all()):
            audit.violations.append(Violation(step, "commit", f"request {rs.rid}: positions {old}..{old + len(acc.rows) - 1} "
                                              f"point at slots {new.tolist()}, the accepted rows {list(acc.rows)} "
                                              f"were written at {slots[list(acc.rows)].tolist()}"))
        stale = [(pos, int(s)) for pos, s in enumerate(r2t[r.req_pool_idx, :old + len(acc.rows)].tolist())
                 if int(s) not in owned]
        if stale:
            audit.violations.append(Violation(step, "referenced-free", f"request {rs.rid}: position {stale[0][0]} "
                                              f"points at slot {stale[0][1]}, which the allocator holds free "
                                              f"({len(stale)} such positions)"))
        freed = set(rs.row_slots) - set(new.tolist())
        if engine.s.page_size > 1:   # rejected rows may share a kept page: pages no position uses must be free
            used = {int(s) // engine.s.page_size for s in r2t[r.req_pool_idx, :old + len(acc.rows)].tolist()}
            freed = {s for s in freed if s // engine.s.page_size not in used}
        referenced = {int(s) for s in freed if s in owned}
        if referenced:
            audit.violations.append(Violation(step, "freed-referenced", f"request {rs.rid}: slots "
                                              f"{sorted(referenced)[:6]} of rejected rows are still allocated"))


def _paged_commit(engine, rs, r, step: int, audit: KVAudit) -> None:
    """Per token: the slot of each new position holds that position's token (its provenance)."""
    prov, r2t = engine.pool.provenance, engine.req_pool.req_to_token.cpu()
    old, acc = len(rs.prefix), list(rs.acceptance.rows)
    for j, i in enumerate(acc):
        s = int(r2t[r.req_pool_idx, old + j])
        held = (int(prov.owner[s]), int(prov.position[s]), int(prov.token[s]))
        if held != (rs.rid, old + j, rs.tree.tokens[i]):
            audit.violations.append(Violation(step, "commit", f"request {rs.rid}: position {old + j} points at slot "
                                              f"{s}, which holds request {held[0]}'s position {held[1]} (token "
                                              f"{held[2]}), not accepted row {i}'s K/V (token {rs.tree.tokens[i]})"))
            return


def audit_cache(engine, result, oracle, tol: float, audit: KVAudit) -> None:
    """Every committed position's cached K and V against the oracle's
    (path_kv of the committed tokens); records the first wrong one. A latent
    pool (MLA) is audited against the oracle's latents instead (model_audit.py)."""
    if audit.first_bad_position is not None or engine.cfg.mla is not None:
        return
    live = {r.rid: r for r in engine.requests if not r.finished}
    for rs in result.requests:
        r = live[rs.rid]
        tokens = r.committed_tokens()
        slots = engine.req_pool.req_to_token[r.req_pool_idx, :len(tokens)]
        ks, vs = oracle.path_kv(tokens)
        for pos in range(len(tokens)):
            for layer in range(len(ks)):
                got_k = engine.pool.k_buffer[layer][slots[pos]].double().cpu()
                got_v = engine.pool.v_buffer[layer][slots[pos]].double().cpu()
                scale = max(float(ks[layer].abs().max()), float(vs[layer].abs().max()), 1e-30)
                err = max(float((got_k - ks[layer][pos]).abs().max()), float((got_v - vs[layer][pos]).abs().max()))
                if not err / scale <= tol:
                    audit.first_bad_step, audit.first_bad_request = result.step, rs.rid
                    audit.first_bad_position, audit.first_bad_layer, audit.rel_err = pos, layer, err / scale
                    audit.first_bad_slot = int(slots[pos])
                    audit.held_position = _held_position(got_k, got_v, ks[layer], vs[layer], scale, tol)
                    return


def _held_position(got_k, got_v, ks, vs, scale: float, tol: float) -> int | None:
    """The committed position whose oracle K/V the slot holds, if any."""
    for pos in range(ks.shape[0]):
        err = max(float((got_k - ks[pos]).abs().max()), float((got_v - vs[pos]).abs().max()))
        if err / scale <= tol:
            return pos
    return None
