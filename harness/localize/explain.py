"""From evidence to a fault class and a one-paragraph explanation. Rules go
from the most specific cause to the most generic; the first that holds wins."""
from __future__ import annotations

from dataclasses import dataclass, field

from harness.localize.audits import Finding, ranges
from harness.localize.kv_audit import KVAudit
from harness.localize.layer_bisect import Bisect
from harness.localize.mask_probe import MaskDiff, derived_parents, row_stride_explains

CLASSES = ("graph-causal-mask", "mask-out-of-bounds", "stale-kv-indices", "stale-graph-mask", "fully-masked-row",
           "node-order", "wrong-position", "slot-alias", "kv-not-compacted", "padding-leak", "batch-mask-layout",
           "mask-shift", "wrong-bonus", "accept-mismatch", "wrong-kv", "unexplained",
           "free-slot-read", "kv-provenance", "position-offset", "stale-graph-positions", "mask-of-other-request",
           "bonus-cross-request", "token-shadowed", "commit-past-stop")


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

    def probe(self) -> MaskDiff | None:
        return next((d for d in self.probes if d.request == self.request_index), None)


def classify(ev: Evidence) -> tuple[str, str]:
    """(fault_class, the cause sentence)."""
    kinds = {f.kind: f for f in ev.graph}
    for kind, cls in (("captured-causal", "graph-causal-mask"), ("mask-out-of-bounds", "mask-out-of-bounds"),
                      ("stale-kv-indices", "stale-kv-indices"), ("stale-mask", "stale-graph-mask"),
                      ("stale-positions", "stale-graph-positions")):
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
    if ev.inputs is not None and ev.inputs.kind == "positions-offset":
        return "position-offset", ev.inputs.text
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
        cls = {"wrong-bonus": "wrong-bonus", "accept-mismatch": "accept-mismatch", "token-shadowed": "token-shadowed",
               "bonus-cross-request": "bonus-cross-request",
               "past-stop": "commit-past-stop"}.get(ev.accept.kind, "unexplained")
        return cls, ev.accept.text
    if ev.kv.first_bad_position is not None:
        return "wrong-kv", f"the cached K/V is wrong{_kv_note(ev.kv)}"
    return "unexplained", "no audit, probe or bisect pinned a cause"


def _classify_mask(ev: Evidence, d: MaskDiff) -> tuple[str, str]:
    roles = d.key_roles
    if d.leaked and not d.blocked and all(roles[c].startswith("padding") for _, c in d.leaked):
        return "padding-leak", _leak_sentence(ev, d)
    other = _other_requests_tree(ev, d)
    if other is not None:
        return "mask-of-other-request", (f"request {d.request}'s rows see exactly request {other.request}'s tree "
                                         f"(its draft part is that request's ancestor mask, {len(d.leaked)} leaked, "
                                         f"{len(d.blocked)} blocked pairs against its own): the mask blocks are "
                                         "filled in another request order")
    if len(ev.probes) > 1:
        longest = max(x.prefix_len for x in ev.probes)
        ok = [x.request for x in ev.probes if not (x.leaked or x.blocked)]
        if ok and all((x.prefix_len == longest) == (x.request in ok) for x in ev.probes):
            return "batch-mask-layout", (f"requests {ok} (the longest prefix, {longest}) see exactly their tree, every "
                                         f"other request's rows are shifted: the batch mask is laid out for "
                                         f"max_prefix + q_len, not per request ({len(d.leaked)} leaked, "
                                         f"{len(d.blocked)} blocked pairs in request {d.request})")
    w = row_stride_explains(d, ev.num_rows)
    stride = (f"; the applied mask is the tree's rows written at stride prefix + {w} and read at prefix + "
              f"{d.expected.shape[0]}" if w is not None else "")
    rows = sorted({r for r, _ in d.leaked + d.blocked})
    empty = f", rows {ranges(d.empty_rows)} see no key" if d.empty_rows else ""
    return "mask-shift", (f"rows {ranges(rows)} see the wrong keys ({len(d.leaked)} leaked, {len(d.blocked)} blocked "
                          f"pairs{empty}): the mask rows are shifted{stride}")


def _other_requests_tree(ev: Evidence, d: MaskDiff) -> MaskDiff | None:
    """Another request of the batch whose tree's draft-part mask is what `d`'s rows saw."""
    seen = d.effective[:, d.prefix_len:]
    for x in ev.probes:
        want = x.expected[:, x.prefix_len:]
        if x.request != d.request and want.shape == seen.shape and bool((want == seen).all()):
            return x
    return None


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


def explanation(ev: Evidence, cause: str) -> str:
    tail = ""
    if ev.bisect is not None and ev.bisect.first_bad_layer is not None:
        first = ev.bisect.first_bad_layer  # hidden-state index: 0 is the embedding output
        tail = "; first wrong at the embedding" if first == 0 else f"; first wrong at layer {first - 1}"
    return f"{ev.where}: {cause}{tail}."
