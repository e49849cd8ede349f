"""The verify metadata of one round audited against SGLang's target-verify
rules on its own (DOMAIN.md section 3), each quantity with its expected and
found values: input_ids, positions, seq_lens, qo_indptr, kv_indptr,
kv_indices, mask_indptr, custom_mask, out_cache_loc; then the acceptance
against an independent greedy walk (the oracle's, over the engine's own
logits) and the commit (req_to_token, the free list).

The expected values come from the trees, the committed prefixes, the slots
the allocator handed out and req_to_token, never from the stage under test.

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

import torch

from harness.check.localize.audits import ranges
from harness.check.localize.mask_probe import ancestor_mask
from harness.check.localize.roles import role_diff, role_sentence, slot_owner
from harness.check.localize.wrong import Wrong, excerpt
from harness.ports.audit import inversion_sentence, inverted_entries, is_inverted, mask_encoding


def audit_round(engine, result, oracle, read_r2t: torch.Tensor | None = None) -> list[Wrong]:
    """Every rule, for one round; state is the engine's right after its commit (read_r2t: req_to_token as the
    round's verify read it, before the commit; None: the state after it)."""
    return verify_inputs(engine, result, read_r2t) + acceptance(engine, result, oracle) + commit(engine, result)


def _expected(engine, result):
    trees = [rs.tree for rs in result.requests]
    seq = [len(rs.prefix) for rs in result.requests]
    idx = [engine.requests[rs.rid].req_pool_idx for rs in result.requests]
    return trees, seq, idx


def owners_of(engine) -> dict[int, tuple[int, int]]:
    r2t = engine.req_pool.req_to_token.cpu()
    return {int(s): (r.rid, j) for r in engine.requests if not r.finished
            for j, s in enumerate(r2t[r.req_pool_idx, :r.seq_len].tolist())}


def verify_inputs(engine, result, read_r2t: torch.Tensor | None = None) -> list[Wrong]:
    """The round's verify batch against the rules; read_r2t as audit_round's."""
    vb, step = result.batch, result.step
    trees, seq, idx = _expected(engine, result)
    n, bs = vb.q_len, len(trees)
    rids = [rs.rid for rs in result.requests]
    r2t = read_r2t if read_r2t is not None else engine.req_pool.req_to_token.cpu()   # [reqs, max_context]
    out: list[Wrong] = []
    ids, pos = vb.input_ids.cpu().tolist(), vb.positions.cpu().tolist()
    for b, (t, p) in enumerate(zip(trees, seq)):
        want = [(t.tokens[i], p + t.depths[i]) for i in range(t.num_rows)]
        got = list(zip(ids[b * n:b * n + t.num_rows], pos[b * n:b * n + t.num_rows]))
        bad = [i for i in range(t.num_rows) if got[i] != want[i]]
        if not bad:
            continue
        permuted = sorted(got) == sorted(want)
        tok_bad = [i for i in bad if got[i][0] != want[i][0]]
        if tok_bad:
            i = tok_bad[0]
            out.append(Wrong(step, "build_verify_batch", "input_ids", rids[b], i, [w[0] for w in want],
                             [g[0] for g in got], len(tok_bad),
                             f"request {rids[b]}: input_ids of rows {ranges(tok_bad)} are not the tree's tokens "
                             f"(row {i}: {got[i][0]}, the tree's {want[i][0]})"
                             + ("; the rows carry other nodes' (token, position): renumbered" if permuted else ""),
                             "permuted" if permuted else ""))
            continue
        i = bad[0]
        row_index = all(got[r][1] == p + r for r in range(t.num_rows))
        rows = ", ".join(f"{r} (depth {t.depths[r]}) at {got[r][1]} not {want[r][1]}" for r in bad[:4])
        out.append(Wrong(step, "build_verify_batch", "positions", rids[b], i, [w[1] for w in want],
                         [g[1] for g in got], len(bad), f"request {rids[b]}: positions are not prefix + depth: "
                         f"rows {rows}" + ("; they are prefix + row index" if row_index else ""),
                         "row-index" if row_index else ""))
    a = vb.attn
    checks = [("seq_lens", seq, vb.seq_lens.cpu(), "committed lengths"),
              ("qo_indptr", list(range(0, (bs + 1) * n, n)), a.qo_indptr.cpu(), "b x q_len"),
              ("kv_indptr", torch.cumsum(torch.tensor([0] + seq), 0), a.kv_indptr.cpu(), "cumsum of the prefixes"),
              ("kv_indices", torch.cat([r2t[i, :s] for i, s in zip(idx, seq)]), a.kv_indices.cpu(),
               "req_to_token[req, :prefix] per request")]
    mask_indptr = torch.cumsum(torch.tensor([0] + [n * (s + n) for s in seq]), 0)
    if a.mask_indptr is not None:
        checks.append(("mask_indptr", mask_indptr, a.mask_indptr.cpu(), "cumsum of q_len x (prefix + q_len)"))
    owners = owners_of(engine)
    for name, want, got, rule in checks:
        i, e, f, count = excerpt(want, got)
        if i is None:
            continue
        text = f"{name} is not {rule}: element {i} is {f[:1] or 'missing'}, the rule gives {e[:1] or 'nothing'}"
        if name == "kv_indices" and f:
            text += f"; it names {slot_owner(int(f[0]), owners, _request_at(i, seq, rids))}"
        out.append(Wrong(step, "build_verify_batch", name, None, i, e, f, count, text))
    out += _mask(engine, result, trees, seq, mask_indptr)
    out += _out_cache_loc(result, trees, owners, engine)
    return out


def _request_at(i: int, seq: list[int], rids: list[int]) -> int:
    ends = torch.cumsum(torch.tensor(seq), 0).tolist()
    return rids[next((b for b, e in enumerate(ends) if i < e), len(rids) - 1)]


def _mask(engine, result, trees, seq, mask_indptr) -> list[Wrong]:
    vb, step = result.batch, result.step
    a, n = vb.attn, vb.q_len
    stage = _mask_stage(engine, trees, seq, a)
    out: list[Wrong] = []
    if a.mask_indptr is not None and not torch.equal(a.mask_indptr.cpu(), mask_indptr):
        maxp, bs = max(seq), len(seq)
        rect = torch.equal(a.mask_indptr.cpu(), torch.arange(bs + 1) * n * (maxp + n))
        i, e, f, count = excerpt(mask_indptr, a.mask_indptr.cpu())
        out.append(Wrong(step, stage, "mask_indptr", None, i, e, f, count,
                         f"mask_indptr is not the cumsum of q_len x (prefix + q_len): element {i} is {f[:1]}, "
                         f"the rule gives {e[:1]}" + (f"; it steps by q_len x (max prefix {maxp} + q_len): one "
                                                      "padded rectangle for the batch" if rect else ""),
                         "rectangle" if rect else ""))
    if a.custom_mask is None:
        return out + [Wrong(step, stage, "custom_mask", None, None, "a tree mask", None, 1,
                            "the verify batch carries no custom mask: the kernel runs causal attention")]
    flat = a.custom_mask.cpu() != 0   # nonzero = visible (SGLang's reading, written here)
    reads_prefix = "prefix" in engine.backend.mask_regions
    for b, (t, p) in enumerate(zip(trees, seq)):
        rid = result.requests[b].rid
        start, size = int(mask_indptr[b]), n * (p + n)
        if flat.numel() < start + size:
            out.append(Wrong(step, stage, "custom_mask", rid, flat.numel(), int(mask_indptr[-1]), flat.numel(),
                             int(mask_indptr[-1]) - flat.numel(), f"the custom mask holds {flat.numel()} elements, "
                             f"the batch's blocks need {int(mask_indptr[-1])}"))
            break
        got = flat[start:start + size].view(n, p + n)
        want = ancestor_mask(t, p)
        judged = torch.zeros_like(want)
        judged[:t.num_rows] = True
        if not reads_prefix:
            judged[:, :p] = False
        empty = [r for r in range(t.num_rows, n) if reads_prefix and not bool(got[r].any())]
        bad = (got != want) & judged
        if not bool(bad.any()) and not empty:
            continue
        diff = role_diff(want, got, t, p, judged)
        rows = sorted({r for r, _ in bad.nonzero().tolist()})
        flipped, total = inverted_entries(got, t, p)
        inverted = is_inverted(flipped, total)   # the rule: INVERTED_SHARE of the real entries (ports/audit.py)
        text = f"request {rid}: the custom mask block (rows at stride prefix {p} + q_len {n}) " + (
            f"is inverted: {inversion_sentence(t, mask_encoding(a.custom_mask), flipped)}" if inverted else
            f"differs from the ancestor mask: {role_sentence(diff)}" if rows else "")
        if empty:
            text += ("; " if rows else "") + f"padding rows {ranges(empty)} see no key at all"
        out.append(Wrong(step, stage, "custom_mask", rid, rows[0] if rows else empty[0],
                         {"rows": rows, "lost": diff["lost"]}, {"rows": rows, "gained": diff["gained"]},
                         int(bad.sum()) + len(empty), text,
                         "inverted" if inverted else _mask_hint(diff, empty, got, want, judged, t, p)))
    return out


def _mask_hint(diff, empty, got, want, judged, t, p) -> str:
    if empty and not (diff["gained"] or diff["lost"]):
        return "padding-empty"
    if set(diff["gained"]) == {"padding"} and not diff["lost"] and not empty:
        return "padding-leak"
    n = want.shape[0]
    for w in range(1, n):
        flat = torch.zeros(n * (p + n), dtype=torch.bool)
        flat[:n * (p + w)] = want[:, :p + w].reshape(-1)
        if bool((flat.view(n, p + n) == got)[judged].all()):
            return "row-stride"
    return ""


def _mask_stage(engine, trees, seq, a) -> str:
    """build_mask when the pipeline's mask stage, run on its own, gives the batch's mask; else the
    verify-inputs stage changed it."""
    try:
        mask, indptr = engine.pipeline.build_mask(trees, seq)
    except Exception:  # noqa: BLE001  (a port's stage may not run standalone: the batch stage decides)
        return "build_verify_batch"
    same = (a.custom_mask is not None and a.mask_indptr is not None
            and torch.equal(mask.cpu() != 0, a.custom_mask.cpu() != 0)
            and torch.equal(indptr.cpu(), a.mask_indptr.cpu()))
    return "build_mask" if same else "build_verify_batch"


def _out_cache_loc(result, trees, owners, engine=None) -> list[Wrong]:
    vb, n = result.batch, result.batch.q_len
    want = torch.tensor([s for rs in result.requests for s in rs.row_slots])
    got = vb.attn.out_cache_loc.cpu()
    out = []
    i, e, f, count = excerpt(want, got)
    if got.numel() != want.numel():   # not one slot per row: no row's own slot to compare it with
        out.append(Wrong(result.step, "build_verify_batch", "out_cache_loc", None, i, e, f, count,
                         f"out_cache_loc holds {got.numel()} slots for the batch's {want.numel()} rows "
                         f"(bs x q_len, {len(trees)} x {n})"))
        return out
    if i is not None:
        b, row = divmod(i, n)
        rs, t = result.requests[min(b, len(trees) - 1)], trees[min(b, len(trees) - 1)]
        alias = all(int(got[b * n + r]) in rs.row_slots[:t.num_rows] for r in range(t.num_rows, n)
                    if int(got[b * n + r]) != int(want[b * n + r]))
        kind = "padding" if row >= t.num_rows else "real"
        out.append(Wrong(result.step, "build_verify_batch", "out_cache_loc", rs.rid, i, e, f, count,
                         f"out_cache_loc is not the slots the allocator handed out: {kind} row {row} of request "
                         f"{rs.rid} writes {slot_owner(f[0], owners, rs.rid) if f else 'nothing'}, its own slot is "
                         f"{e[0] if e else 'missing'}" + ("; padding rows write real rows' slots" if alias and kind ==
                                                          "padding" else ""),
                         "padding-alias" if alias and kind == "padding" else ""))
    dup = sorted({s for s in got.tolist() if got.tolist().count(s) > 1})
    if dup and i is None:
        tail = _shared_tail(engine, result, got.tolist(), dup[0])
        out.append(Wrong(result.step, "build_verify_batch", "out_cache_loc", None, got.tolist().index(dup[0]),
                         "unique slots", dup[:8], len(dup), f"out_cache_loc is not unique: slot {dup[0]} is written "
                         f"by rows {[r for r, s in enumerate(got.tolist()) if s == dup[0]]}"
                         + (f"; {tail}" if tail else ""), "shared-tail" if tail else ""))
    return out


def _shared_tail(engine, result, loc: list[int], dup: int) -> str | None:
    """With a paged pool: the rows aliasing `dup` share the request's committed tail page (paged_audit)."""
    if engine is None or engine.s.page_size == 1:
        return None
    from harness.check.localize.paged_audit import shared_tail
    idx = {r.rid: r.req_pool_idx for r in engine.requests}
    return shared_tail(result, engine.req_pool.req_to_token.cpu(), idx, loc, dup, engine.s.page_size)


def acceptance(engine, result, oracle) -> list[Wrong]:
    """The acceptor that drove the run, and the cross-checked one, against the oracle's greedy walk
    over the engine's own logits: independent of the engine's walk code."""
    out = []
    for rs in result.requests:
        t = rs.tree
        parents = [-1] + [int(x) for x in t.parents[1:]]
        ref = oracle.acceptance(list(t.tokens), parents, rs.logits[:t.num_rows].double())
        rows, bonus = [int(x) for x in ref.rows], int(ref.bonus)
        eos = engine.s.eos_id   # the stop rule: an accepted draft eos ends the walk and becomes the bonus
        stop = next((j for j in range(1, len(rows)) if eos is not None and t.tokens[rows[j]] == eos), None)
        rows, bonus = (rows, bonus) if stop is None else (rows[:stop], eos)
        named = [(engine.s.accept, rs.acceptance)]
        if rs.cross_check is not None:
            named.append(("sglang" if engine.s.accept == "walk" else "walk", rs.cross_check))
        for who, acc in named:
            drove = who == engine.s.accept
            role = ("the acceptor that drove the run" if drove else
                    "the cross-checked acceptor (the two acceptance stages disagree)")
            if list(acc.rows) != rows:
                i = next((k for k, (x, y) in enumerate(zip(acc.rows, rows)) if x != y), min(len(acc.rows), len(rows)))
                out.append(Wrong(result.step, "accept", "accepted_rows", rs.rid, i, rows, list(acc.rows), 1,
                                 f"request {rs.rid}: {role} ({who}) accepts rows {list(acc.rows)}, a greedy walk "
                                 f"over the same logits accepts {rows}", "" if drove else "cross-check"))
            elif acc.bonus != bonus:
                src = [r for r in range(t.num_rows) if int(rs.logits[r].argmax()) == acc.bonus]
                where = f"the argmax of row {src[0]}" if src else "no row's argmax"
                out.append(Wrong(result.step, "accept", "bonus", rs.rid, rows[-1], bonus, acc.bonus, 1,
                                 f"request {rs.rid}: {role} ({who}) takes bonus token {acc.bonus}, {where}, not "
                                 f"the argmax {bonus} of the last accepted row {rows[-1]}", "" if drove else "cross-check"))
    return out


def commit(engine, result) -> list[Wrong]:
    """After the commit: positions prefix..prefix+n-1 point at the accepted rows' slots, those slots
    stay allocated, the rejected rows' slots are free (page size 1; a port's own batched commit is
    judged by the port audit instead)."""
    if engine.pipeline.commit_batch is not None:
        return []
    if engine.s.page_size > 1:   # a compaction: judged per token (harness/check/localize/paged_audit.py)
        from harness.check.localize.paged_audit import commit as paged_commit
        return paged_commit(engine, result)
    r2t = engine.req_pool.req_to_token.cpu()
    owned = engine.pool.allocator.owned
    out = []
    for rs in result.requests:
        r = engine.requests[rs.rid]
        old, acc = len(rs.prefix), list(rs.acceptance.rows)
        want = [rs.row_slots[i] for i in acc]
        got = r2t[r.req_pool_idx, old:old + len(acc)].tolist()
        if r.seq_len != old + len(acc) or got != want:
            i, e, f, count = excerpt(want, got)
            contiguous = got == list(rs.row_slots[:len(acc)])
            out.append(Wrong(result.step, "commit", "req_to_token", rs.rid, old + (i or 0), want, got, max(count, 1),
                             f"request {rs.rid}: after the commit, positions {old}..{old + len(acc) - 1} point at "
                             f"slots {got} (committed length {r.seq_len}); the accepted rows {acc} were written at "
                             f"{want} (length {old + len(acc)})" + ("; the slots are out_cache_loc[:n], the first "
                                                                    "n rows'" if contiguous else ""),
                             "contiguous" if contiguous else ""))
            continue
        committed = r2t[r.req_pool_idx, :r.seq_len].tolist()
        freed = [j for j, s in enumerate(committed) if s not in owned]
        kept = sorted(s for i, s in enumerate(rs.row_slots) if i not in acc and s in owned)
        if freed:
            j = freed[0]
            out.append(Wrong(result.step, "commit", "free_slots", rs.rid, j, "allocated", "free", len(freed),
                             f"request {rs.rid}: the commit freed slot {committed[j]}, which position {j} still "
                             f"points at ({len(freed)} committed positions on free slots)", "committed-freed"))
        elif kept:
            out.append(Wrong(result.step, "commit", "free_slots", rs.rid, None, "free", kept[:8], len(kept),
                             f"request {rs.rid}: the rejected rows' slots {kept[:6]} are still allocated after the "
                             "commit (a leak)"))
    return out
