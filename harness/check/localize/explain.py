"""From evidence to a cause: the first wrong quantity, the stage that
produced it, what was measured, and only then a class.

The audits (metadata_audit, graph_audit, attention_audit, the KV audit and
the bisect) report every quantity that breaks its rule as a Wrong; the
first in step then pipeline order leads. The measured rules below (the mask
probe, the graph and input findings, the acceptance) go from the most
specific measurement to the most generic; their class is kept only when
they point at the same stage as that first wrong quantity. A class from the
fault catalog is named only when the measurement is the one that fault
leaves; otherwise the class names what was measured (mask-visibility,
kv-indices, ...), and "unknown" when nothing measured points anywhere.

`inverted-mask` is a rule of its own: the mask as the kernel reads it
(custom_mask != 0 = visible) is the complement of the reference ancestor
mask on at least 90% of the real (row, key) entries (INVERTED_SHARE in
harness/ports/audit.py, the one rule for the audit, the metadata audit and
the probe). It measures; no adapter repairs the mask to reach it.

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass, field

from harness.check.localize.audits import Finding, ranges
from harness.check.localize.kv_audit import KVAudit
from harness.check.localize.layer_bisect import Bisect
from harness.check.localize.mask_probe import (MaskDiff, derived_parents, flat_shift_explains, row_stride_explains,
                                         visibility_changes)
from harness.check.localize.wrong import STAGE_WORDS, Wrong, first_wrong
from harness.ports.audit import is_inverted

STAGES = tuple(STAGE_WORDS.values())
# the classes the fault catalog expects (harness/faults/catalog.py; a unit test keeps them equal)
CATALOG_CLASSES = ("padding-leak", "mask-shift", "batch-mask-layout", "mask-out-of-bounds", "graph-causal-mask",
                   "stale-graph-mask", "stale-kv-indices", "kv-not-compacted", "fully-masked-row", "node-order",
                   "wrong-position", "slot-alias", "wrong-bonus", "free-slot-read", "position-offset",
                   "stale-graph-positions", "mask-of-other-request", "bonus-cross-request", "token-shadowed",
                   "commit-past-stop", "padded-entry-live", "stale-graph-scalar",
                   "accept-topology-mismatch", "sinks-first-row-only", "swa-window-row-index",
                   "swa-window-ignored")
# paged KV (page size > 1): named from the per-token commit audit and the rows' slots (localize/paged_audit.py)
CATALOG_CLASSES += ("kv-compaction-permuted", "branch-shared-tail")
# --tp: named by the ranks' agreement audit (harness/engine/tp/audit.py), not by the replay
CATALOG_CLASSES += ("rank-stale-mask", "rank-kv-indices", "kv-heads-sharded")
# DeepSeek-V3's layout: named from the latent pool and the experts' reads (localize/model_audit.py)
CATALOG_CLASSES += ("latent-rope-position", "latent-wrong-slot", "moe-padding-dispatch")
# what was measured, when no catalog fault leaves that measurement
MEASURED_CLASSES = ("window-mask",   # the sliding layers' mask breaks the window rule, no single pattern
                    "inverted-mask",  # the mask as the kernel reads it is the complement of the ancestor mask
                    "mask-visibility", "kv-indices", "input-tokens", "input-order", "accept-mismatch", "wrong-kv", "kv-provenance",
                    "sinks-dropped", "softcap-dropped", "unknown")
CLASSES = CATALOG_CLASSES + MEASURED_CLASSES


@dataclass(frozen=True)
class Cause:
    cls: str              # one of CLASSES
    quantity: str         # the first wrong quantity, in the domain's words
    stage: str | None     # one of STAGES; None when nothing measured points at one
    text: str             # what was measured


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


def classify(ev: Evidence) -> Cause:
    """The first wrong quantity, its stage, what was measured and the class."""
    measured = _classify_measured(ev)
    w = first_wrong(ev.wrongs)
    if w is None:
        return measured
    stage = STAGE_WORDS[w.stage]
    agrees = measured.stage == stage
    # a class the audit's hint decides (e.g. batch-mask-layout only for a rectangle mask_indptr) is never taken
    # from a measured rule that only saw the probe
    kept = agrees and measured.cls not in HINTED_CLASSES and measured.cls != "unknown"
    if kept and measured.cls in CATALOG_CLASSES:   # a catalogued pattern no hint covers (e.g. position-offset)
        cls = measured.cls
    else:
        cls = match_catalog(w, ev) or (measured.cls if kept else "unknown")
    where = f"step {w.step}" + (f", request {w.request}" if w.request is not None and w.stage != "attention" else "")
    text = f"{w.text} ({where})"
    if (kept or cls == measured.cls) and measured.text not in text:
        text += f"; {measured.text}"
    return Cause(cls, w.quantity, stage, text)


# the audits' hints: (stage, quantity, hint) of a first wrong quantity -> the catalog class that leaves it
HINTS = {("graph", "custom_mask", "captured-causal"): "graph-causal-mask",
         ("graph", "custom_mask", "out-of-bounds"): "mask-out-of-bounds",
         ("graph", "custom_mask", "stale"): "stale-graph-mask",
         ("graph", "kv_indices", ""): "stale-kv-indices",
         ("graph", "max_kv_len", "stale-scalar"): "stale-graph-scalar",
         ("build_mask", "custom_mask", "padding-leak"): "padding-leak",
         ("build_mask", "custom_mask", "inverted"): "inverted-mask",
         ("build_mask", "custom_mask", "padding-empty"): "fully-masked-row",
         ("build_mask", "custom_mask", "row-stride"): "mask-shift",
         ("build_mask", "mask_indptr", "rectangle"): "batch-mask-layout",
         # the window audit: the sliding layers' mask against the window rule by position (window_audit)
         ("build_mask", "window_mask", "row-index"): "swa-window-row-index",
         ("build_mask", "window_mask", "ignored"): "swa-window-ignored",
         ("build_mask", "window_mask", ""): "window-mask",
         ("build_verify_batch", "positions", "row-index"): "wrong-position",
         ("build_verify_batch", "out_cache_loc", "padding-alias"): "slot-alias",
         ("commit", "req_to_token", "contiguous"): "kv-not-compacted",
         ("commit", "free_slots", "committed-freed"): "free-slot-read",
         ("attention", "sinks", "first-row-only"): "sinks-first-row-only",
         ("attention", "sinks", ""): "sinks-dropped",
         ("attention", "logit_cap", "first-row-only"): "softcap-dropped",
         ("attention", "logit_cap", ""): "softcap-dropped",
         ("accept", "bonus", ""): "wrong-bonus",
         ("accept", "bonus", "cross-check"): "accept-mismatch",
         ("accept", "accepted_rows", "cross-check"): "accept-mismatch",
         ("commit", "req_to_token", "page-permuted"): "kv-compaction-permuted",
         ("build_verify_batch", "out_cache_loc", "shared-tail"): "branch-shared-tail",
         ("model", "kv_cache", "latent-rope-position"): "latent-rope-position",
         ("model", "kv_cache", "latent-wrong-slot"): "latent-wrong-slot",
         ("model", "hidden", "moe-padding-dispatch"): "moe-padding-dispatch"}
HINTED_CLASSES = frozenset(HINTS.values()) | {"node-order"}


def match_catalog(w: Wrong, ev: Evidence) -> str | None:
    """The catalog class whose pattern this first wrong quantity shows, if any."""
    if (w.stage, w.quantity, w.hint) == ("build_verify_batch", "input_ids", "permuted"):
        d = ev.probe()
        parents = derived_parents(d, ev.num_rows) if d is not None else None
        return "node-order" if parents is None or any(par > row for row, par in enumerate(parents)) else None
    if w.stage == "graph" and w.quantity == "kv_indices" and any(x.stage == "graph" and x.quantity == "kv_indptr"
                                                                 and x.step == w.step for x in ev.wrongs):
        return None   # the offsets are wrong too: not a buffer left unrefilled
    if (w.stage, w.quantity, w.hint) == ("model", "hidden", ""):   # the bisect's node: a same-round model audit
        named = next((HINTS[k] for x in ev.wrongs if x.step == w.step and x.stage == "model" and x.hint
                      and (k := ("model", x.quantity, x.hint)) in HINTS), None)  # (model_audit) may name why
        if named is not None:
            return named
    # a port that builds its mask inside its verify-input step produces the mask there: same pattern
    in_inputs = w.stage == "build_verify_batch" and w.quantity in ("custom_mask", "mask_indptr")
    stage = "build_mask" if in_inputs else w.stage
    return HINTS.get((stage, w.quantity, w.hint))


def _classify_measured(ev: Evidence) -> Cause:
    """What the mask probe, the graph and input findings and the KV audit measured."""
    kinds = {f.kind: f for f in ev.graph}
    for kind, cls, quantity, stage in (
            ("captured-causal", "graph-causal-mask", "the replay's attention mask", "graph"),
            ("mask-out-of-bounds", "mask-out-of-bounds", "the graph's mask buffer (length)", "graph"),
            ("stale-kv-indices", "stale-kv-indices", "the graph's static kv_indices", "graph"),
            ("stale-mask", "stale-graph-mask", "the graph's static mask buffer", "graph"),
            ("stale-positions", "stale-graph-positions", "the graph's static positions buffer", "graph")):
        if kind in kinds:
            return Cause(cls, quantity, stage, kinds[kind].text + _probe_note(ev.probe()))
    shared = next((f for f in ev.canary if f.kind == "padding-write"), None)
    if shared is not None:
        return Cause("padded-entry-live", "the graph's batch-padding entries (out_cache_loc)", "graph",
                     f"{shared.text}: the batch-padding entries carry a live request's out_cache_loc (and "
                     "seq_len, positions) instead of the padding slot, so their dummy K/V overwrite that request's")
    free = next((f for f in ev.canary if f.kind == "free-slot"), None)
    if free is not None:
        return Cause("free-slot-read", "kv_indices (a freed slot)", "commit",
                     f"{free.text}: kv_indices reach a freed slot, whose K/V any later allocation may overwrite "
                     "(poisoned free slots show it in the logits, even under a zero weight)")
    kv = ev.kv.kinds()
    if "referenced-free" in kv:
        return Cause("free-slot-read", "req_to_token (a freed slot)", "commit",
                     f"{_violation(ev.kv, 'referenced-free')}: the commit freed a slot a committed position still "
                     "points at, so the next verify's kv_indices reach a freed slot")
    d = ev.probe()
    if d is not None and d.empty_rows and not (d.leaked or d.blocked):
        pad = [r for r in d.empty_rows if r >= ev.num_rows]
        kind = "padding rows" if len(pad) == len(d.empty_rows) else "rows"
        return Cause("fully-masked-row", "the verify mask (rows with no visible key)", "mask",
                     f"{kind} {ranges(d.empty_rows)} see no key at all (not even their diagonal): the softmax "
                     "divides 0 by 0, their output is NaN, and the NaN K/V they write reaches every row of the "
                     "next layer through 0 x NaN")
    if ev.inputs is not None and ev.inputs.kind == "permuted" and d is not None:
        parents = derived_parents(d, ev.num_rows)
        if parents and any(par > row for row, par in enumerate(parents)):
            bad = [(row, par) for row, par in enumerate(parents) if par > row]
            return Cause("node-order", "the verify rows' order (input_ids, positions and mask)", "verify inputs",
                         f"{ev.inputs.text}; the applied mask is the tree's under a renumbering in which row "
                         f"{bad[0][0]}'s parent is row {bad[0][1]}: children numbered before parents")
    if ev.inputs is not None and ev.inputs.kind == "positions":
        return Cause("wrong-position", "positions", "verify inputs", ev.inputs.text)
    if ev.inputs is not None and ev.inputs.kind == "positions-offset":
        return Cause("position-offset", "positions", "verify inputs", ev.inputs.text)
    if ev.inputs is not None:
        tokens = ev.inputs.kind == "tokens"
        return Cause("input-tokens" if tokens else "input-order",
                     "input_ids" if tokens else "the verify rows' (token, position) order", "verify inputs",
                     ev.inputs.text)
    if "alias" in kv:
        return Cause("slot-alias", "out_cache_loc", "verify inputs",
                     f"{_violation(ev.kv, 'alias')}; the padding rows' write clobbers those nodes' K/V")
    if "commit" in kv:
        return Cause("kv-not-compacted", "req_to_token (after the commit)", "commit",
                     f"{_violation(ev.kv, 'commit')}: accepted KV not re-pointed")
    if "kv_indices" in kv:
        return Cause("kv-indices", "kv_indices", "verify inputs",
                     f"{_violation(ev.kv, 'kv_indices')}: the kernel read other slots than the request's committed "
                     "positions")
    if d is not None and (d.leaked or d.blocked):
        return _classify_mask(ev, d)
    if ev.accept is not None:
        cls = {"wrong-bonus": "wrong-bonus", "accept-mismatch": "accept-mismatch", "token-shadowed": "token-shadowed",
               "bonus-cross-request": "bonus-cross-request",
               "past-stop": "commit-past-stop", "topology": "accept-topology-mismatch"}.get(ev.accept.kind, "unknown")
        quantity = {"wrong-bonus": "the bonus token", "bonus-cross-request": "the bonus token",
                    "past-stop": "the accepted rows (past the end-of-sequence token)"}.get(ev.accept.kind,
                                                                                          "the accepted rows")
        return Cause(cls, quantity, "accept", ev.accept.text)
    if ev.kv.first_bad_position is not None:
        return Cause("wrong-kv", "the cached K/V", "model", "the cached K/V is wrong (no slot bookkeeping "
                     "invariant is broken: the forward wrote wrong values)")
    return Cause("unknown", "unknown", None, "no audit, probe or bisect pinned a cause")


def _violation(kv: KVAudit, kind: str) -> str:
    v = next(v for v in kv.violations if v.kind == kind)
    return f"step {v.step}: {v.text}"


def _classify_mask(ev: Evidence, d: MaskDiff) -> Cause:
    roles = d.key_roles
    changes = visibility_changes(d)
    quantity = "the verify mask (effective visibility)"
    inverted, total = _inverted_pairs(d, ev.num_rows)
    if is_inverted(inverted, total):
        return Cause("inverted-mask", quantity, "mask",
                     f"the mask probe measured the visibility the kernel applied as the complement of the tree's "
                     f"ancestor mask on the real rows ({inverted} of {total} (row, key) pairs of the real rows): "
                     f"each row sees the keys off its root path; {changes}")
    if d.leaked and not d.blocked and all(roles[c].startswith("padding") for _, c in d.leaked):
        return Cause("padding-leak", quantity, "mask", f"{_leak_sentence(ev, d)}; {changes}")
    other = _other_requests_tree(ev, d)
    if other is not None:
        return Cause("mask-of-other-request", quantity, "mask",
                     f"request {d.request}'s rows see exactly request {other.request}'s tree (its draft part is that "
                     f"request's ancestor mask): the mask blocks are filled in another request order; {changes}")
    if len(ev.probes) > 1:
        longest = max(x.prefix_len for x in ev.probes)
        ok = [x.request for x in ev.probes if not (x.leaked or x.blocked)]
        if ok and all((x.prefix_len == longest) == (x.request in ok) for x in ev.probes):
            return Cause("batch-mask-layout", quantity, "mask",
                         f"requests {ok} (the longest prefix, {longest}) see exactly their tree, every other "
                         f"request's rows are shifted: the batch mask is laid out for max_prefix + q_len, not per "
                         f"request; in request {d.request}, {changes}")
    empty = f"; rows {ranges(d.empty_rows)} see no key" if d.empty_rows else ""
    w = row_stride_explains(d, ev.num_rows)
    if w is not None:
        return Cause("mask-shift", quantity, "mask",
                     f"the applied mask is the tree's rows written at stride prefix + {w} and read at prefix + "
                     f"{d.expected.shape[0]}: the mask rows are shifted{empty}; {changes}")
    s = flat_shift_explains(d, ev.num_rows)
    if s is not None:
        return Cause("mask-shift", quantity, "mask",
                     f"the applied mask is the tree's mask moved by {s} elements along the flat buffer the kernel "
                     f"reads{empty}; {changes}")
    return Cause("mask-visibility", quantity, "mask", f"{changes}{empty}")


def _inverted_pairs(d: MaskDiff, real: int) -> tuple[int, int]:
    """(pairs whose applied visibility is the complement of the expected one, real x real)
    over the real rows' draft keys."""
    p = d.prefix_len
    got, want = d.effective[:real, p:p + real], d.expected[:real, p:p + real]   # [real, real] bool
    return int((got == ~want).sum()), real * real


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


def kv_notes(kv: KVAudit, quoted: str = "", limit: int = 3) -> str:
    """The KV audit's findings not already in `quoted`: its invariant
    violations (first of each kind) and the first wrong cache entry."""
    seen, notes = set(), []
    for v in kv.violations:
        text = f"step {v.step}: {v.text}"
        if v.kind not in seen and text not in quoted:
            notes.append(text)
        seen.add(v.kind)
    extra = len(notes) - limit
    out = notes[:limit] + ([f"{extra} more kinds"] if extra > 0 else [])
    if kv.first_bad_position is not None:
        held = ("K/V that matches no committed position" if kv.held_position is None
                else f"position {kv.held_position}'s K/V")
        slot = f" (slot {kv.first_bad_slot})" if kv.first_bad_slot is not None else ""
        out.append(f"first wrong cache entry: step {kv.first_bad_step}, request {kv.first_bad_request}, position "
                   f"{kv.first_bad_position}{slot}, layer {kv.first_bad_layer}, holds {held}")
    return "; KV audit: " + "; ".join(out) if out else ""


def explanation(ev: Evidence, cause: Cause) -> str:
    """First wrong quantity and stage, then what was measured, then the
    catalog class if one matches."""
    tail = ""
    if ev.bisect is not None and ev.bisect.first_bad_layer is not None:
        first = ev.bisect.first_bad_layer  # hidden-state index: 0 is the embedding output
        tail = "; first wrong at the embedding" if first == 0 else f"; first wrong at layer {first - 1}"
    if cause.stage is None:
        head = f"First wrong quantity: unknown at {ev.where}"
    else:
        head = f"First wrong quantity: {cause.quantity}, produced by the {cause.stage} stage, at {ev.where}"
    catalog = f" Catalog class: {cause.cls}." if cause.cls in CATALOG_CLASSES else ""
    return f"{head}: {cause.text}{tail}{kv_notes(ev.kv, cause.text)}.{catalog}"
