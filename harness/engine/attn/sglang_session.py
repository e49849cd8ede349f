"""One engine's SGLang side for a serving backend (harness/engine/attn/sglang_serving.py):
SGLang's attention test kit's MockModelRunner (how SGLang drives its backends without
a server) with a KV pool of SGLang's class over the engine's storage and SGLang's own
req_to_token, a TritonAttnBackend over it and one RadixAttention per layer; the eager
forward (`served`) and SGLang's graph state (`init_graph_state`, `graph_capture`,
`graph_replay`, driven by harness/engine/serving_graph.py).

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from harness.engine.attn.base import ServerBatch, ServingPool
from harness.engine.attn.sglang_runtime import ServingAPI
from harness.engine.ddtree.verify_inputs import AttnMetadata


@dataclass(frozen=True)
class ServedVerify:
    """What SGLang's TritonAttnBackend was handed and served for the last target-verify forward."""

    verify_input: str   # the class SGLang received, e.g. "DFlashVerifyInput (the port's dflash_info)"
    ports_own: bool     # the port's own object (its worker built it), not one this backend built
    width: int          # rows per request SGLang's metadata served (max_extend_len of what the kernel read)
    graph: bool         # a graph replay (the captured metadata) rather than an eager forward


def _label(spec) -> str:
    """The class and the file defining it, e.g. "DFlashVerifyInput (dflash_info.py)"."""
    cls = type(spec)
    files = [f.__code__.co_filename for f in vars(cls).values() if hasattr(f, "__code__")]
    where = next((Path(f).name for f in files if not f.startswith("<")), cls.__module__.rsplit(".", 1)[-1])
    return f"{cls.__name__} ({where})"


class ServingSession:
    def __init__(self, api: ServingAPI, kind, pool: ServingPool, activate: Callable) -> None:
        """kind: the backend's VerifyInputKind; activate(session, forward_batch) / activate(None) tells the
        backend which served forward its layers run in."""
        self.api, self.kind, self._activate = api, kind, activate
        self.engine_req_to_token = pool.req_to_token   # the scheduler's table, copied into SGLang's per forward
        k0 = pool.k_buffer[0]
        slots, kv_heads, head_dim = k0.shape
        case = api.DenseAttentionCase(name="ddcheck-serving", backend="triton",
                                      forward_mode=api.ForwardMode.TARGET_VERIFY, num_heads=pool.num_heads,
                                      num_kv_heads=kv_heads, page_size=1, prefix_lens=(0,), extend_lens=(pool.q_len,))
        model_config = api.TinyModelConfig(num_heads=pool.num_heads, num_kv_heads=kv_heads, head_dim=head_dim,
                                           hidden_size=pool.num_heads * head_dim, context_len=pool.max_context)
        self.runner = api.MockModelRunner(case=case, model_config=model_config, dtype=k0.dtype, device=str(k0.device),
                                          max_context_len=pool.max_context, head_dim=head_dim,
                                          runner_batch_size=max(pool.req_to_token.shape[0], pool.max_bs))
        self.runner.spec_algorithm = getattr(api.SpeculativeAlgorithm, kind.algorithm)
        kv = api.MHATokenToKVPool(size=slots - 1, page_size=1, dtype=k0.dtype, head_num=kv_heads, head_dim=head_dim,
                                  layer_num=len(pool.k_buffer), device=str(k0.device), enable_memory_saver=False,
                                  enable_alt_stream=False)
        # SGLang's pool class over the engine's storage: the same [slots, kv_heads, head_dim] tensor per layer
        kv.k_buffer, kv.v_buffer = list(pool.k_buffer), list(pool.v_buffer)
        self.runner.token_to_kv_pool = kv
        self.runner.init_kv_index_translator()
        self.attn = api.TritonAttnBackend(self.runner)   # SGLang's backend; its forward_metadata is what was read
        self.layers = [api.RadixAttention(pool.num_heads, head_dim, head_dim ** -0.5, kv_heads, i,
                                          logit_cap=la.logit_cap) for i, la in enumerate(pool.layers)]
        self._captured: dict[int, Any] = {}       # bucket -> ForwardMetadata the capture built (graph buffer views)
        self._graph_batches: dict[int, Any] = {}  # bucket -> the ForwardBatch the capture ran on (static buffers)
        self._graph_state = False
        self.last_served: ServedVerify | None = None

    @property
    def req_to_token(self) -> torch.Tensor:
        """SGLang's own req_to_token  # [rows, max_context] int32."""
        return self.runner.req_to_token_pool.req_to_token

    def _sync_req_to_token(self) -> None:
        """The scheduler's table as of this forward: the engine's req_to_token into SGLang's."""
        src = self.engine_req_to_token
        self.req_to_token[:src.shape[0], :src.shape[1]].copy_(src)

    def _forward_batch(self, batch: ServerBatch, spec_info=None):
        """SGLang's ForwardBatch for `batch` (int32 lengths and request rows, as SGLang's scheduler keeps them)."""
        api = self.api
        i32 = dict(dtype=torch.int32, device=batch.seq_lens.device)
        verify = batch.mode == "target-verify"
        cached = batch.seq_lens.to(**i32)                                         # [bs]
        extend = torch.tensor(batch.extend_lens, **i32)                           # [bs]
        seq_lens = cached if verify else cached + extend   # TARGET_VERIFY: the cached length; EXTEND: the total
        fb = api.ForwardBatch(
            forward_mode=api.ForwardMode.TARGET_VERIFY if verify else api.ForwardMode.EXTEND,
            batch_size=batch.batch_size, input_ids=batch.input_ids, req_pool_indices=batch.req_pool_indices.to(**i32),
            seq_lens=seq_lens, seq_lens_cpu=seq_lens.cpu(), out_cache_loc=batch.out_cache_loc,
            seq_lens_sum=int(seq_lens.sum()), positions=batch.positions)
        self.runner.kv_index_translator.bind_own_plan(fb)
        if verify:
            fb.spec_info = spec_info if spec_info is not None else self.verify_input(batch)
        else:
            fb.extend_prefix_lens, fb.extend_prefix_lens_cpu = cached, cached.tolist()
            fb.extend_seq_lens, fb.extend_seq_lens_cpu = extend, list(batch.extend_lens)
            fb.extend_num_tokens = sum(batch.extend_lens)
        return fb

    def takes(self, spec) -> bool:
        """A port's own verify input goes to SGLang as is when its SpecInputType is this backend's."""
        kind = getattr(spec, "spec_input_type", None)
        return spec is not None and getattr(kind, "name", None) == self.kind.spec_input_type

    def verify_input(self, batch: ServerBatch):
        """The verify input SGLang receives for a live batch: the port's own object when this backend
        takes its type, else the backend's kind built from the batch (the port's mask in it)."""
        if self.takes(batch.spec_info):
            return batch.spec_info
        return self.kind.build(self.api, batch, batch.custom_mask, batch.extend_lens[0], batch.topk)

    def _served(self, spec, batch: ServerBatch, graph: bool) -> None:
        self.last_served = ServedVerify(_label(spec), spec is batch.spec_info and spec is not None,
                                        int(self.attn.forward_metadata.max_extend_len), graph)

    @contextmanager
    def _running(self, forward_batch, out_cache_loc: torch.Tensor) -> Iterator[AttnMetadata]:
        """The model's layers run inside: the backend attends through this session's RadixAttention."""
        self._activate(self, forward_batch)
        try:
            yield self.served_metadata(out_cache_loc)
        finally:
            self._activate(None)

    @contextmanager
    def served(self, batch: ServerBatch) -> Iterator[AttnMetadata]:
        """An eager forward: SGLang builds its metadata from the batch (init_forward_metadata). Yields
        SGLang's metadata as ddcheck's AttnMetadata."""
        self._sync_req_to_token()
        fb = self._forward_batch(batch)
        with torch.no_grad(), self.api.forward_context(self.api.ForwardContext(attn_backend=self.attn)):
            self.attn.init_forward_metadata(fb)
            if batch.mode == "target-verify":
                self._served(fb.spec_info, batch, graph=False)
            with self._running(fb, batch.out_cache_loc) as meta:
                yield meta

    def served_metadata(self, out_cache_loc: torch.Tensor) -> AttnMetadata:
        """SGLang's forward_metadata (what its kernel reads) in ddcheck's record, for audits and records."""
        m = self.attn.forward_metadata
        as64 = lambda t: None if t is None else t.to(torch.int64)  # noqa: E731
        return AttnMetadata(qo_indptr=as64(m.qo_indptr), kv_indptr=as64(m.kv_indptr), kv_indices=as64(m.kv_indices),
                            out_cache_loc=out_cache_loc, custom_mask=m.custom_mask, mask_indptr=as64(m.mask_indptr),
                            max_len_extend=int(m.max_extend_len))

    # -- SGLang's graph state ------------------------------------------------------------------------
    def init_graph_state(self, max_bs: int, q_len: int) -> None:
        """SGLang's init_cuda_graph_state for buckets up to max_bs at width q_len."""
        self.attn.init_cuda_graph_state(max_bs=max_bs, max_num_tokens=max_bs * q_len)
        self._graph_state = True

    def seq_len_fill_value(self) -> int:
        return self.attn.get_cuda_graph_seq_len_fill_value()

    @contextmanager
    def graph_capture(self, static: ServerBatch) -> Iterator[AttnMetadata]:
        """Capture-time metadata for one bucket (`static`: the bucket's static buffers holding SGLang's
        capture fill): the verify input SGLang's graph runner hands at capture, then
        init_forward_metadata_out_graph(in_capture=True); the forward (captured on CUDA) runs inside."""
        if not self._graph_state:
            raise RuntimeError("init_graph_state must run before a capture")
        bucket, q_len = static.batch_size, static.extend_lens[0]
        buffer = self.attn.verify_mask.buffer if self.attn.verify_mask is not None else None
        spec = self.kind.build(self.api, None, buffer if self.kind.capture_with_mask else None, q_len, static.topk)
        fb = self._forward_batch(static, spec)
        with torch.no_grad(), self.api.forward_context(self.api.ForwardContext(attn_backend=self.attn)):
            self.attn.init_forward_metadata_out_graph(fb, in_capture=True)
            self.attn.init_forward_metadata_in_graph(fb)   # a no-op on TritonAttnBackend
            self._captured[bucket], self._graph_batches[bucket] = self.attn.forward_metadata, fb
            with self._running(fb, static.out_cache_loc) as meta:
                yield meta

    @contextmanager
    def graph_replay(self, static: ServerBatch, live: ServerBatch) -> Iterator[AttnMetadata]:
        """Replay-time metadata: the static buffers (`static`, refilled with the live batch and padded to
        the bucket) with the live batch's verify input through init_forward_metadata_out_graph, over the
        metadata the capture built (a replayed graph reads the capture's buffers; on CPU the forward runs
        eagerly inside on those same buffers)."""
        bucket = static.batch_size
        self._sync_req_to_token()
        spec = self.verify_input(live)
        view = self._forward_batch(static, spec)
        with torch.no_grad(), self.api.forward_context(self.api.ForwardContext(attn_backend=self.attn)):
            self.attn.init_forward_metadata_out_graph(view)
            self.attn.init_forward_metadata_in_graph(view)
            self.attn.forward_metadata = self._captured[bucket]   # "metadata view is reused from capture"
            self._served(spec, live, graph=True)
            with self._running(self._graph_batches[bucket], static.out_cache_loc) as meta:
                yield meta
