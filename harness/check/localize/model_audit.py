"""Audits of DeepSeek-V3's layout (issue 24), run by the localizer next to
the KV audit: the latent pool against the oracle's latents, and the experts'
reads against the rows they belong to.

- audit_latents (every round): each committed position's cached latent (its
  slot as req_to_token names it) against the oracle's path_latent. A wrong
  one is named by what it holds: the oracle's latent of another committed
  position (written to the wrong slot), or the right latent with its RoPE key
  turned by a whole number of positions too far (rotated at another index
  than prefix + depth).
- audit_expert_reads (the divergent round): the round's forward again with
  every padding row's token changed; a real row's MoE output that moves
  while its MoE input does not read another row's hidden state.

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

import torch

from harness.check.localize.wrong import Wrong
from harness.engine.model.mla import rope_interleaved
from harness.engine.model.stages import padding_rows

MAX_SHIFT = 64   # the farthest rotation offset tried, in positions


def audit_latents(engine, result, oracle, tol: float, seen: set) -> list[Wrong]:
    """The first wrong latent of each request (once per request and run: `seen` holds the rids reported)."""
    path_latent = getattr(oracle, "path_latent", None)
    if engine.cfg.mla is None or path_latent is None:
        return []
    live = {r.rid: r for r in engine.requests if not r.finished}
    out = []
    for rs in result.requests:
        r = live.get(rs.rid)
        if r is None or rs.rid in seen:
            continue
        tokens = r.committed_tokens()
        slots = engine.req_pool.req_to_token[r.req_pool_idx, :len(tokens)].cpu()
        want = path_latent(tokens).double()                                      # [L, T, rank+rope]
        for layer in range(want.shape[0]):
            got = engine.pool.k_buffer[layer][slots.to(engine.pool.k_buffer[layer].device)][:, 0].double().cpu()
            scale = max(float(want[layer].abs().max()), 1e-30)
            err = (got - want[layer]).abs().amax(-1) / scale                      # [T]
            bad = (~(err <= tol)).nonzero().flatten()
            if bad.numel():
                seen.add(rs.rid)
                out.append(_named(engine, result.step, rs, int(bad[0]), layer, got, want[layer], scale, tol,
                                  float(err[bad[0]]), len(rs.prefix)))
                break
    return out


def _named(engine, step, rs, pos, layer, got, want, scale, tol, err, old) -> Wrong:
    """A committed position's wrong latent, named by what it holds (another position's latent, a turned RoPE key)."""
    where = f"the cached latent of position {pos} (layer {layer}, slot from req_to_token)"
    others = [(f"position {q}", want[q]) for q in range(want.shape[0]) if q != pos]
    return name_latent(engine, step, rs.rid, pos, where, got[pos], want[pos], pos, others, scale, tol, err,
                       "prefix" if pos < old and step == 0 else "")


def name_latent(engine, step, rid, index, where, got, want, position, others, scale, tol, err, plain_hint="") -> Wrong:
    """got, want  # [rank+rope] one latent; others: (label, latent) it might hold instead."""
    rank = engine.cfg.mla.kv_lora_rank
    held = next((label for label, o in others if float((got - o).abs().max()) / scale <= tol), None)
    if held is not None:
        return Wrong(step, "model", "kv_cache", rid, index, where, held, 1,
                     f"{where} is the oracle's latent of {held}: a verify row's latent was written to another "
                     "row's slot", "latent-wrong-slot")
    shift = None
    if float((got[:rank] - want[:rank]).abs().max()) / scale <= tol:
        shift = _rope_shift(engine, got[rank:], want[rank:], position, scale, tol)
    if shift is not None:
        return Wrong(step, "model", "kv_cache", rid, index, position, position + shift, 1,
                     f"{where} holds the right compressed latent but its RoPE key is turned at position "
                     f"{position + shift}, not {position} ({shift:+d}): the latent's rotation took another index "
                     "than prefix + depth", "latent-rope-position")
    return Wrong(step, "model", "kv_cache", rid, index, 0.0, err, 1,
                 f"{where} is off the oracle's by {err:.2e} (relative)", plain_hint)


def audit_row_latents(engine, result, oracle, tol: float, b: int) -> list[Wrong]:
    """The divergent request's verify rows' latents at their out_cache_loc slots, as the round's forward
    (re-run by the bisect) wrote them, against the oracle's latent of each row's path."""
    path_latent = getattr(oracle, "path_latent", None)
    if engine.cfg.mla is None or path_latent is None:
        return []
    rs, q = result.requests[b], result.batch.q_len
    tree, prefix = rs.tree, list(rs.prefix)
    loc = result.batch.attn.out_cache_loc[b * q:b * q + tree.num_rows]                 # [rows]
    wants = [path_latent(prefix + [tree.tokens[a] for a in tree.ancestors(i)])[:, -1].double()
             for i in range(tree.num_rows)]                                            # each [L, rank+rope]
    for layer in range(len(engine.pool.k_buffer)):
        got = engine.pool.k_buffer[layer][loc.to(engine.pool.k_buffer[layer].device)][:, 0].double().cpu()
        scale = max(max(float(w[layer].abs().max()) for w in wants), 1e-30)
        for i in range(tree.num_rows):
            err = float((got[i] - wants[i][layer]).abs().max()) / scale
            if not err <= tol:
                others = [(f"row {j}", wants[j][layer]) for j in range(tree.num_rows) if j != i]
                where = f"verify row {i}'s latent (depth {tree.depths[i]}, layer {layer}, its out_cache_loc slot)"
                return [name_latent(engine, result.step, rs.rid, i, where, got[i], wants[i][layer],
                                    len(prefix) + tree.depths[i], others, scale, tol, err)]
    return []


def _rope_shift(engine, got_pe, want_pe, pos, scale, tol) -> int | None:
    """The offset d != 0 for which want_pe turned d positions further is got_pe (the engine's frequencies)."""
    inv_freq = engine.model.inv_freq.double().cpu()                               # [rope/2]
    for d in sorted(range(-MAX_SHIFT, MAX_SHIFT + 1), key=abs):
        if d == 0 or pos + d < 0:
            continue
        ang = d * inv_freq[None, None]                                            # [1, 1, rope/2], a pure turn
        turned = rope_interleaved(want_pe[None, None], ang.cos(), ang.sin())
        if float((turned.flatten() - got_pe).abs().max()) / scale <= tol:
            return d
    return None


def audit_expert_reads(engine, result, step: int, tol: float) -> list[Wrong]:
    """A real row's MoE output that depends on the padding rows' tokens (beyond `tol`, relative: the experts'
    GEMMs round differently over other row sets) while its MoE input does not."""
    if engine.cfg.moe is None:
        return []
    vb = result.batch
    pad = padding_rows(vb.positions, vb.attn)
    if not bool(pad.any()):
        return []
    changed = vb.input_ids.clone()
    changed[pad] = (changed[pad] + 1) % engine.cfg.vocab_size
    base, alt = _mlp_trace(engine, vb.input_ids, vb), _mlp_trace(engine, changed, vb)
    real = (~pad).nonzero().flatten()
    for layer, ((x0, y0), (x1, y1)) in enumerate(zip(base, alt)):
        if _moved(x0[real], x1[real], tol).any():
            return []   # the rows' inputs moved first: attention or earlier, not the experts' reads
        moved = real[_moved(y0[real], y1[real], tol)]
        if moved.numel():
            row = int(moved[0])
            b, j = divmod(row, vb.q_len)
            return [Wrong(step, "model", "hidden", result.requests[b].rid, layer, "its own hidden state",
                          "a padding row's", int(moved.numel()),
                          f"layer {layer}'s experts give verify row {j} of request {result.requests[b].rid} another "
                          "output when only the padding rows' tokens change, its own input unchanged: the expert "
                          "dispatch reads a padding row's hidden state", "moe-padding-dispatch")]
    return []


def _moved(a: torch.Tensor, b: torch.Tensor, tol: float) -> torch.Tensor:
    """[rows] bool: the row of b differs from a's by more than tol relative to a's largest entry."""
    scale = max(float(a.abs().max()), 1e-30)
    return (a.double() - b.double()).abs().amax(-1) / scale > tol


def _mlp_trace(engine, ids, vb) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(MLP input, MLP output) per layer of one forward of the batch, on a copy of the KV pool."""
    model, pool = engine.model, engine.pool
    saved = [k.clone() for k in pool.k_buffer], [v.clone() for v in pool.v_buffer]
    trace, layers = [], model.mlp_layers

    def traced(f):
        def call(m, x, positions, meta):
            y = f(m, x, positions, meta)
            trace.append((x.detach().clone(), y.detach().clone()))
            return y
        return call
    model.mlp_layers = [traced(f) for f in layers]
    try:
        model.forward(ids, vb.positions, vb.attn, pool, engine.backend)
    finally:
        model.mlp_layers = layers
        for buf, old in zip(pool.k_buffer + pool.v_buffer, saved[0] + saved[1]):
            buf.copy_(old)
    return trace
