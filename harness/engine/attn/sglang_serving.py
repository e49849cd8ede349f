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

from dataclasses import dataclass
from typing import Any, Callable

import torch

from harness.engine.attn.base import PLAIN, BackendUnavailable, LayerAttention, ServerBatch, ServingPool
from harness.engine.attn.sglang_runtime import ServingAPI, import_serving
from harness.engine.attn.sglang_session import ServingSession
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
    spec_input_type: str            # SGLang's SpecInputType member of this verify input (a port's own object of
                                    # that type is handed to SGLang as is)


VERIFY_INPUTS = {
    "eagle": VerifyInputKind("sglang-serving", "EAGLE", _eagle_input, capture_with_mask=True,
                              spec_input_type="EAGLE_VERIFY"),
    "dflash": VerifyInputKind("sglang-serving-dflash", "DFLASH", _dflash_input, capture_with_mask=False,
                               spec_input_type="DFLASH_VERIFY"),
}


class SGLangServingBackend(SGLangTritonBackend):
    mask_regions = frozenset({"draft"})  # SGLang's forward_extend keeps skip_prefix_custom_mask at its default
    runs_mla = False   # its per-head KV layout only (the latent pool: --backend torch or sglang-triton)
    graph_capturable = True

    def __init__(self, device: str, dtype: torch.dtype, verify_input: str = "eagle") -> None:
        super().__init__(device, dtype)
        if self.interpret and dtype != torch.float32:
            raise BackendUnavailable("the sglang-serving backends run SGLang's kernels in the run's dtype on its KV "
                                     "pool; under the CPU interpreter that is float32 only (--dtype float32)")
        self.kind = VERIFY_INPUTS[verify_input]
        self.name = self.kind.backend_name
        self.api = import_serving()
        self._active: tuple[ServingSession, Any] | None = None   # (session, ForwardBatch) of the served forward

    def bind(self, pool: ServingPool) -> ServingSession:
        """SGLang's runner, KV pool and TritonAttnBackend for one engine's pool (a session per engine:
        an engine derived from another over the same backend gets its own)."""
        return ServingSession(self.api, self.kind, pool, self._activate)

    def _activate(self, session: ServingSession | None, forward_batch=None) -> None:
        self._active = None if session is None else (session, forward_batch)

    @property
    def writes_kv(self) -> bool:
        """While a forward is served, SGLang's RadixAttention writes the rows' K/V itself."""
        return self._active is not None

    def forward(self, q, k, v, layer, k_buffer, v_buffer, meta: AttnMetadata,
                layer_attn: LayerAttention = PLAIN) -> torch.Tensor:
        if self._active is None:   # a direct call with ddcheck's metadata: SGLang's kernel on it
            return super().forward(q, k, v, layer, k_buffer, v_buffer, meta, layer_attn)
        session, forward_batch = self._active
        t, cd = q.shape[0], self.compute_dtype
        sinks = layer_attn.sinks
        extras = {} if sinks is None else {"sinks": sinks.to(device=q.device, dtype=torch.float32)}   # [heads]
        o = session.layers[layer](q.to(cd).reshape(t, -1), k.to(cd).reshape(t, -1), v.to(cd).reshape(t, -1),
                                  forward_batch, **extras)
        return o.view(t, -1, q.shape[-1]).to(q.dtype)   # [T, heads, head_dim]


def make_serving(verify_input: str) -> Callable[[str, torch.dtype], SGLangServingBackend]:
    """The registry's factory (device, dtype) -> backend for one verify input class."""
    return lambda device, dtype: SGLangServingBackend(device, dtype, verify_input)
