"""The commit and the rows' slots of a paged pool (page size > 1), audited per
token. A page-level check (each position's slot lies in the right page, the
request owns its pages) cannot see two tokens' K/V swapped inside one page
(SGLang #31218), so every committed position is checked against the
provenance of the slot it points at: the (request, position, token) whose
K/V that slot holds, which moves with the K/V at every compaction copy
(harness/engine/mem/provenance.py).

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

from harness.check.localize.audits import ranges
from harness.check.localize.wrong import Wrong


def commit(engine, result) -> list[Wrong]:
    """After a paged commit: req_to_token page-consistent, each committed
    position's slot holds that position's token, the round's pages no
    position uses freed."""
    ps = engine.s.page_size
    r2t = engine.req_pool.req_to_token.cpu()
    prov, owned = engine.pool.provenance, engine.pool.allocator.owned
    owned_pages = engine.pool.allocator.owned_pages
    out = []
    for rs in result.requests:
        r = engine.requests[rs.rid]
        old, acc = len(rs.prefix), list(rs.acceptance.rows)
        tokens = list(rs.prefix) + [rs.tree.tokens[i] for i in acc]
        slots = r2t[r.req_pool_idx, :old + len(acc)].tolist()
        if r.seq_len != old + len(acc):
            out.append(Wrong(result.step, "commit", "req_to_token", rs.rid, r.seq_len, old + len(acc), r.seq_len, 1,
                             f"request {rs.rid}: committed length {r.seq_len} after accepting {len(acc)} rows on a "
                             f"prefix of {old}"))
            continue
        w = _page_layout(result.step, rs.rid, slots, ps) or _per_token(result.step, rs.rid, slots, tokens, old, ps, prov)
        if w is not None:
            out.append(w)
            continue
        freed = [j for j, s in enumerate(slots) if s not in owned]
        if freed:
            j = freed[0]
            out.append(Wrong(result.step, "commit", "free_slots", rs.rid, j, "allocated", "free", len(freed),
                             f"request {rs.rid}: the commit freed the page of slot {slots[j]}, which position {j} "
                             f"still points at ({len(freed)} committed positions on free pages)", "committed-freed"))
            continue
        used = {s // ps for s in slots}
        kept = sorted(({s // ps for s in rs.row_slots} - used) & owned_pages)
        if kept:
            out.append(Wrong(result.step, "commit", "free_slots", rs.rid, None, "free", kept[:8], len(kept),
                             f"request {rs.rid}: pages {kept[:6]} of this round's rows are still allocated after the "
                             "commit, and no committed position uses them (a leak)"))
    return out


def _page_layout(step: int, rid: int, slots: list[int], ps: int) -> Wrong | None:
    """Position p at offset p % ps of its page; the positions of one page on one page."""
    for p, s in enumerate(slots):
        first = slots[p - p % ps]
        if s % ps != p % ps or s // ps != first // ps:
            return Wrong(step, "commit", "req_to_token", rid, p, f"page {first // ps} offset {p % ps}",
                         f"page {s // ps} offset {s % ps}", 1,
                         f"request {rid}: position {p} points at slot {s} (page {s // ps}, offset {s % ps}); a "
                         f"page-consistent row puts it at offset {p % ps} of page {first // ps}")
    return None


def _per_token(step: int, rid: int, slots: list[int], tokens: list[int], old: int, ps: int, prov) -> Wrong | None:
    """Each position from the prefix's tail page on against its slot's provenance."""
    start = old - old % ps
    bad = []
    for p in range(start, len(slots)):
        s = slots[p]
        held = (int(prov.owner[s]), int(prov.position[s]), int(prov.token[s]))
        if held != (rid, p, tokens[p]):
            bad.append((p, s, held))
    if not bad:
        return None
    p, s, held = bad[0]
    holds = {q: h[1] for q, _, h in bad if h[0] == rid}
    swapped = len(holds) == len(bad) and sorted(holds.values()) == sorted(holds) and all(
        slots[q] // ps == slots[h] // ps for q, h in holds.items())
    where = (f"this request's position {held[1]} (token {held[2]})" if held[0] == rid else
             f"request {held[0]}'s position {held[1]} (token {held[2]})" if held[0] >= 0 else "no committed K/V")
    text = (f"request {rid}: after the compaction, position {p} points at slot {s} (page {s // ps}), whose K/V is "
            f"{where}, not position {p}'s (token {tokens[p]}); positions {ranges([q for q, _, _ in bad])} are wrong")
    if swapped:
        text += ("; the wrong positions hold each other's K/V inside their pages: the compaction permuted the "
                 "accepted tokens' K/V while req_to_token stayed page-consistent (a page-level check sees nothing)")
    return Wrong(step, "commit", "req_to_token", rid, p, [p, tokens[p]], [held[1], held[2]], len(bad), text,
                 "page-permuted" if swapped else "")


def shared_tail(result, r2t, req_pool_indices: dict[int, int], loc: list[int], dup: int, ps: int) -> str | None:
    """The sentence when duplicated slot `dup` is written by rows of one
    request inside the page that holds that request's committed prefix tail
    (branches sharing the tail page instead of each holding its own copy)."""
    q = result.batch.q_len
    rows = [i for i, s in enumerate(loc) if s == dup]
    reqs = {i // q for i in rows}
    if len(reqs) != 1:
        return None
    rs = result.requests[reqs.pop()]
    old = len(rs.prefix)
    prefix_pages = {int(s) // ps for s in r2t[req_pool_indices[rs.rid], :old].tolist()}
    if old % ps == 0 or dup // ps not in prefix_pages:
        return None
    local = [i % q for i in rows]
    return (f"request {rs.rid}: rows {local} (depth {rs.tree.depths[local[0]] if local[0] < rs.tree.num_rows else '-'}"
            f", different branches) all write slot {dup}, in page {dup // ps}, which holds the request's committed "
            f"tail (positions {old - old % ps}..{old - 1}): the branches share the prefix's partial tail page instead "
            "of each continuing its own copy of it, and the last writer's K/V is what any of them commits")
