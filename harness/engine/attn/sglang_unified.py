"""SGLang's one-stage extend kernel (extend_attention_fwd_unified, the path of
its deterministic inference) on the same verify batch as sglang-triton. It
reads every key, the prefix's and the verify rows', through one index list
from the pool, and every mask column, the prefix's included, where
extend_attention_fwd takes the verify rows' K/V from the forward and skips the
prefix columns. Two SGLang kernels on one batch: when only this one disagrees,
the bug sits in what only it reads (the prefix mask columns, the verify rows'
slots in the pool); when both do, in what both read.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

import importlib

import torch

from harness.engine.attn.bounds import check_kernel_reads
from harness.engine.attn.base import PLAIN, BackendUnavailable, LayerAttention
from harness.engine.attn.sglang_triton import (INSTALL_HINT, MODULE_PATHS, SGLangTritonBackend, _one_line, kernel_extras,
                                        prepare_interpreter)
from harness.engine.ddtree.verify_inputs import AttnMetadata


def _import_unified():
    """(extend_attention_fwd_unified, build_unified_kv_indices) from the first module that has them."""
    prepare_interpreter()
    errors = []
    for path in MODULE_PATHS:
        try:
            m = importlib.import_module(path)
            return m.extend_attention_fwd_unified, m.build_unified_kv_indices
        except Exception as e:  # noqa: BLE001  (any failure of SGLang's import chain is "unavailable")
            errors.append(f"{path}: {_one_line(e)}")
    raise BackendUnavailable(f"SGLang's unified extend kernel does not import ({errors[0]}); {INSTALL_HINT}")


def available() -> bool:
    try:
        _import_unified()
        return True
    except BackendUnavailable:
        return False


class SGLangUnifiedBackend(SGLangTritonBackend):
    name = "sglang-unified"
    mask_regions = frozenset({"prefix", "draft"})   # every column of each request's mask block is read
    runs_mla = False   # its per-head KV layout only (the latent pool: --backend torch or sglang-triton)

    def __init__(self, device: str, dtype: torch.dtype) -> None:
        super().__init__(device, dtype)
        self._unified, self._indices = _import_unified()

    def unified_indices(self, meta: AttnMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(kv_indptr [bs+1], kv_indices [prefix + verify rows per request], prefix_lens [bs]) as SGLang's
        build_unified_kv_indices lays them out: each request's prefix slots, then its verify rows' slots."""
        bs = meta.qo_indptr.numel() - 1
        extend_lens = meta.qo_indptr[1:] - meta.qo_indptr[:-1]               # [bs] q_len each
        return self._indices(meta.kv_indptr, meta.kv_indices, meta.qo_indptr[:-1], extend_lens,
                             meta.out_cache_loc, bs)

    def forward(self, q, k, v, layer, k_buffer, v_buffer, meta: AttnMetadata,
                layer_attn: LayerAttention = PLAIN) -> torch.Tensor:
        if self.interpret:   # an interpreted read past a buffer kills the process (attn/bounds.py)
            check_kernel_reads(meta, q.shape[0], k_buffer.shape[0])
        cd = self.compute_dtype
        q_ = q.to(cd).contiguous()
        o = torch.empty_like(q_)
        indptr, indices, prefix_lens = self.unified_indices(meta)
        self._unified(q_, o, k_buffer.to(cd), v_buffer.to(cd), 1.0, 1.0, meta.qo_indptr, indptr, indices,
                      prefix_lens, meta.max_len_extend, custom_mask=meta.custom_mask, mask_indptr=meta.mask_indptr,
                      sm_scale=layer_attn.sm_scale(q.shape[-1]), is_causal=meta.custom_mask is None,
                      **kernel_extras(layer_attn, q.device))
        return o.to(q.dtype)

