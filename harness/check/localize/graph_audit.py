"""Every static buffer a CUDA-graph replay read (input_ids, positions,
seq_lens, kv_indptr, kv_indices, mask_indptr, custom_mask, the window mask of
a windowed model, out_cache_loc)
against what the eager forward of the same batch used; the batch-padding
dummies against SGLang's padding rule (seq_len 1, slot 0, position 0, a mask
that sees everything).

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

import torch

from harness.check.localize.wrong import Wrong, excerpt
from harness.engine.mem.allocator import PADDING_SLOT


def audit_graph(replay, req_to_token: torch.Tensor, step: int) -> list[Wrong]:
    live, meta, bucket = replay.live, replay.meta, replay.bucket
    bs, n = live.seq_lens.numel(), live.q_len
    t, dummies = bs * n, bucket - bs
    seq = torch.cat([live.seq_lens.cpu(), torch.ones(dummies, dtype=torch.int64)])
    a = live.attn
    kv_live = a.kv_indices.cpu()
    dummy_kv = torch.full((dummies,), int(req_to_token[0, 0]), dtype=torch.int64)
    static_kvp = meta.kv_indptr.cpu()
    buffers = [
        ("input_ids", torch.cat([live.input_ids.cpu(), torch.zeros(bucket * n - t, dtype=torch.int64)]),
         replay.input_ids.cpu()),
        ("positions", torch.cat([live.positions.cpu(), torch.zeros(bucket * n - t, dtype=torch.int64)]),
         replay.positions.cpu()),
        ("seq_lens", seq, static_kvp[1:] - static_kvp[:-1]),
        ("kv_indptr", torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64), seq]), 0), static_kvp),
        ("kv_indices", torch.cat([kv_live, dummy_kv]), meta.kv_indices.cpu()[:kv_live.numel() + dummies]),
        ("out_cache_loc", torch.cat([a.out_cache_loc.cpu(), torch.full((bucket * n - t,), PADDING_SLOT)]),
         meta.out_cache_loc.cpu()),
    ]
    if meta.mask_indptr is not None and a.mask_indptr is not None:
        want = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64), n * (seq + n)]), 0)
        buffers.append(("mask_indptr", want, meta.mask_indptr.cpu()))
    out = []
    for name, want, got in buffers:
        i, e, f, count = excerpt(want, got)
        if i is not None:
            part = "a live request's" if i < _live_len(name, bs, n, kv_live.numel()) else "a batch-padding dummy's"
            out.append(Wrong(step, "graph", name, None, i, e, f, count,
                             f"the bucket-{bucket} graph's static {name} differs from what eager used at {count} "
                             f"elements (first at {i}, {part}: {f[:1] or 'missing'}, eager {e[:1]})"))
    out += _mask(replay, step)
    out += _window_mask(replay, step)
    out += _max_kv_len(replay, step)
    return out


def _max_kv_len(replay, step: int) -> list[Wrong]:
    """The captured prefix bound (a host scalar frozen at capture) must cover every live prefix."""
    bound, seq = replay.meta.max_kv_len, replay.live.seq_lens.cpu()
    if bound is None or int(seq.max()) <= bound:
        return []
    b, over = int(seq.argmax()), int((seq > bound).sum())
    return [Wrong(step, "graph", "max_kv_len", None, b, int(seq.max()), bound, over,
                  f"the bucket-{replay.bucket} graph froze max_kv_len = {bound} at capture (a host scalar from the "
                  f"capturing batch) while request {b} of the batch has a prefix of {int(seq.max())}: prefix keys "
                  f"{bound}..{int(seq.max()) - 1} are never visited (requests past the bound: {over})", "stale-scalar")]


def _live_len(name: str, bs: int, n: int, kv: int) -> int:
    return {"seq_lens": bs, "kv_indptr": bs + 1, "mask_indptr": bs + 1, "kv_indices": kv}.get(name, bs * n)


def _against_eager(eager_mask: torch.Tensor, static_mask: torch.Tensor, need: int):
    """excerpt() of a graph's static mask (its first `need` elements) against the
    eager mask followed by the batch-padding dummies' all-ones blocks."""
    eager = eager_mask.cpu() != 0   # nonzero = visible (SGLang's reading, written here)
    # a static mask_indptr that ends before the eager mask does (its block sizes wrong) compares what it covers
    want = eager[:need] if need < eager.numel() else torch.cat([eager, torch.ones(need - eager.numel(),
                                                                                  dtype=torch.bool)])
    return excerpt(want.int(), (static_mask.cpu() != 0)[:need].int())


def _window_mask(replay, step: int) -> list[Wrong]:
    """The sliding layers' static mask against the eager window mask (dummies: all ones)."""
    live, meta = replay.live, replay.meta
    if live.attn.window_mask is None:
        return []
    if meta.window_mask is None:
        return [Wrong(step, "graph", "window_mask", None, None, "the window mask", None, 1,
                      f"the bucket-{replay.bucket} graph was captured with no window mask: its sliding layers read "
                      "the tree mask without the window", "captured-without-window")]
    need = int(meta.window_mask_indptr[-1])
    i, e, f, count = _against_eager(live.attn.window_mask, meta.window_mask, need)
    if i is None:
        return []
    return [Wrong(step, "graph", "window_mask", None, i, e, f, count,
                  f"the bucket-{replay.bucket} graph's static window mask differs from the eager one at {count} of "
                  f"{need} elements (first at {i}): the replay read a stale window", "stale")]


def _mask(replay, step: int) -> list[Wrong]:
    live, meta, bucket = replay.live, replay.meta, replay.bucket
    if live.attn.custom_mask is None:
        return []
    if meta.custom_mask is None:
        return [Wrong(step, "graph", "custom_mask", None, None, "the tree mask", None, 1,
                      f"the bucket-{bucket} graph was captured with no custom mask: its replay runs causal "
                      "attention and ignores the tree", "captured-causal")]
    need, have = int(meta.mask_indptr[-1]), meta.custom_mask.numel()
    if need > have:
        return [Wrong(step, "graph", "custom_mask", None, have, need, have, need - have,
                      f"the mask buffer handed to the kernel holds {have} elements but mask_indptr ends at {need}: "
                      f"the batch-padding requests' mask (elements {have}..{need - 1}) is read past its end",
                      "out-of-bounds")]
    live_need = live.attn.custom_mask.numel()
    if need < live_need:   # the static mask_indptr's blocks end inside the live requests' mask
        return [Wrong(step, "graph", "mask_indptr", None, need, live_need, need, live_need - need,
                      f"the bucket-{bucket} graph's static mask_indptr ends at {need}, before the live requests' "
                      f"mask does ({live_need} elements): its block sizes are not q_len * (prefix + q_len), so "
                      "rows read other rows' visibility")]
    if not replay.dummy_mask_refilled:   # the runner owes the dummies no mask: the live blocks only
        need = live_need
    i, e, f, count = _against_eager(live.attn.custom_mask, meta.custom_mask, need)
    if i is None:
        return []
    part = "a live request's" if i < live.attn.custom_mask.numel() else "a batch-padding dummy's"
    return [Wrong(step, "graph", "custom_mask", None, i, e, f, count,
                  f"the bucket-{bucket} graph's static mask differs from the eager mask at {count} of {need} "
                  f"elements (first at {i}, {part}): the replay read a stale mask", "stale")]
