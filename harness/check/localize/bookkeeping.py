"""Emission and length bookkeeping checked against the acceptance directly
(issue 21 point 3): after a round, each request must have emitted exactly
its accepted drafts then the bonus, and its committed length must have grown
by exactly the accepted rows (the root, which the last round emitted, and the
accepted drafts). A loop that emits a token twice or a commit that counts
one short is then named where it happened, never blamed on the model whose
cached K/V it later makes look wrong.

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

from harness.check.localize.wrong import Wrong, excerpt


def audit_bookkeeping(engine, result) -> list[Wrong]:
    """The wrong emissions (stage accept) and committed lengths (stage commit) of one round, read from the
    engine's requests right after it (the round's generator is suspended at its yield)."""
    live = {r.rid: r for r in engine.requests}
    out: list[Wrong] = []
    for rs in result.requests:
        r = live.get(rs.rid)
        if r is None:
            continue
        acc, tree = rs.acceptance, rs.tree
        before = list(rs.prefix[len(r.prompt):]) + [tree.tokens[0]]   # emitted before the round: its root last
        want = before + [tree.tokens[i] for i in acc.rows[1:]] + [acc.bonus]
        i, e, f, n = excerpt(want, r.emitted)
        if i is not None:
            out.append(Wrong(rs.step, "accept", "emitted", rs.rid, i, e, f, n,
                             f"request {rs.rid}: after accepting rows {list(acc.rows)} with bonus {acc.bonus}, the "
                             f"engine emitted {len(r.emitted) - len(before)} tokens where the acceptance gives "
                             f"{len(want) - len(before)} (first wrong at emitted token {i}: {f[:1]} not {e[:1]})"))
        length = len(rs.prefix) + len(acc.rows)
        if r.seq_len != length:
            out.append(Wrong(rs.step, "commit", "seq_len", rs.rid, None, length, r.seq_len, 1,
                             f"request {rs.rid}: the committed length is {r.seq_len} after the commit; the prefix "
                             f"({len(rs.prefix)}) plus the accepted rows ({len(acc.rows)}, root included) give "
                             f"{length}"))
    return out
