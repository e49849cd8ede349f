"""White-box audits the localizer runs next to the mask probe: the graph's
static buffers against the live batch, the verify inputs against the tree,
and the acceptance against a fresh greedy walk.

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass

from harness.engine.ddtree.accept import Acceptance, cut_at_stop, depth_order_parents, greedy_walk, walk_parents
from harness.engine.ddtree.tree import DraftTree


@dataclass(frozen=True)
class Finding:
    kind: str   # e.g. captured-causal, mask-out-of-bounds, stale-mask, stale-kv-indices, permuted, positions
    text: str


def audit_replay(replay) -> list[Finding]:
    """The bucket's static metadata (what the replay read) against the live
    batch it was refilled from (harness.engine.graph.Replay)."""
    live, meta = replay.live.attn, replay.meta
    out = []
    if live.custom_mask is not None and meta.custom_mask is None:
        out.append(Finding("captured-causal", f"the bucket-{replay.bucket} graph was captured with no custom mask, "
                                              "so its replay runs causal attention and ignores the tree"))
        return out
    need, have = int(meta.mask_indptr[-1]), meta.custom_mask.numel()
    if need > have:
        bs = replay.live.seq_lens.numel()
        out.append(Finding("mask-out-of-bounds",
                           f"the mask buffer handed to the kernel holds {have} elements but mask_indptr ends at "
                           f"{need}: bucket {replay.bucket} pads {bs} requests, and the batch-padding requests' "
                           f"mask (elements {have}..{need - 1}) is read past its end"))
    n_idx = live.kv_indices.numel()
    bad = (meta.kv_indices[:n_idx].cpu() != live.kv_indices.cpu()).nonzero().flatten().tolist()
    if bad:
        out.append(Finding("stale-kv-indices", f"static kv_indices differ from the live batch's at {len(bad)} of "
                                               f"{n_idx} entries (first at {bad[0]}): the replay read stale slots"))
    n_mask = min(live.custom_mask.numel(), meta.custom_mask.numel())
    got = meta.custom_mask[:n_mask].cpu() != 0   # nonzero = visible (SGLang's reading, written here)
    bad = (got != (live.custom_mask[:n_mask].cpu() != 0)).nonzero().flatten().tolist()
    if bad:
        out.append(Finding("stale-mask", f"the static mask buffer differs from the live batch's mask at {len(bad)} "
                                         f"of {n_mask} elements (first at {bad[0]}): the replay read a stale mask"))
    n_pos = replay.live.positions.numel()
    static, want = replay.positions[:n_pos].cpu(), replay.live.positions.cpu()
    bad = (static != want).nonzero().flatten().tolist()
    if bad:
        out.append(Finding("stale-positions", f"the static positions buffer differs from the live batch's positions "
                                              f"at {len(bad)} of {n_pos} rows (row {bad[0]}: {int(static[bad[0]])} "
                                              f"not {int(want[bad[0]])}): the replay read the positions of an "
                                              "earlier batch, not refilled"))
    return out


def audit_inputs(vb, trees: list[DraftTree]) -> dict[int, Finding]:
    """Per request index b: real rows' (token, position) against (tree token,
    prefix + depth). Padding rows are not judged (ports differ on them)."""
    out, n = {}, vb.q_len
    ids, pos = vb.input_ids.cpu().tolist(), vb.positions.cpu().tolist()
    for b, (t, p) in enumerate(zip(trees, vb.seq_lens.tolist())):
        want = [(t.tokens[i], p + t.depths[i]) for i in range(t.num_rows)]
        got = list(zip(ids[b * n:b * n + t.num_rows], pos[b * n:b * n + t.num_rows]))
        if got == want:
            continue
        wrong = [i for i in range(t.num_rows) if got[i] != want[i]]
        if sorted(got) == sorted(want):
            out[b] = Finding("permuted", f"rows {ranges(wrong)} carry other nodes' (token, position): "
                                         "the rows are renumbered")
        elif [g[0] for g in got] == [w[0] for w in want] and len({g[1] - w[1] for g, w in zip(got, want)}) == 1:
            shift = got[0][1] - want[0][1]
            out[b] = Finding("positions-offset", f"every real row's position is prefix + depth {shift:+d} (the root "
                                                 f"at {got[0][1]}, not {want[0][1]}): a constant offset on the "
                                                 "position base")
        elif [g[0] for g in got] == [w[0] for w in want]:
            rows = ", ".join(f"{i} (depth {t.depths[i]}) at {got[i][1]} not {want[i][1]}" for i in wrong[:4])
            out[b] = Finding("positions", f"positions are not prefix + depth: rows {rows}")
        else:
            out[b] = Finding("tokens", f"input_ids differ from the tree's tokens at rows {ranges(wrong)}")
    return out


def audit_stop(rs, eos_id: int | None) -> Finding | None:
    """An accepted draft row carrying the end-of-sequence token: the rows and
    the bonus after it were committed past the stop."""
    if eos_id is None:
        return None
    rows, tree = list(rs.acceptance.rows), rs.tree
    j = next((j for j in range(1, len(rows)) if tree.tokens[rows[j]] == eos_id), None)
    if j is None:
        return None
    return Finding("past-stop", f"step {rs.step}, request {rs.rid}: accepted row {rows[j]} carries the "
                                f"end-of-sequence token {eos_id}, yet rows {rows[j:]} and the bonus "
                                f"{rs.acceptance.bonus} are committed: {len(rows) - j} tokens past the stop "
                                f"(the acceptance must end at rows {rows[:j]} with the eos as its bonus)")


def audit_acceptance(rs, eos_id: int | None = None) -> Finding | None:
    """The engine's acceptance against a fresh greedy walk over the same
    logits (ended at an end-of-sequence token): faults swap the accept stage,
    never greedy_walk itself."""
    predicts = rs.logits.argmax(-1).tolist()
    want, acc = cut_at_stop(rs.tree, greedy_walk(rs.tree, predicts), eos_id), rs.acceptance
    if acc == want:
        return None
    rows = list(want.rows)
    got = list(acc.rows)
    off = next((j for j in range(1, len(got)) if rs.tree.parents[got[j]] != got[j - 1]), None)
    if off is not None:
        return Finding("topology", f"step {rs.step}, request {rs.rid}: accepted rows {got} are not a path of the "
                                   f"verified tree: row {got[off]}'s parent is row {rs.tree.parents[got[off]]}, not "
                                   f"the previously accepted row {got[off - 1]}: the acceptance walked another "
                                   f"tree than the verify masked (the greedy walk accepts {rows})")
    if got != rows:
        # which walk gives exactly these rows: one over the tree's parent table in depth order (another
        # topology), or one through a token-keyed map per depth (a twin shadows the child)?
        tree = rs.tree
        found = []
        if got == list(cut_at_stop(tree, walk_parents(tree, depth_order_parents(tree), predicts), eos_id).rows):
            found.append(Finding("topology", f"step {rs.step}, request {rs.rid}: accepted rows {got} are exactly "
                                             "the greedy walk over the tree's parent table renumbered in depth "
                                             "order, not over the verified (pop-order) tree: the acceptance walked "
                                             f"another tree than the verify masked (the greedy walk accepts {rows})"))
        child = rows[len(got)] if got == rows[:len(got)] else None
        twin = [] if child is None else [r for r in range(child + 1, tree.num_rows)
                                         if tree.depths[r] == tree.depths[child] and tree.tokens[r] == tree.tokens[child]]
        if twin and got == _token_keyed_walk(tree, predicts, eos_id):
            found.append(Finding("token-shadowed", f"step {rs.step}, request {rs.rid}: the walk stops at row "
                                                   f"{got[-1]}, whose argmax {predicts[got[-1]]} is the token of its "
                                                   f"child row {child}; row {twin[-1]} (parent "
                                                   f"{tree.parents[twin[-1]]}) repeats that token at depth "
                                                   f"{tree.depths[child]}: a token-keyed lookup shadows the child "
                                                   f"(accepted {got}, the greedy walk {rows})"))
        if len(found) == 1:
            return found[0]
        both = " (a walk over another topology and a token-keyed walk both give them)" if found else ""
        return Finding("accept-ambiguous" if found else "accept-rows",
                       f"step {rs.step}, request {rs.rid}: accepted rows {list(acc.rows)}, the greedy walk accepts "
                       f"{rows}{both}")
    src = [r for r in range(rs.tree.num_rows) if predicts[r] == acc.bonus]
    where = f"the argmax of row {src[0]}" if src else "no row's argmax"
    return Finding("wrong-bonus", f"step {rs.step}, request {rs.rid}: bonus token {acc.bonus} is {where}, "
                                  f"not of the last accepted row {rows[-1]} (token {want.bonus})")


def _token_keyed_walk(tree: DraftTree, predicts: list[int], eos_id: int | None) -> list[int]:
    """The rows a walk accepts that finds the next row in a map {(depth, token): row}
    filled in row order (a later twin wins), stopping where that row is not a child."""
    level = {(tree.depths[r], tree.tokens[r]): r for r in range(1, tree.num_rows)}
    cur, rows = 0, [0]
    while (nxt := level.get((tree.depths[cur] + 1, predicts[cur]))) is not None and tree.parents[nxt] == cur:
        cur = nxt
        rows.append(cur)
    return list(cut_at_stop(tree, Acceptance(tuple(rows), predicts[cur]), eos_id).rows)


def audit_batch_bonus(result) -> Finding | None:
    """Each request's bonus against the batch's flat argmax: a bonus that is not
    its own last accepted row's argmax but is the argmax at the packed offset
    (the earlier requests' real rows, no padding) + that row, in another
    request's rows, was read with the wrong per-request stride."""
    reqs = result.requests
    if len(reqs) < 2:
        return None
    flat = [t for rs in reqs for t in rs.logits.argmax(-1).tolist()]
    q = reqs[0].tree.q_len
    for b, rs in enumerate(reqs):
        last = rs.acceptance.rows[-1]
        if rs.acceptance.bonus == flat[b * q + last]:
            continue
        idx = sum(r.tree.num_rows for r in reqs[:b]) + last
        if idx // q != b and flat[idx] == rs.acceptance.bonus:
            return Finding("bonus-cross-request", f"step {rs.step}, request {rs.rid}: bonus token "
                                                  f"{rs.acceptance.bonus} is the argmax of flat row {idx} (request "
                                                  f"{reqs[idx // q].rid}, row {idx % q}), not of row {b * q + last} "
                                                  f"(its last accepted row {last}, token {flat[b * q + last]}): "
                                                  f"read at the packed offset, the earlier requests' real rows, "
                                                  f"instead of {b} x q_len {q}")
    return None


def ranges(xs: list[int]) -> str:
    """Ascending ints as runs: [1, 2, 3, 7] -> "1-3, 7"."""
    if not xs:
        return ""
    out, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ", ".join(out)

