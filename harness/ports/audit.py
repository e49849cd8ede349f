"""Structural audit of a port's verify metadata, every step, independent of logits.

Each finding names what was wrong, where, expected against found. A finding
that cannot change logits on the chosen kernel (a fully masked padding row
under SGLang's Triton kernel, which outputs 0 there) is a warning; the others
are errors. `--strict` makes warnings fail the run too.


Layer: ports. Imports the engine and below; never faults, check, report, workflows or cli."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from harness.engine.ddtree.accept import Acceptance, greedy_walk
from harness.engine.ddtree.tree import DraftTree

SEVERITIES = ("error", "warning")


@dataclass(frozen=True)
class Finding:
    check: str        # mask-inverted | mask-padding-visible | mask-extra-key | mask-missing-key | mask-prefix-blocked |
                      # padding-row-empty | mask-layout | mask-length | position | input-id |
                      # padding-convention | accept | commit-slot | commit-kv | slot-leak | served-width
    severity: str
    step: int
    request: int
    detail: str       # one sentence: expected against found
    rows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}")

    def record(self, setting: str) -> dict:
        return {"kind": "audit", "setting": setting, **asdict(self), "rows": list(self.rows)}


def _span(rows: list[int]) -> str:
    return ", ".join(map(str, rows[:8])) + (" ..." if len(rows) > 8 else "")


def expected_draft_visibility(tree: DraftTree) -> torch.Tensor:
    """[num_rows, q_len] bool: real row i sees its root path (itself included) and nothing else."""
    vis = torch.zeros((tree.num_rows, tree.q_len), dtype=torch.bool)
    for i in range(tree.num_rows):
        vis[i, tree.ancestors(i)] = True
    return vis


def mask_encoding(custom_mask: torch.Tensor, limit: int = 4) -> str:
    """The dtype and the distinct values of a mask as it was handed over, e.g.
    'bfloat16, values -3.39e+38, 0'."""
    if custom_mask.dtype == torch.bool:
        return "bool"
    vals = torch.unique(custom_mask.detach().cpu().float()).tolist()
    shown = ", ".join(f"{v:.3g}" for v in vals[:limit]) + (" ..." if len(vals) > limit else "")
    return f"{str(custom_mask.dtype).removeprefix('torch.')}, values {shown}"


# the rule for an inverted mask: the mask as the kernel reads it is the complement of the
# tree's ancestor mask on at least this share of the real (row, key) entries. A real port's
# inversion is rarely exact (the seed's additive mask also counts a drafted token 0 as padding),
# and a mask that is merely wrong flips a few entries, never nine in ten.
INVERTED_SHARE = 0.9


def inverted_entries(block: torch.Tensor, tree: DraftTree, prefix: int) -> tuple[int, int]:
    """block  # [q_len, prefix+q_len] bool, as the kernel reads it. (entries that are the
    complement of the ancestor mask, real entries) over the real rows and the real rows' keys."""
    real = tree.num_rows
    want = expected_draft_visibility(tree)[:, :real]          # [real, real]
    return int((block[:real, prefix:prefix + real] == ~want).sum()), real * real


def is_inverted(flipped: int, total: int) -> bool:
    """Two real rows at least (a root alone only shows its own diagonal hidden) and
    INVERTED_SHARE of the real entries flipped."""
    return total >= 4 and flipped >= INVERTED_SHARE * total


def inverted_on_real_rows(block: torch.Tensor, tree: DraftTree, prefix: int) -> bool:
    """block  # [q_len, prefix+q_len] bool, as the kernel reads it. True when, on the real
    rows and the real rows' keys, it is the complement of the tree's ancestor mask (each
    row's root path hidden, every other real key visible) on INVERTED_SHARE of the entries."""
    return is_inverted(*inverted_entries(block, tree, prefix))


def inversion_sentence(tree: DraftTree, encoding: str, flipped: int | None = None) -> str:
    """What an inverted mask is, measured: one sentence."""
    n = tree.num_rows
    flipped = n * n if flipped is None else flipped
    rest = "" if flipped == n * n else f"; the other {n * n - flipped} entries read as the tree says"
    return (f"the mask handed over ({encoding}) is the complement of the tree's ancestor mask on {n} real rows "
            f"({flipped} of {n * n} (row, key) entries inverted{rest}): the kernel keeps custom_mask != 0 as visible, "
            "so each row sees the real keys off its root path and not its root path, itself included (an additive "
            "bias, 0 = visible and a large negative = hidden, handed to custom_mask as it is reads exactly so)")


def audit_mask(step: int, b: int, tree: DraftTree, prefix: int, block: torch.Tensor,
               reads_prefix: bool, encoding: str = "bool", produced: tuple[str, list[bool]] | None = None
               ) -> list[Finding]:
    """block  # [q_len, prefix+q_len] bool, the request's mask as the kernel reads it;
    encoding: the dtype and values the port handed over (mask_encoding);
    produced: (backend name, per row whether its logits came out finite): a row that
    sees no key is judged by what that backend produced there."""
    out = []
    n, real = tree.q_len, tree.num_rows
    draft = block[:, prefix:]
    want = expected_draft_visibility(tree)
    got = draft[:real]
    flipped, total = inverted_entries(block, tree, prefix)
    inverted = is_inverted(flipped, total)
    if inverted:   # the extra and missing keys below are this one defect (the rest is named in the sentence)
        out.append(Finding("mask-inverted", "error", step, b, inversion_sentence(tree, encoding, flipped),
                           tuple(range(real))))
    pad_seen = [i for i in range(real) if got[i, real:].any()]
    if pad_seen:
        cols = sorted({int(c) for i in pad_seen for c in (got[i, real:].nonzero().flatten() + real)})
        out.append(Finding("mask-padding-visible", "error", step, b,
                           f"real rows {_span(pad_seen)} see padding columns {_span(cols)} (draft-part keys); "
                           f"real rows must see only their root path", tuple(pad_seen)))
    extra = [] if inverted else [i for i in range(real) if (got[i, :real] & ~want[i, :real]).any()]
    if extra:
        i = extra[0]
        keys = (got[i, :real] & ~want[i, :real]).nonzero().flatten().tolist()
        out.append(Finding("mask-extra-key", "error", step, b,
                           f"rows {_span(extra)} see real keys off their root path (row {i}: keys {_span(keys)}; "
                           f"root path {tree.ancestors(i)})", tuple(extra)))
    missing = [] if inverted else [i for i in range(real) if (want[i, :real] & ~got[i, :real]).any()]
    if missing:
        i = missing[0]
        keys = (want[i, :real] & ~got[i, :real]).nonzero().flatten().tolist()
        out.append(Finding("mask-missing-key", "error", step, b,
                           f"rows {_span(missing)} do not see their whole root path (row {i} misses keys {_span(keys)})",
                           tuple(missing)))
    blocked = [i for i in range(real) if prefix and not block[i, :prefix].all()]
    if blocked:
        sev = "error" if reads_prefix else "warning"
        why = "" if reads_prefix else " (this kernel does not read the prefix columns, so it changes no logits)"
        out.append(Finding("mask-prefix-blocked", sev, step, b,
                           f"rows {_span(blocked)} block part of the committed prefix{why}", tuple(blocked)))
    empty = [i for i in range(real, n) if not block[i].any()]
    if empty:
        out.append(_empty_rows(step, b, empty, produced))
    return out


def _empty_rows(step: int, b: int, empty: list[int], produced: tuple[str, list[bool]] | None) -> Finding:
    """Padding rows that see no key: an error where the backend in use produced non-finite
    logits there, a warning where its output stayed finite (SGLang's Triton kernel writes 0)."""
    head = f"padding rows {_span(empty)} see no key at all"
    if produced is None:
        return Finding("padding-row-empty", "warning", step, b, f"{head}: NaN on a kernel that divides by the "
                       "softmax sum (SGLang's Triton kernel writes 0 there)", tuple(empty))
    backend, finite = produced
    nan = [i for i in empty if not finite[i]]
    if nan:
        return Finding("padding-row-empty", "error", step, b, f"{head}, and the {backend} backend produced "
                       f"non-finite logits on rows {_span(nan)} (0/0 in the softmax): the NaN K/V they write "
                       "reaches the next layer", tuple(empty))
    return Finding("padding-row-empty", "warning", step, b, f"{head}; the {backend} backend's output stayed finite "
                   "there, so no logit changes on it (NaN on a kernel that divides by the softmax sum)", tuple(empty))


def audit_inputs(step: int, b: int, tree: DraftTree, prefix: int, ids: list[int], pos: list[int]) -> list[Finding]:
    """ids, pos  # [q_len] the request's verify tokens and positions."""
    out = []
    real = tree.num_rows
    bad_ids = [i for i in range(real) if ids[i] != tree.tokens[i]]
    if bad_ids:
        i = bad_ids[0]
        out.append(Finding("input-id", "error", step, b,
                           f"rows {_span(bad_ids)} carry tokens other than the tree's (row {i}: {ids[i]}, tree says "
                           f"{tree.tokens[i]})", tuple(bad_ids)))
    bad_pos = [i for i in range(real) if pos[i] != prefix + tree.depths[i]]
    if bad_pos:
        i = bad_pos[0]
        out.append(Finding("position", "error", step, b,
                           f"rows {_span(bad_pos)} have positions other than prefix + depth (row {i}: {pos[i]}, "
                           f"expected {prefix + tree.depths[i]})", tuple(bad_pos)))
    return out


def audit_padding_inputs(step: int, b: int, tree: DraftTree, prefix: int, ids: list[int], pos: list[int],
                         declared: tuple[int | None, int | None]) -> list[Finding]:
    """Padding rows against the port's declared convention; their logits are never
    judged, so a difference is a warning (it shows only in padding K/V)."""
    tok, p = declared
    rows = range(tree.num_rows, tree.q_len)
    bad = [i for i in rows if (tok is not None and ids[i] != tok) or (p is not None and pos[i] != p)]
    if not bad:
        return []
    i = bad[0]
    return [Finding("padding-convention", "warning", step, b,
                    f"padding rows {_span(bad)} carry (token, position) other than the declared convention "
                    f"(row {i}: ({ids[i]}, {pos[i]}), declared ({tok}, {p}))", tuple(bad))]


def audit_layout(step: int, declared_layout: str, prefix_lens: list[int], port_numel: int,
                 expected_numel: int) -> list[Finding]:
    out = []
    if declared_layout == "rectangle" and len(prefix_lens) > 1 and len(set(prefix_lens)) > 1:
        out.append(Finding("mask-layout", "error", step, -1,
                           f"the mask is one [bs, q, max_prefix + q] rectangle for prefixes {prefix_lens}; the "
                           "kernel reads per-request [q, prefix_b + q] blocks, so every request after the first "
                           "reads shifted rows"))
    if port_numel != expected_numel:
        out.append(Finding("mask-length", "error", step, -1,
                           f"the mask has {port_numel} entries; the kernel reads {expected_numel} "
                           f"(sum of q_len * (prefix_b + q_len))"))
    return out


def audit_acceptance(step: int, b: int, tree: DraftTree, predicts: list[int], got: Acceptance) -> list[Finding]:
    want = greedy_walk(tree, predicts)
    if want == got:
        return []
    return [Finding("accept", "error", step, b,
                    f"the port accepted rows {list(got.rows)} with bonus {got.bonus}; the greedy walk over the "
                    f"port's own tree accepts rows {list(want.rows)} with bonus {want.bonus}", got.rows)]


def audit_commit(step: int, req_pool, kv_pool, req_pool_indices: list[int], prefix_lens: list[int],
                 loc: torch.Tensor, q: int, accs: list[Acceptance], before: list, new_lens,
                 freed: set[int]) -> list[Finding]:
    """After a commit: request b's position prefix_b + r holds accepted row r's K/V
    (byte for byte, every layer), its length grew by the accepted rows, no
    referenced slot was freed, and every other verify slot was freed.

    loc  # [bs*q] the verify rows' slots; before  # per layer (k, v) [bs*q, kv_heads, head_dim]
    """
    out = []
    table = req_pool.req_to_token.cpu()
    referenced: set[int] = set()
    for b, (idx, prefix, acc) in enumerate(zip(req_pool_indices, prefix_lens, accs)):
        n = len(acc.rows)
        if int(new_lens[b]) != prefix + n:
            out.append(Finding("commit-length", "error", step, b,
                               f"committed length {int(new_lens[b])}; expected prefix {prefix} + {n} accepted rows"))
        slots = table[idx, prefix:prefix + n].tolist()
        referenced.update(table[idx, :prefix + n].tolist())
        wrong = []
        for r, (row, slot) in enumerate(zip(acc.rows, slots)):
            src = b * q + row
            for layer, (k0, v0) in enumerate(before):
                k, v = kv_pool.k_buffer[layer][slot].cpu(), kv_pool.v_buffer[layer][slot].cpu()
                if not (torch.equal(k, k0[src].cpu()) and torch.equal(v, v0[src].cpu())):
                    wrong.append((r, row, slot, layer))
                    break
        if wrong:
            r, row, slot, layer = wrong[0]
            out.append(Finding("commit-kv", "error", step, b,
                               f"position {prefix + r} (slot {slot}) does not hold accepted row {row}'s K/V "
                               f"(first wrong at layer {layer}); {len(wrong)} of {n} committed positions wrong",
                               tuple(w[1] for w in wrong)))
    stale = sorted(referenced & freed)
    if stale:
        out.append(Finding("commit-slot", "error", step, -1,
                           f"slots {_span(stale)} were freed but req_to_token still points at them"))
    leaked = sorted(set(loc.tolist()) - referenced - freed)
    if leaked:
        out.append(Finding("slot-leak", "warning", step, -1,
                           f"verify slots {_span(leaked)} are neither committed nor freed (a KV leak)"))
    return out
