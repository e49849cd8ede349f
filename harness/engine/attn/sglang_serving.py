"""SGLang's own attention backend as the system under test: the engine hands
SGLang's `TritonAttnBackend` a real `ForwardBatch` (TARGET_VERIFY, with a verify
input object: EAGLE's or DFlash's), SGLang builds qo_indptr, kv_indptr,
kv_indices and mask_indptr itself (`init_forward_metadata`) and takes the tree
mask from the verify input, and every layer attends through SGLang's
`RadixAttention` -> `forward_extend` on SGLang's own KV pool class, whose
storage is the engine's (so the engine's commit and audits see what SGLang
wrote). Under graphs SGLang's own graph state runs: `init_cuda_graph_state`,
then `init_forward_metadata_out_graph` at capture (in_capture=True) and before
each replay (harness/engine/serving_graph.py pads the batch to its bucket).

The runner SGLang's backend reads is SGLang's own attention test kit's
`MockModelRunner` (how SGLang drives its backends without a server), given
pools sized for the run. A direct `forward` call with ddcheck's metadata (the
localizer's probes, the causal twin) runs SGLang's extend kernel on that
metadata, as sglang-triton does.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from harness.engine.attn.base import PLAIN, BackendUnavailable, LayerAttention, ServerBatch, ServingPool
from harness.engine.attn.sglang_runtime import ServingAPI, import_serving
from harness.engine.attn.sglang_triton import SGLangTritonBackend
from harness.engine.ddtree.verify_inputs import AttnMetadata


def _eagle_input(api: ServingAPI, batch: ServerBatch | None, mask, q_len: int, topk: int):
    """EagleVerifyInput as EAGLE's worker hands it to the target's verify forward (batch None: the
    graph runner's capture-time input, which carries the runner's mask buffer)."""
    return api.EagleVerifyInput(
        draft_token=None if batch is None else batch.input_ids, custom_mask=mask,
        positions=None if batch is None else batch.positions, retrieve_index=None, retrieve_next_token=None,
        retrieve_next_sibling=None, retrieve_cum_len=None, spec_steps=q_len - 1, topk=topk, draft_token_num=q_len,
        capture_hidden_mode=api.CaptureHiddenMode.FULL,
        seq_lens_sum=None if batch is None else int(batch.seq_lens.sum()),
        seq_lens_cpu=None if batch is None else batch.seq_lens.cpu().to(torch.int32))


def _dflash_input(api: ServingAPI, batch: ServerBatch | None, mask, q_len: int, topk: int):
    """DFlashVerifyInput as DFlash's worker builds it. At graph capture SGLang 0.5.23's runner hands
    TritonAttnBackend none (resolve_dflash_verify_mask_policy lists it among the backends that
    verify DFlash's linear block causally), so the capture is causal."""
    return api.DFlashVerifyInput(draft_token=None if batch is None else batch.input_ids,
                                 positions=None if batch is None else batch.positions, draft_token_num=q_len,
                                 custom_mask=mask)


@dataclass(frozen=True)
class VerifyInputKind:
    """One verify input class a serving backend hands SGLang, and what its graph capture carries."""

    backend_name: str
    algorithm: str                  # SGLang's SpeculativeAlgorithm member the runner runs
    build: Callable[..., Any]       # (api, batch | None, mask, q_len, topk) -> verify input
    capture_with_mask: bool         # the capture-time input carries the mask buffer (else None: causal)


VERIFY_INPUTS = {
    "eagle": VerifyInputKind("sglang-serving", "EAGLE", _eagle_input, capture_with_mask=True),
    "dflash": VerifyInputKind("sglang-serving-dflash", "DFLASH", _dflash_input, capture_with_mask=False),
}


@dataclass
class _Bound:
    """SGLang's side of one engine: its runner (pools), backend and one RadixAttention per layer."""

    runner: Any
    attn: Any                      # TritonAttnBackend
    layers: list                   # RadixAttention per layer
    req_to_token: torch.Tensor     # the engine's table, copied into the runner's before each forward
    captured: dict                 # bucket -> ForwardMetadata built at capture (its views of the graph buffers)
    graph_batches: dict            # bucket -> the ForwardBatch the capture ran on (over the static buffers)
    graph_state: bool = False


class SGLangServingBackend(SGLangTritonBackend):
    mask_regions = frozenset({"draft"})  # SGLang's forward_extend keeps skip_prefix_custom_mask at its default
    graph_capturable = True

    def __init__(self, device: str, dtype: torch.dtype, verify_input: str = "eagle") -> None:
        super().__init__(device, dtype)
        if self.interpret and dtype != torch.float32:
            raise BackendUnavailable("the sglang-serving backends run SGLang's kernels in the run's dtype on its KV "
                                     "pool; under the CPU interpreter that is float32 only (--dtype float32)")
        self.kind = VERIFY_INPUTS[verify_input]
        self.name = self.kind.backend_name
        self.api = import_serving()
        self._bound: _Bound | None = None
        self._batch = None   # the ForwardBatch of the forward in progress (None: no served forward)

    # -- binding --------------------------------------------------------------------------------
    def bind(self, pool: ServingPool) -> None:
        """Build SGLang's runner, KV pool and TritonAttnBackend for this engine's pool."""
        api, k0 = self.api, pool.k_buffer[0]
        slots, kv_heads, head_dim = k0.shape
        rows = max(pool.req_to_token.shape[0], pool.max_bs)
        case = api.DenseAttentionCase(name="ddcheck-serving", backend="triton",
                                      forward_mode=api.ForwardMode.TARGET_VERIFY, num_heads=pool.num_heads,
                                      num_kv_heads=kv_heads, page_size=1, prefix_lens=(0,), extend_lens=(pool.q_len,))
        model_config = api.TinyModelConfig(num_heads=pool.num_heads, num_kv_heads=kv_heads, head_dim=head_dim,
                                           hidden_size=pool.num_heads * head_dim, context_len=pool.max_context)
        runner = api.MockModelRunner(case=case, model_config=model_config, dtype=k0.dtype, device=str(k0.device),
                                     max_context_len=pool.max_context, head_dim=head_dim, runner_batch_size=rows)
        runner.spec_algorithm = getattr(api.SpeculativeAlgorithm, self.kind.algorithm)
        kv = api.MHATokenToKVPool(size=slots - 1, page_size=1, dtype=k0.dtype, head_num=kv_heads, head_dim=head_dim,
                                  layer_num=len(pool.k_buffer), device=str(k0.device), enable_memory_saver=False,
                                  enable_alt_stream=False)
        # SGLang's pool class over the engine's storage: same [slots, kv_heads, head_dim] per layer
        kv.k_buffer, kv.v_buffer = list(pool.k_buffer), list(pool.v_buffer)
        runner.token_to_kv_pool = kv
        runner.init_kv_index_translator()
        attn = api.TritonAttnBackend(runner)
        layers = [api.RadixAttention(pool.num_heads, head_dim, head_dim ** -0.5, kv_heads, i, logit_cap=la.logit_cap)
                  for i, la in enumerate(pool.layers)]
        self._bound = _Bound(runner, attn, layers, pool.req_to_token, {}, {})

    @property
    def sglang_backend(self):
        """SGLang's TritonAttnBackend (its forward_metadata is what the last forward read)."""
        return self._need_bound().attn

    @property
    def req_to_token(self) -> torch.Tensor:
        """SGLang's own req_to_token  # [rows, max_context] int32 (refilled from the engine's before each forward)."""
        return self._need_bound().runner.req_to_token_pool.req_to_token

    def _need_bound(self) -> _Bound:
        if self._bound is None:
            raise RuntimeError(f"{self.name} serves batches only after bind(pool)")
        return self._bound

    @property
    def writes_kv(self) -> bool:
        """While a forward is served, SGLang's RadixAttention writes the rows' K/V itself."""
        return self._batch is not None

    # -- one forward ------------------------------------------------------------------------------
    def _sync_req_to_token(self) -> None:
        """The scheduler's table as of this forward: the engine's req_to_token into SGLang's (int32)."""
        b = self._need_bound()
        src = b.req_to_token
        b.runner.req_to_token_pool.req_to_token[:src.shape[0], :src.shape[1]].copy_(src)

    def _forward_batch(self, batch: ServerBatch, spec_info=None):
        """SGLang's ForwardBatch for `batch` (int32 lengths and request rows, as SGLang's scheduler keeps them)."""
        api, b = self.api, self._need_bound()
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
        b.runner.kv_index_translator.bind_own_plan(fb)
        if verify:
            fb.spec_info = spec_info if spec_info is not None else self.kind.build(
                api, batch, batch.custom_mask, batch.extend_lens[0], batch.topk)
        else:
            fb.extend_prefix_lens, fb.extend_prefix_lens_cpu = cached, cached.tolist()
            fb.extend_seq_lens, fb.extend_seq_lens_cpu = extend, list(batch.extend_lens)
            fb.extend_num_tokens = sum(batch.extend_lens)
        return fb

    @contextmanager
    def served(self, batch: ServerBatch) -> Iterator[AttnMetadata]:
        """An eager forward: SGLang builds its metadata from the batch (init_forward_metadata); the
        model's layers run inside. Yields SGLang's metadata as ddcheck's AttnMetadata."""
        b = self._need_bound()
        self._sync_req_to_token()
        fb = self._forward_batch(batch)
        with torch.no_grad(), self.api.forward_context(self.api.ForwardContext(attn_backend=b.attn)):
            b.attn.init_forward_metadata(fb)
            self._batch = fb
            try:
                yield self.served_metadata(batch.out_cache_loc)
            finally:
                self._batch = None

    def served_metadata(self, out_cache_loc: torch.Tensor) -> AttnMetadata:
        """SGLang's forward_metadata (what its kernel reads) in ddcheck's record, for audits and records."""
        m = self._need_bound().attn.forward_metadata
        as64 = lambda t: None if t is None else t.to(torch.int64)  # noqa: E731
        return AttnMetadata(qo_indptr=as64(m.qo_indptr), kv_indptr=as64(m.kv_indptr), kv_indices=as64(m.kv_indices),
                            out_cache_loc=out_cache_loc, custom_mask=m.custom_mask, mask_indptr=as64(m.mask_indptr),
                            max_len_extend=int(m.max_extend_len))

    # -- SGLang's graph state (driven by harness/engine/serving_graph.py) --------------------------
    def init_graph_state(self, max_bs: int, q_len: int) -> None:
        """SGLang's init_cuda_graph_state for buckets up to max_bs at width q_len."""
        b = self._need_bound()
        b.attn.init_cuda_graph_state(max_bs=max_bs, max_num_tokens=max_bs * q_len)
        b.graph_state = True

    def seq_len_fill_value(self) -> int:
        return self._need_bound().attn.get_cuda_graph_seq_len_fill_value()

    @contextmanager
    def graph_capture(self, static: ServerBatch) -> Iterator[AttnMetadata]:
        """Capture-time metadata for one bucket (`static`: the bucket's static buffers holding SGLang's
        capture fill): the verify input the graph runner hands at capture, then
        init_forward_metadata_out_graph(in_capture=True); the forward (captured on CUDA) runs inside."""
        b = self._need_bound()
        if not b.graph_state:
            raise RuntimeError("init_graph_state must run before a capture")
        bucket = static.batch_size
        mask = b.attn.verify_mask.buffer if self.kind.capture_with_mask and b.attn.verify_mask is not None else None
        fb = self._forward_batch(static, self.kind.build(self.api, None, mask, static.extend_lens[0], static.topk))
        with torch.no_grad(), self.api.forward_context(self.api.ForwardContext(attn_backend=b.attn)):
            b.attn.init_forward_metadata_out_graph(fb, in_capture=True)
            b.attn.init_forward_metadata_in_graph(fb)   # no-op for TritonAttnBackend; inside the capture on CUDA
            b.captured[bucket], b.graph_batches[bucket] = b.attn.forward_metadata, fb
            self._batch = fb
            try:
                yield self.served_metadata(static.out_cache_loc)
            finally:
                self._batch = None

    @contextmanager
    def graph_replay(self, static: ServerBatch, live: ServerBatch) -> Iterator[AttnMetadata]:
        """Replay-time metadata: the static buffers (`static`, refilled with the live batch and padded to the
        bucket) with the live batch's verify input, through init_forward_metadata_out_graph(in_capture=False),
        over the metadata the capture built (a replayed graph reads the capture's buffers; on CPU the
        forward runs eagerly inside on those same buffers)."""
        b = self._need_bound()
        bucket = static.batch_size
        self._sync_req_to_token()
        spec = self.kind.build(self.api, live, live.custom_mask, live.extend_lens[0], live.topk)
        view = self._forward_batch(static, spec)
        with torch.no_grad(), self.api.forward_context(self.api.ForwardContext(attn_backend=b.attn)):
            b.attn.init_forward_metadata_out_graph(view)
            b.attn.init_forward_metadata_in_graph(view)
            b.attn.forward_metadata = b.captured[bucket]   # "metadata view is reused from capture"
            self._batch = b.graph_batches[bucket]
            try:
                yield self.served_metadata(static.out_cache_loc)
            finally:
                self._batch = None

    # -- the per-layer seam -------------------------------------------------------------------------
    def forward(self, q, k, v, layer, k_buffer, v_buffer, meta: AttnMetadata,
                layer_attn: LayerAttention = PLAIN) -> torch.Tensor:
        if self._batch is None:   # a direct call with ddcheck's metadata: SGLang's kernel on it
            return super().forward(q, k, v, layer, k_buffer, v_buffer, meta, layer_attn)
        t, cd = q.shape[0], self.compute_dtype
        extras = {} if layer_attn.sinks is None else {"sinks": layer_attn.sinks.to(device=q.device, dtype=torch.float32)}
        o = self._need_bound().layers[layer](q.to(cd).reshape(t, -1), k.to(cd).reshape(t, -1),
                                             v.to(cd).reshape(t, -1), self._batch, **extras)
        return o.view(t, -1, q.shape[-1]).to(q.dtype)   # [T, heads, head_dim]


def make_serving(verify_input: str) -> Callable[[str, torch.dtype], SGLangServingBackend]:
    """The registry's factory (device, dtype) -> backend for one verify input class."""
    return lambda device, dtype: SGLangServingBackend(device, dtype, verify_input)
