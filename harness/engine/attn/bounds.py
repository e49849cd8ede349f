"""What SGLang's extend kernels read, checked against the buffers they read it
from, before an interpreted launch. Under the Triton interpreter a load past a
buffer is a raw read of the process's memory: the run dies with signal 11 or
6 (or corrupts its heap) and leaves no records. Metadata that would make the
kernel read outside its buffers is raised here instead, as an exception of
the engine's adapter: an engine crash with a verdict, which the localizer's
crash audit then explains by the wrong quantity (harness/check/localize/crash_audit.py).
Not on CUDA: the checks read the metadata on the host, which a graph capture forbids.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

import torch

from harness.engine.ddtree.verify_inputs import AttnMetadata


class KernelBoundsError(ValueError):
    """The metadata would make the kernel read outside one of its buffers."""


def room(t: torch.Tensor) -> int:
    """Elements the kernel can read from t's data pointer on: its storage's, not its shape's (a buffer
    re-declared shorter over the same storage, as the graph runner's are, is read past its end
    harmlessly; that is a wrong value, a divergence, not a dead process)."""
    return t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()


def readable(t: torch.Tensor, n: int) -> torch.Tensor:
    """The first n elements the kernel reads from t's pointer  # [n]; the caller checked room(t) >= n."""
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), (n,), (1,))


def _indptr(name: str, t: torch.Tensor | None, bs: int, end: int, end_name: str) -> list[int]:
    if t is None or t.dim() != 1 or not t.is_contiguous() or room(t) < bs + 1:
        got = "none" if t is None else f"shape {list(t.shape)}"
        raise KernelBoundsError(f"{name} must hold {bs + 1} entries for a batch of {bs} requests, got {got}: the "
                                f"kernel would read past it")
    v = readable(t, bs + 1).tolist()
    if v[0] < 0 or any(b < a for a, b in zip(v, v[1:])) or v[-1] > end:
        raise KernelBoundsError(f"{name} {v[:8]} is not a non-decreasing index into the {end} entries of "
                                f"{end_name}: the kernel would read outside it")
    return v


def check_kernel_reads(meta: AttnMetadata, q_rows: int, num_slots: int) -> None:
    """Every index SGLang's extend kernels follow lands inside its buffer: the query rows through
    qo_indptr, the prefix slots through kv_indptr / kv_indices, the mask blocks through mask_indptr,
    the rows' own slots (out_cache_loc, which the unified kernel reads keys through)."""
    bs = meta.batch_size
    if bs < 1:
        raise KernelBoundsError(f"qo_indptr {meta.qo_indptr.tolist()} describes no request")
    qo = _indptr("qo_indptr", meta.qo_indptr, bs, q_rows, "the query rows")
    kvp = _indptr("kv_indptr", meta.kv_indptr, bs, room(meta.kv_indices), "kv_indices")
    used = readable(meta.kv_indices, kvp[-1])[kvp[0]:]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_slots):
        raise KernelBoundsError(f"kv_indices hold slot {int(used.min())}..{int(used.max())} outside the pool's "
                                f"{num_slots} slots: the kernel would read outside the KV buffers")
    loc = meta.out_cache_loc
    if loc.numel() < qo[-1] or (loc.numel() and (int(loc.min()) < 0 or int(loc.max()) >= num_slots)):
        raise KernelBoundsError(f"out_cache_loc ({loc.numel()} slots for {qo[-1]} rows) points outside the pool's "
                                f"{num_slots} slots")
    for mask, indptr, name in ((meta.custom_mask, meta.mask_indptr, "mask_indptr"),
                               (meta.window_mask, meta.window_mask_indptr, "window_mask_indptr")):
        if mask is None:
            continue
        mp = _indptr(name, indptr, bs, room(mask), "the flat mask")
        for b in range(bs):
            ext, pre = qo[b + 1] - qo[b], kvp[b + 1] - kvp[b]
            if mp[b] + ext * (pre + ext) > room(mask):
                raise KernelBoundsError(f"request {b}'s mask block ({ext} rows x {pre + ext} keys from {name} "
                                        f"{mp[b]}) ends past the flat mask's {room(mask)} entries")
