"""CUDA-graph runner with SGLang's semantics: one capture per batch-size
bucket at width q_len, static input buffers sized at capture and refilled in
place before each replay, batches padded to their bucket with dummy requests
(seq_len 1, request 0). Python-level choices are frozen at capture.

On CUDA it records a torch.cuda.CUDAGraph. On CPU it replays the captured
closure over the same static buffers, so stale-buffer and bucket bugs behave
as they would on a GPU.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from harness.engine.mem.allocator import PADDING_SLOT
from harness.engine.ddtree.verify_inputs import AttnMetadata, VerifyBatch
from harness.engine.ddtree.mask import kernel_visible


@dataclass(frozen=True)
class GraphOptions:
    """Switches a fault may flip; the defaults are SGLang's correct behaviour."""

    capture_custom_mask: bool = True    # False: captured causal, the tree is ignored at replay
    refill_mask: bool = True
    refill_kv_indices: bool = True
    refill_positions: bool = True
    mask_buffer_for_bucket: bool = True  # False: the kernel is handed a mask declared with the live
                                         # batch's length, shorter than mask_indptr[-1] under batch
                                         # padding (SGLang issue 6309); it reads past the end
    max_kv_len_at_capacity: bool = True  # False: the captured max_kv_len scalar is the capturing batch's
                                         # longest prefix; later, longer prefixes lose their tail keys
    dummy_padding_entries: bool = True   # False: batch-padding entries repeat the last live request's
                                         # seq_len, kv_indices, positions and out_cache_loc, so their
                                         # K/V writes land in that request's slots


def capture_buckets(max_bs: int) -> list[int]:
    """Powers of two up to the first >= max_bs (batch 3 runs in bucket 4, as
    SGLang's capture list pads it)."""
    buckets = [1]
    while buckets[-1] < max_bs:
        buckets.append(buckets[-1] * 2)
    return buckets


@dataclass(frozen=True)
class Replay:
    """What the last replay ran: the live batch and the bucket's static
    metadata as the kernel read it (for localization)."""

    bucket: int
    live: VerifyBatch
    meta: AttnMetadata             # the static buffers (valid until the next replay)
    input_ids: torch.Tensor        # [bucket*q_len] static
    positions: torch.Tensor        # [bucket*q_len] static
    logits: torch.Tensor           # [bucket*q_len, vocab] every row, batch-padding dummies too
    # the batch-padding requests' mask blocks are refilled all ones (ddcheck's runner, SGLang's FIXME in the
    # FlashInfer path); False: the runner leaves them as the buffer holds them (SGLang's Triton verify path)
    dummy_mask_refilled: bool = True


@dataclass
class _Static:
    input_ids: torch.Tensor     # [bucket*q_len]
    positions: torch.Tensor     # [bucket*q_len]
    out_cache_loc: torch.Tensor  # [bucket*q_len]
    kv_indptr: torch.Tensor     # [bucket+1]
    kv_indices: torch.Tensor    # [bucket*max_context]
    custom_mask: torch.Tensor   # uint8 [bucket*q_len*(max_context+q_len)] (declared length may be shorter)
    mask_indptr: torch.Tensor   # [bucket+1]
    meta: AttnMetadata
    window_mask: torch.Tensor | None = None  # uint8, custom_mask's layout: the sliding layers' mask (a windowed model)
    logits: torch.Tensor | None = None
    replay: Callable[[], None] | None = None


class GraphRunner:
    def __init__(self, forward: Callable, q_len: int, max_bs: int, max_context: int,
                 req_to_token: torch.Tensor, device: str, options: GraphOptions = GraphOptions()):
        """forward(input_ids, positions, meta) -> logits  # [T, vocab]"""
        self.forward, self.q_len, self.max_context = forward, q_len, max_context
        self.req_to_token, self.device, self.options = req_to_token, device, options
        self.buckets = capture_buckets(max_bs)
        self._graphs: dict[int, _Static] = {}
        self.num_captures = 0
        self.last: Replay | None = None

    def _capture(self, bucket: int, longest_prefix: int, windowed: bool) -> _Static:
        """longest_prefix: the capturing batch's (frozen as max_kv_len when not
        max_kv_len_at_capacity, as a host scalar is frozen into a graph).
        windowed: the model has sliding layers, which read a window mask of
        custom_mask's layout (harness/engine/ddtree/window.py): a static buffer of its own."""
        n, dev = self.q_len, self.device
        t = bucket * n
        i64 = dict(dtype=torch.int64, device=dev)
        st = _Static(
            input_ids=torch.zeros(t, **i64), positions=torch.zeros(t, **i64),
            out_cache_loc=torch.full((t,), PADDING_SLOT, **i64),
            kv_indptr=torch.arange(bucket + 1, **i64), kv_indices=torch.zeros(bucket * self.max_context, **i64),
            custom_mask=torch.ones(bucket * n * (self.max_context + n), dtype=torch.uint8, device=dev),
            mask_indptr=torch.arange(bucket + 1, **i64) * n * (1 + n), meta=None)  # type: ignore[arg-type]
        if not self.options.mask_buffer_for_bucket:
            st.custom_mask.zero_()  # the memory past a short declared mask: never written
        if windowed:
            st.window_mask = torch.ones_like(st.custom_mask)
        st.meta = AttnMetadata(
            qo_indptr=torch.arange(0, (bucket + 1) * n, n, **i64), kv_indptr=st.kv_indptr,
            kv_indices=st.kv_indices, out_cache_loc=st.out_cache_loc,
            custom_mask=st.custom_mask if self.options.capture_custom_mask else None,
            mask_indptr=st.mask_indptr, max_len_extend=n,
            max_kv_len=self.max_context if self.options.max_kv_len_at_capacity else longest_prefix,
            window_mask=st.window_mask, window_mask_indptr=st.mask_indptr if windowed else None)

        def run() -> None:
            st.logits.copy_(self.forward(st.input_ids, st.positions, st.meta))

        st.logits = self.forward(st.input_ids, st.positions, st.meta).clone()  # warm-up, sizes outputs
        if dev.startswith("cuda"):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
            st.replay = graph.replay
        else:
            st.replay = run
        self.num_captures += 1
        return st

    def verify(self, vb: VerifyBatch) -> torch.Tensor:
        """Copy the live batch into the bucket's static buffers, replay, read
        logits  # [bs*q_len, vocab] from the static output."""
        bs, n = vb.seq_lens.numel(), self.q_len
        bucket = next(b for b in self.buckets if b >= bs)
        fresh = bucket not in self._graphs  # the capture fills every buffer; replays refill per option
        windowed = vb.attn.window_mask is not None
        if fresh:
            self._graphs[bucket] = self._capture(bucket, int(vb.seq_lens.max()), windowed)
        st = self._graphs[bucket]
        if windowed != (st.window_mask is not None):
            raise ValueError(f"the bucket-{bucket} graph was captured {'with' if st.window_mask is not None else 'without'} "
                             "a window mask; this batch has " + ("one" if windowed else "none"))
        t = bs * n
        st.input_ids[:t] = vb.input_ids
        st.input_ids[t:] = 0
        if self.options.refill_positions or fresh:
            st.positions[:t] = vb.positions
            st.positions[t:] = 0
        st.out_cache_loc[:t] = vb.attn.out_cache_loc
        st.out_cache_loc[t:] = PADDING_SLOT
        dummies = bucket - bs
        seq_lens = torch.cat([vb.seq_lens.cpu(), torch.ones(dummies, dtype=torch.int64)])
        st.kv_indptr.copy_(torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64), seq_lens]), 0))
        if self.options.refill_kv_indices or fresh:
            live = vb.attn.kv_indices.numel()
            st.kv_indices[:live] = vb.attn.kv_indices
            st.kv_indices[live:live + dummies] = self.req_to_token[0, 0]
        mask_sizes = n * (seq_lens + n)
        st.mask_indptr.copy_(torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64), mask_sizes]), 0))
        if not self.options.mask_buffer_for_bucket:
            _declare(st.custom_mask, vb.attn.custom_mask.numel())
        if not self.options.dummy_padding_entries and dummies:
            _repeat_last_request(st, vb, n, dummies)
        if self.options.refill_mask or fresh:
            live = vb.attn.custom_mask.numel()
            end = min(int(st.mask_indptr[-1]), st.custom_mask.numel())
            # the kernel's reading of the live mask kept through the uint8 buffer (a plain float cast would
            # turn -inf or 0.5, both visible to the kernel, into 0)
            st.custom_mask[:live] = kernel_visible(vb.attn.custom_mask).to(torch.uint8)
            st.custom_mask[live:end] = 1  # dummy requests see everything: no empty rows
            if windowed:   # the same layout (window_mask_indptr is mask_indptr): refilled alike
                st.window_mask[:live] = kernel_visible(vb.attn.window_mask).to(torch.uint8)
                st.window_mask[live:end] = 1
        st.replay()
        self.last = Replay(bucket, vb, st.meta, st.input_ids, st.positions, st.logits)
        return st.logits[:t].clone()


def _repeat_last_request(st: _Static, vb: VerifyBatch, n: int, dummies: int) -> None:
    """The batch-padding entries re-filled as repeats of the last live request
    (padding by repeating the last element): its seq_len, prefix slots,
    positions and verify slots, so the dummies' K/V writes land in its slots."""
    t, last_len = vb.seq_lens.numel() * n, int(vb.seq_lens[-1])
    st.positions[t:] = vb.positions[-n:].repeat(dummies)
    st.out_cache_loc[t:] = vb.attn.out_cache_loc[-n:].repeat(dummies)
    seq_lens = torch.cat([vb.seq_lens.cpu(), torch.full((dummies,), last_len, dtype=torch.int64)])
    st.kv_indptr.copy_(torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64), seq_lens]), 0))
    live = vb.attn.kv_indices.numel()
    st.kv_indices[live:live + dummies * last_len] = vb.attn.kv_indices[live - last_len:].repeat(dummies)
    sizes = n * (seq_lens + n)
    st.mask_indptr.copy_(torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64), sizes]), 0))


def _declare(t: torch.Tensor, n: int) -> None:
    """Re-declare `t` as its storage's first n elements, in place (same
    pointer, so a captured graph still reads it): a kernel indexing past n
    reads whatever the storage holds there, as a GPU's out-of-bounds read does."""
    t.set_(t.untyped_storage(), 0, (n,), (1,))
