"""CUDA graphs for a serving backend (SGLang's TritonAttnBackend, harness/engine/attn/
sglang_serving.py): SGLang's own graph state, not ddcheck's GraphRunner. One
capture per batch-size bucket; a bucket is the first power of two above the
live batch, so every replay carries batch-padding requests and SGLang's
padding is exercised. The static inputs are padded as SGLang's graph runner
pads them (seq_len its fill value, request row 0, slot 0, position 0, token 0);
the metadata comes from SGLang: `init_cuda_graph_state` once,
`init_forward_metadata_out_graph(in_capture=True)` at capture and
`init_forward_metadata_out_graph` before each replay.

On CUDA the model forward is recorded in a torch.cuda.CUDAGraph and replayed.
On CPU there is no capture: the capture-time metadata method runs, then per
replay the replay-time one, and the forward runs eagerly on the padded static
buffers over the metadata the capture built, so what the capture froze
(a mask or none) is what the replay reads.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from harness.engine.attn.base import ServerBatch
from harness.engine.graph import Replay
from harness.engine.mem.allocator import PADDING_SLOT
from harness.engine.ddtree.verify_inputs import VerifyBatch


def serving_buckets(max_bs: int) -> list[int]:
    """Powers of two from 2 up to the first above max_bs: each batch runs in a bucket larger than itself."""
    buckets = [2]
    while buckets[-1] <= max_bs:
        buckets.append(buckets[-1] * 2)
    return buckets


@dataclass
class _Static:
    """One bucket's static inputs (what a captured graph reads by address)."""

    input_ids: torch.Tensor        # [bucket*q_len]
    positions: torch.Tensor        # [bucket*q_len]
    out_cache_loc: torch.Tensor    # [bucket*q_len]
    req_pool_indices: torch.Tensor  # [bucket] int32
    seq_lens: torch.Tensor         # [bucket] int32
    logits: torch.Tensor | None = None  # [bucket*q_len, vocab]
    graph: object | None = None    # torch.cuda.CUDAGraph on CUDA

    def batch(self, q_len: int, topk: int) -> ServerBatch:
        n = self.seq_lens.numel()
        return ServerBatch("target-verify", self.input_ids, self.positions, self.req_pool_indices, self.seq_lens,
                           (q_len,) * n, self.out_cache_loc, None, topk)


class ServingGraphRunner:
    def __init__(self, forward: Callable, backend, q_len: int, max_bs: int, device: str, topk: int):
        """forward(input_ids, positions, meta) -> logits  # [T, vocab]: the model over a served batch;
        backend: an engine's serving session (init_graph_state, graph_capture, graph_replay)."""
        self.forward, self.backend, self.q_len, self.device, self.topk = forward, backend, q_len, device, topk
        self.buckets = serving_buckets(max_bs)
        backend.init_graph_state(self.buckets[-1], q_len)
        self._graphs: dict[int, _Static] = {}
        self.num_captures = 0
        self.last: Replay | None = None

    def _capture(self, bucket: int) -> _Static:
        t, dev = bucket * self.q_len, self.device
        fill = self.backend.seq_len_fill_value()
        st = _Static(torch.zeros(t, dtype=torch.int64, device=dev), torch.zeros(t, dtype=torch.int64, device=dev),
                     torch.full((t,), PADDING_SLOT, dtype=torch.int64, device=dev),
                     torch.zeros(bucket, dtype=torch.int32, device=dev),
                     torch.full((bucket,), fill, dtype=torch.int32, device=dev))
        with self.backend.graph_capture(st.batch(self.q_len, self.topk)) as meta:
            st.logits = self.forward(st.input_ids, st.positions, meta).clone()   # warm-up, sizes the output
            if dev.startswith("cuda"):
                st.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(st.graph):
                    st.logits.copy_(self.forward(st.input_ids, st.positions, meta))
        self.num_captures += 1
        return st

    def verify(self, vb: VerifyBatch) -> torch.Tensor:
        """Pad the live batch into its bucket's static buffers as SGLang's runner does, replay, and
        return logits  # [bs*q_len, vocab] of the live rows."""
        bs, n = vb.seq_lens.numel(), self.q_len
        bucket = next(b for b in self.buckets if b > bs)
        if bucket not in self._graphs:
            self._graphs[bucket] = self._capture(bucket)
        st, t = self._graphs[bucket], bs * n
        st.input_ids.zero_()
        st.input_ids[:t] = vb.input_ids
        st.positions.zero_()
        st.positions[:t] = vb.positions
        st.out_cache_loc.fill_(PADDING_SLOT)
        st.out_cache_loc[:t] = vb.attn.out_cache_loc
        st.req_pool_indices.zero_()
        st.req_pool_indices[:bs] = vb.req_pool_indices
        st.seq_lens.fill_(self.backend.seq_len_fill_value())
        st.seq_lens[:bs] = vb.seq_lens
        live = ServerBatch("target-verify", vb.input_ids, vb.positions, vb.req_pool_indices, vb.seq_lens,
                           (n,) * bs, vb.attn.out_cache_loc, vb.attn.custom_mask, self.topk, vb.spec_info)
        with self.backend.graph_replay(st.batch(n, self.topk), live) as meta:
            if st.graph is not None:
                st.graph.replay()
            else:
                st.logits.copy_(self.forward(st.input_ids, st.positions, meta))
        # SGLang's _update_target_verify_buffers copies the live mask only: the dummies' blocks keep what the
        # buffer held (zeros, or an earlier, larger batch's mask); their rows are discarded and see their prefix key
        self.last = Replay(bucket, vb, meta, st.input_ids, st.positions, st.logits, dummy_mask_refilled=False)
        return st.logits[:t].clone()
