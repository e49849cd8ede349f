"""From evidence to a one-paragraph explanation: the first wrong quantity
(step order, then pipeline order), the stage that produced it, what the
mask probe, the KV audit and the layer bisect measured, and only then a
catalog class when that quantity's pattern is the catalogued one ("unknown"
otherwise). Without any wrong quantity the older measured rules decide."""
from __future__ import annotations

from dataclasses import dataclass, field

from harness.localize.audits import Finding, ranges
from harness.localize.kv_audit import KVAudit
from harness.localize.layer_bisect import Bisect
from harness.localize.mask_probe import MaskDiff, derived_parents, row_stride_explains
from harness.localize.roles import role_sentence
from harness.localize.wrong import Wrong, first_wrong

CLASSES = ("graph-causal-mask", "mask-out-of-bounds", "stale-kv-indices", "stale-graph-mask", "fully-masked-row",
           "node-order", "wrong-position", "slot-alias", "kv-not-compacted", "padding-leak", "batch-mask-layout",
           "mask-shift", "wrong-bonus", "accept-mismatch", "wrong-kv", "unexplained",
           "free-slot-read", "kv-provenance", "unknown")


@dataclass
class Evidence:
    where: str                                    # "step 3, request 0, node 5 (depth 2)"
    what: str                                     # node | padding | batch-padding | stream | accept
    request_index: int | None = None              # index in the verify batch
    num_rows: int = 0                             # real rows of the divergent request's tree
    graph: list[Finding] = field(default_factory=list)
    inputs: Finding | None = None
    accept: Finding | None = None
    probes: list[MaskDiff] = field(default_factory=list)   # every request of the divergent batch
    kv: KVAudit = field(default_factory=KVAudit)
    bisect: Bisect | None = None
    node: int | None = None
    canary: list = field(default_factory=list)   # KV provenance findings up to the divergent round
    wrongs: list[Wrong] = field(default_factory=list)  # every quantity found wrong, up to the divergent round

    def probe(self) -> MaskDiff | None:
        return next((d for d in self.probes if d.request == self.request_index), None)


def classify(ev: Evidence) -> tuple[str, str]:
    """(fault_class, the cause sentence)."""
    w = first_wrong(ev.wrongs)
    if w is not None:
        where = f"step {w.step}" + (f", request {w.request}" if w.request is not None and w.stage != "attention" else "")
        return match_catalog(w, ev) or "unknown", (f"the first wrong quantity is {w.quantity} ({where}), produced "
                                                    f"by the {w.stage} stage: {w.text}")
    return _classify_measured(ev)


def match_catalog(w: Wrong, ev: Evidence) -> str | None:
    """The catalog class whose pattern this first wrong quantity shows, if any."""
    hints = {("graph", "custom_mask", "captured-causal"): "graph-causal-mask",
             ("graph", "custom_mask", "out-of-bounds"): "mask-out-of-bounds",
             ("graph", "custom_mask", "stale"): "stale-graph-mask",
             ("graph", "kv_indices", ""): "stale-kv-indices",
             ("build_mask", "custom_mask", "padding-leak"): "padding-leak",
             ("build_mask", "custom_mask", "padding-empty"): "fully-masked-row",
             ("build_mask", "custom_mask", "row-stride"): "mask-shift",
             ("build_mask", "mask_indptr", "rectangle"): "batch-mask-layout",
             ("build_verify_batch", "positions", "row-index"): "wrong-position",
             ("build_verify_batch", "out_cache_loc", "padding-alias"): "slot-alias",
             ("commit", "req_to_token", "contiguous"): "kv-not-compacted",
             ("commit", "free_slots", "committed-freed"): "free-slot-read",
             ("accept", "bonus", ""): "wrong-bonus",
             ("accept", "bonus", "cross-check"): "accept-mismatch",
             ("accept", "accepted_rows", "cross-check"): "accept-mismatch"}
    if (w.stage, w.quantity, w.hint) == ("build_verify_batch", "input_ids", "permuted"):
        d = ev.probe()
        parents = derived_parents(d, ev.num_rows) if d is not None else None
        return "node-order" if parents is None or any(par > row for row, par in enumerate(parents)) else None
    if w.stage == "graph" and w.quantity == "kv_indices" and any(x.stage == "graph" and x.quantity == "kv_indptr"
                                                                 and x.step == w.step for x in ev.wrongs):
        return None   # the offsets are wrong too: not a buffer left unrefilled
    return hints.get((w.stage, w.quantity, w.hint))


def _classify_measured(ev: Evidence) -> tuple[str, str]:
    """No quantity broke a rule: what the probe, the audits and the bisect measured."""
    kinds = {f.kind: f for f in ev.graph}
    for kind, cls in (("captured-causal", "graph-causal-mask"), ("mask-out-of-bounds", "mask-out-of-bounds"),
                      ("stale-kv-indices", "stale-kv-indices"), ("stale-mask", "stale-graph-mask")):
        if kind in kinds:
            return cls, kinds[kind].text + _probe_note(ev.probe())
    free = next((f for f in ev.canary if f.kind == "free-slot"), None)
    if free is not None:
        return "free-slot-read", (f"{free.text}: kv_indices reach a freed slot, whose K/V any later allocation may "
                                  "overwrite (poisoned free slots show it in the logits, even under a zero weight)")
    d = ev.probe()
    if d is not None and d.empty_rows and not (d.leaked or d.blocked):
        pad = [r for r in d.empty_rows if r >= ev.num_rows]
        kind = "padding rows" if len(pad) == len(d.empty_rows) else "rows"
        return "fully-masked-row", (f"{kind} {ranges(d.empty_rows)} see no key at all (not even their diagonal): "
                                    "the softmax divides 0 by 0, their output is NaN, and the NaN K/V they write "
                                    "reaches every row of the next layer through 0 x NaN")
    if ev.inputs is not None and ev.inputs.kind == "permuted" and d is not None:
        parents = derived_parents(d, ev.num_rows)
        if parents and any(par > row for row, par in enumerate(parents)):
            bad = [(row, par) for row, par in enumerate(parents) if par > row]
            return "node-order", (f"{ev.inputs.text}; the applied mask is the tree's under a renumbering in which "
                                  f"row {bad[0][0]}'s parent is row {bad[0][1]}: children numbered before parents")
    if ev.inputs is not None and ev.inputs.kind == "positions":
        return "wrong-position", ev.inputs.text
    kv = ev.kv.kinds()
    if "alias" in kv:
        v = next(v for v in ev.kv.violations if v.kind == "alias")
        return "slot-alias", f"step {v.step}: {v.text}; the padding rows' write clobbers those nodes' K/V{_kv_note(ev.kv)}"
    if "commit" in kv:
        v = next(v for v in ev.kv.violations if v.kind == "commit")
        return "kv-not-compacted", f"step {v.step}: {v.text}: accepted KV not re-pointed{_kv_note(ev.kv)}"
    if d is not None and (d.leaked or d.blocked):
        return _classify_mask(ev, d)
    if ev.accept is not None:
        cls = {"wrong-bonus": "wrong-bonus", "accept-mismatch": "accept-mismatch"}.get(ev.accept.kind, "unexplained")
        return cls, ev.accept.text
    if ev.kv.first_bad_position is not None:
        return "wrong-kv", f"the cached K/V is wrong{_kv_note(ev.kv)}"
    return "unexplained", "no audit, probe or bisect pinned a cause"


def _classify_mask(ev: Evidence, d: MaskDiff) -> tuple[str, str]:
    roles = d.key_roles
    if d.leaked and not d.blocked and all(roles[c].startswith("padding") for _, c in d.leaked):
        return "padding-leak", _leak_sentence(ev, d)
    if len(ev.probes) > 1:
        longest = max(x.prefix_len for x in ev.probes)
        ok = [x.request for x in ev.probes if not (x.leaked or x.blocked)]
        if ok and all((x.prefix_len == longest) == (x.request in ok) for x in ev.probes):
            return "batch-mask-layout", (f"requests {ok} (the longest prefix, {longest}) see exactly their tree, every "
                                         f"other request's rows are shifted: the batch mask is laid out for "
                                         f"max_prefix + q_len, not per request ({len(d.leaked)} leaked, "
                                         f"{len(d.blocked)} blocked pairs in request {d.request})")
    w = row_stride_explains(d, ev.num_rows)
    rows = sorted({r for r, _ in d.leaked + d.blocked})
    empty = f", rows {ranges(d.empty_rows)} see no key" if d.empty_rows else ""
    if w is None:   # a mask bug, but not the catalogued shift: say what was measured, name no class
        return "unknown", (f"the applied visibility differs from the ancestor mask: {role_sentence(d.roles)} "
                           f"({len(d.leaked)} gained, {len(d.blocked)} lost pairs{empty})")
    return "mask-shift", (f"rows {ranges(rows)} see the wrong keys ({len(d.leaked)} leaked, {len(d.blocked)} blocked "
                          f"pairs{empty}): the mask rows are shifted; the applied mask is the tree's rows written at "
                          f"stride prefix + {w} and read at prefix + {d.expected.shape[0]}")


def _leak_sentence(ev: Evidence, d: MaskDiff) -> str:
    row = ev.node if ev.node is not None and any(r == ev.node for r, _ in d.leaked) else d.leaked[0][0]
    cols = [c for r, c in d.leaked if r == row]
    keys = [c - d.prefix_len for c in cols]
    slots = [d.key_slots[c] for c in cols]
    return (f"row {row} attends to keys {ranges(keys)} of the verify rows (mask columns {ranges(cols)}), "
            f"which are padding rows (KV slots {ranges(slots)}); "
            f"{len(d.leaked)} leaked (row, key) pairs over {len({r for r, _ in d.leaked})} real rows")


def _probe_note(d: MaskDiff | None) -> str:
    if d is None or d.clean:
        return ""
    return f" (mask probe: {len(d.leaked)} leaked, {len(d.blocked)} blocked pairs, {len(d.empty_rows)} empty rows)"


def _kv_note(kv: KVAudit) -> str:
    if kv.first_bad_position is None:
        return ""
    return (f"; first wrong cache entry: step {kv.first_bad_step}, request {kv.first_bad_request}, position "
            f"{kv.first_bad_position}, layer {kv.first_bad_layer}")


def explanation(ev: Evidence, cause: str, cls: str | None = None) -> str:
    parts = [f"{ev.where}: {cause}"]
    d = ev.probe()
    if d is not None and not d.clean and ev.wrongs:
        probe = role_sentence(d.roles) or f"rows {ranges(d.empty_rows)} see no key"
        if d.leaked and not d.blocked and all(d.key_roles[c].startswith("padding") for _, c in d.leaked):
            probe += "; " + _leak_sentence(ev, d)
        parts.append(f"mask probe (effective against expected visibility, request index {d.request}): {probe}")
    if ev.kv.violations:
        v = ev.kv.violations[0]
        more = f" (+{len(ev.kv.violations) - 1} more)" if len(ev.kv.violations) > 1 else ""
        parts.append(f"KV audit: step {v.step}: {v.text}{more}")
    if ev.kv.first_bad_position is not None and "first wrong cache entry" not in cause:
        parts.append(_kv_note(ev.kv).lstrip("; "))
    if ev.bisect is not None and ev.bisect.first_bad_layer is not None:
        first = ev.bisect.first_bad_layer  # hidden-state index: 0 is the embedding output
        parts.append("first wrong at the embedding" if first == 0 else f"first wrong at layer {first - 1}")
    if cls is not None and ev.wrongs:
        parts.append(f"catalog class: {cls}" if cls != "unknown" else "no catalog class matches this pattern (unknown)")
    return "; ".join(parts) + "."
