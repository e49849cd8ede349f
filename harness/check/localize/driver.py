"""Re-run the engine deterministically up to the divergent round (same
settings, same seeds, same fault), auditing every round, then probe the
divergent batch and bisect the divergent node's layers.

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from harness.check.localize.attention_audit import audit_attention
from harness.check.localize.bookkeeping import audit_bookkeeping
from harness.check.localize.audits import (Finding, audit_acceptance, audit_batch_bonus, audit_inputs, audit_replay,
                                     audit_stop)
from harness.check.localize.explain import Evidence, classify, explanation
from harness.check.localize.graph_audit import audit_graph
from harness.check.localize.kv_audit import KVAudit, audit_cache, audit_invariants
from harness.check.localize.layer_bisect import bisect, capture_hidden
from harness.check.localize.mask_probe import diff_request, dummy_request, probe_visibility
from harness.check.localize.metadata_audit import audit_round
from harness.check.localize.model_audit import audit_expert_reads, audit_latents, audit_row_latents
from harness.check.localize.window_audit import audit_window
from harness.check.localize.wrong import Wrong
from harness.engine.attn.bounds import KernelBoundsError, check_kernel_reads


@dataclass(frozen=True)
class Localization:
    step: int
    request: int
    node: int
    depth: int | None
    fault_class: str
    explanation: str
    mask_probe: dict | None
    kv_audit: dict | None
    layer_bisect: dict | None
    graph_audit: list[str]
    stage: str | None = None          # the stage that produced the first wrong quantity (wrong.STAGE_WORDS), or None
    quantity: str | None = None       # the first wrong quantity (wrong.QUANTITIES when audited, else in words)
    first_wrong: dict | None = None   # Wrong.to_record() of it: expected and found values
    metadata_audit: list[dict] = ()   # every wrong quantity found up to the divergent round (first 24, in order)
    attention_audit: dict | None = None  # the backend on random inputs through the divergent batch's metadata
    kind: str = "localize"


def localize(p, first) -> Localization:
    """p: the run's Prepared (its engine already ran; a fresh engine over the
    same weights and pipeline is built);
    first: the run's FirstDivergence."""
    from harness.check.prepare import derive
    fresh = derive(p) if p.settings.tp == 1 else \
        derive(p, replace(p.settings, tp=1), tuple(p.prompts), p.engine.pipeline)  # --tp: replayed in one process
    engine, oracle, tol = fresh.engine, p.oracle, p.tolerance
    kv = KVAudit()
    node = first.node if first.what not in ("stream", "accept") else None
    ev = Evidence(where=_where(first), what=first.what, node=node, kv=kv)
    latent_seen: set[int] = set()   # requests whose first wrong latent is reported (model_audit)
    engine.rows = read = ReadAtVerify(engine.rows, engine.req_pool)
    for result in engine.rounds():
        replay = engine.graph.last if engine.graph is not None else None
        kernel_kv = replay.meta.kv_indices if replay is not None else result.batch.attn.kv_indices
        read_r2t = read.before   # [reqs, max_context] req_to_token as this round's verify read it
        audit_invariants(engine, result, kernel_kv, kv, read_r2t)
        bad_before = kv.first_bad_position
        audit_cache(engine, result, oracle, tol, kv)
        if bad_before is None and kv.first_bad_position is not None:
            ev.wrongs.append(_kv_cache_wrong(kv, result))
        ev.wrongs += audit_latents(engine, result, oracle, tol, latent_seen)
        ev.canary += list(result.provenance)
        ev.wrongs += audit_round(engine, result, oracle, read_r2t)
        ev.wrongs += audit_bookkeeping(engine, result)
        ev.wrongs += audit_window(engine, result)
        if replay is not None:
            ev.wrongs += audit_graph(replay, read_r2t if read_r2t is not None else engine.req_pool.req_to_token.cpu(),
                                     result.step)
        ev.accept = _first_named(ev.accept, audit_batch_bonus(result))
        for rs in result.requests:
            eos = engine.s.eos_id
            ev.accept = _first_named(ev.accept, audit_stop(rs, eos) or audit_acceptance(rs, eos)
                                     or _cross_check_finding(rs))
        if first.what == "accept" and result.step >= first.step and not _ambiguous(ev.accept):
            break   # an acceptance two mechanisms explain: later rounds may fit only one
        if first.what not in ("stream", "accept") and result.step == first.step:
            _at_divergence(engine, result, replay, first, oracle, tol, ev)
            break
    cause = classify(ev)
    d = ev.probe()
    ordered = sorted(ev.wrongs, key=Wrong.order)
    graph = [x.text for x in ordered if x.stage == "graph"][:24] or [f.text for f in ev.graph]
    return Localization(first.step, first.request, first.node, first.depth, cause.cls, explanation(ev, cause),
                        d.to_record() if d is not None else None, kv.to_record(),
                        ev.bisect.to_record() if ev.bisect is not None else None, graph,
                        cause.stage, cause.quantity, ordered[0].to_record() if ordered else None,
                        [x.to_record() for x in ordered[:24]],
                        next((x.to_record() for x in ev.wrongs if x.stage == "attention"), None))


class ReadAtVerify:
    """The engine's row-slots stage (round_stages.RowSlots) with req_to_token copied just before each commit:
    what the round's verify read. A paged commit moves a prefix's tail page into the winning branch's region,
    so after it req_to_token names other slots for those positions than the kernel was told to read."""

    def __init__(self, rows, req_pool) -> None:
        self.rows, self.req_pool = rows, req_pool
        self.before: torch.Tensor | None = None   # [reqs, max_context] as of the last commit's start

    def place(self, requests, trees):
        return self.rows.place(requests, trees)

    def commit(self, requests, trees, accs, rows) -> None:
        self.before = self.req_pool.req_to_token.cpu().clone()
        self.rows.commit(requests, trees, accs, rows)


def _kv_cache_wrong(kv: KVAudit, result) -> Wrong:
    """The KV audit's first wrong cache entry as a wrong quantity of the model stage."""
    rs = next(x for x in result.requests if x.rid == kv.first_bad_request)
    # positions committed before round 0 were written by the prefill and never checked; later a prefix
    # position was checked after the previous round, so a wrong one was clobbered during this round
    before = kv.first_bad_step == 0 and kv.first_bad_position < len(rs.prefix)
    return Wrong(kv.first_bad_step, "model", "kv_cache", kv.first_bad_request, kv.first_bad_position, 0.0,
                 kv.rel_err, 1, f"the cached K/V of position {kv.first_bad_position} (layer {kv.first_bad_layer}) "
                 f"is off the oracle's by {kv.rel_err:.2e} (relative) while its slot is the one req_to_token names"
                 + (", written by the prefill" if before else ""), "prefix" if before else "")


def _at_divergence(engine, result, replay, first, oracle, tol, ev: Evidence) -> None:
    vb = result.batch
    trees = [rs.tree for rs in result.requests]
    rids = [rs.rid for rs in result.requests]
    b = rids.index(first.request) if first.what != "batch-padding" else first.request
    ev.request_index = b
    if replay is not None:
        ev.graph = audit_replay(replay)
    meta = replay.meta if replay is not None else vb.attn
    cfg = engine.cfg
    rows = (replay.input_ids if replay is not None else vb.input_ids).numel()
    if not _follows_its_buffers(meta, rows, engine.pool.k_buffer[0].shape[0]):
        # the probe, the attention audit and the bisect walk the batch by its indptrs: a layout they cannot
        # follow is left to the metadata audit, which names the wrong quantity (it ran for this round above)
        ev.num_rows = trees[b].num_rows if b < len(trees) else 0
        return
    vis = probe_visibility(engine.backend, meta, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                           engine.s.torch_dtype, engine.s.device)
    att = audit_attention(engine.backend, meta, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, engine.s.device,
                          result.step, vis, layer_attn=engine.model.layer_attn[0])
    if att is not None:
        ev.wrongs.append(att)
    loc, qo, kvp = meta.out_cache_loc.cpu().tolist(), meta.qo_indptr.tolist(), meta.kv_indptr.tolist()
    kv_idx = meta.kv_indices.cpu().tolist()
    owned = _owned_slots(engine, result)
    for i, tree in enumerate(trees):
        if vis[i].effective.shape[0] != tree.q_len:
            continue
        slots = kv_idx[kvp[i]:kvp[i + 1]] + loc[qo[i]:qo[i + 1]]
        others = frozenset(s for j, own in enumerate(owned) if j != i for s in own) - owned[i]
        ev.probes.append(diff_request(i, vis[i], tree, slots, engine.backend.mask_regions, others))
    if first.what == "batch-padding":
        ev.probes.append(dummy_request(b, vis[b], kv_idx[kvp[b]:kvp[b + 1]] + loc[qo[b]:qo[b + 1]]))
        ev.num_rows = vis[b].effective.shape[0]
    else:
        ev.num_rows = trees[b].num_rows
        ev.inputs = audit_inputs(vb, trees).get(b)
    ev.wrongs += audit_expert_reads(engine, result, result.step, tol)
    hidden = capture_hidden(engine, result)   # rewrites the round's latents: the row audit reads them
    if first.what == "node" and not any(w.step == result.step and w.stage == "model" for w in ev.wrongs):
        ev.wrongs += audit_row_latents(engine, result, oracle, tol, b)
    row = qo[b] + first.node
    ref = None
    if first.what == "node":
        rs = result.requests[b]
        path = [rs.tree.tokens[a] for a in rs.tree.ancestors(first.node)]
        ref = oracle.path_hidden(list(rs.prefix) + path)
    ev.bisect = bisect(hidden, row, ref, tol)
    layer = ev.bisect.first_bad_layer
    if layer is not None and ref is not None:
        err = ev.bisect.rel_err_per_layer[layer]
        ev.wrongs.append(Wrong(result.step, "model", "hidden", first.request, layer, 0.0, err, 1,
                               f"the residual stream at node {first.node} leaves tolerance "
                               + ("at the embedding" if layer == 0 else f"after layer {layer - 1}")
                               + f" ({err:.2e} relative against the oracle's hidden state of the node's path)"))


def _follows_its_buffers(meta, rows: int, slots: int) -> bool:
    """Every indptr of the batch has an entry per request plus one and stays inside the buffer it indexes."""
    try:
        check_kernel_reads(meta, rows, slots)
    except KernelBoundsError:
        return False
    return True


def _owned_slots(engine, result) -> list[frozenset[int]]:
    """Per request of the batch: its committed prefix's slots and its verify rows' slots."""
    r2t = engine.req_pool.req_to_token.cpu()
    live = {r.rid: r for r in engine.requests if not r.finished}
    return [(frozenset(r2t[live[rs.rid].req_pool_idx, :len(rs.prefix)].tolist()) if rs.rid in live else frozenset())
            | frozenset(rs.row_slots) for rs in result.requests]


def _ambiguous(f: Finding | None) -> bool:
    return f is not None and f.kind == "accept-ambiguous"


def _first_named(seen: Finding | None, new: Finding | None) -> Finding | None:
    """The first acceptance finding, unless it is ambiguous and a later one is not."""
    if seen is None or (_ambiguous(seen) and new is not None and new.kind not in ("accept-ambiguous", "accept-rows",
                                                                                  "accept-mismatch")):
        return new or seen
    return seen


def _cross_check_finding(rs) -> Finding | None:
    """The acceptor that drove the run and the cross-checked one disagree."""
    if rs.cross_check is None or rs.cross_check == rs.acceptance:
        return None
    a, c = rs.acceptance, rs.cross_check
    return Finding("accept-mismatch", f"step {rs.step}, request {rs.rid}: the acceptance stages disagree: "
                                      f"rows {list(a.rows)} bonus {a.bonus} against rows {list(c.rows)} bonus {c.bonus}")


def _where(first) -> str:
    if first.what == "accept":
        return f"step {first.step}, request {first.request}, acceptance"
    if first.what == "stream":
        return f"request {first.request}, emitted token {first.node}"
    if first.what == "provenance":
        return f"step {first.step}, request {first.request}, KV provenance"
    if first.what == "batch-padding":
        return f"step {first.step}, graph batch-padding request {first.request}, row {first.node}"
    if first.what == "padding":
        return f"step {first.step}, request {first.request}, padding row {first.node}"
    return f"step {first.step}, request {first.request}, node {first.node} (depth {first.depth})"
