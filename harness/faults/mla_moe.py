"""Faults of DeepSeek-V3's layout (issue 24): each swaps one of the model's
own stages (harness/engine/model/stages.py) on verify forwards only (a
forward with a custom mask; the prefill stays right).

Layer: faults. Imports the engine and below; never ports, check, report, workflows or cli."""
from __future__ import annotations

from dataclasses import replace

import torch

from harness.engine.model.stages import padding_rows
from harness.faults.fault import Fault, all_of, has_branch, has_padding, two_steps


def _verify(meta) -> bool:
    return meta is not None and meta.custom_mask is not None


def latent_rope_at_flat_index(positions: torch.Tensor, meta) -> torch.Tensor:
    """A verify row's latent RoPE key turned at prefix + its row index (the flat query index), not prefix + depth."""
    if not _verify(meta):
        return positions
    out = positions.clone()
    qo = meta.qo_indptr.tolist()
    for b in range(len(qo) - 1):
        out[qo[b]:qo[b + 1]] = positions[qo[b]] + torch.arange(qo[b + 1] - qo[b], device=positions.device)
    return out


def latent_slots_reversed(out_cache_loc: torch.Tensor, meta) -> torch.Tensor:
    """Each request's verify rows write their latents in reverse row order: row j into row q_len-1-j's slot."""
    if not _verify(meta):
        return out_cache_loc
    out = out_cache_loc.clone()
    qo = meta.qo_indptr.tolist()
    for b in range(len(qo) - 1):
        out[qo[b]:qo[b + 1]] = out_cache_loc[qo[b]:qo[b + 1]].flip(0)
    return out


def router_reads_padding(positions: torch.Tensor, meta) -> torch.Tensor:
    """The batch's expert dispatch counts the padding rows first: each request's last real row is routed and
    computed on its first padding row's hidden state."""
    src = torch.arange(positions.numel(), device=positions.device)
    if not _verify(meta):
        return src
    pad = padding_rows(positions, meta)
    qo = meta.qo_indptr.tolist()
    for b in range(len(qo) - 1):
        rows = pad[qo[b]:qo[b + 1]].nonzero().flatten()
        if rows.numel():
            first = qo[b] + int(rows[0])
            src[first - 1] = first
    return src


def _model(s):
    from harness.engine.model.presets import model_config
    return model_config(s.model)


def is_mla(s, vocab: int) -> bool:
    """The model has multi-head latent attention (a DeepSeek-V3-layout preset or checkpoint)."""
    return _model(s).mla is not None


def is_moe(s, vocab: int) -> bool:
    """The model has routed experts."""
    return _model(s).moe is not None


def _stage(**swap):
    return lambda p: replace(p, model_stages=replace(p.model_stages, **swap))


MLA_MOE_FAULTS = (
    Fault("mla-rope-flat-index", "a verify row's cached latent RoPE key is rotated at prefix + its row index "
          "(the flat query index), not prefix + depth", "an MLA model and a branching tree (--model "
          "tiny-deepseek-v3 --topk 2)", "latent-rope-position", _stage(latent_rope_positions=latent_rope_at_flat_index),
          all_of(is_mla, has_branch)),
    Fault("mla-latent-wrong-slot", "verify rows write their latents to their request's slots in reverse row order: "
          "committed positions hold other rows' latents", "an MLA model and a second verify round (--max-new-tokens > "
          "--block-size + 1)", "latent-wrong-slot", _stage(latent_slots=latent_slots_reversed),
          all_of(is_mla, two_steps)),
    Fault("moe-router-reads-padding", "the expert dispatch reads a padding row's hidden state for each request's "
          "last real row (the padding counted into the batch's expert load)", "a MoE model and padding rows "
          "(--model tiny-deepseek-v3, budget > depth cap)", "moe-padding-dispatch",
          _stage(moe_dispatch=router_reads_padding), all_of(is_moe, has_padding)),
)
