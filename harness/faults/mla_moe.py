"""Faults of DeepSeek-V3's layout (issue 24): each swaps one of the model's
own stages (harness/engine/model/stages.py) on verify forwards only (a
forward with a custom mask; the prefill stays right).

Layer: faults. Imports the engine and below; never ports, check, report, workflows or cli."""
from __future__ import annotations

from dataclasses import replace

import torch

from harness.engine.model.stages import padding_rows, verify_rows
from harness.faults.fault import Fault, all_of, has_branch, has_padding, two_steps


def _verify(meta) -> bool:
    return meta is not None and meta.custom_mask is not None


# Tensor ops only (no .tolist() of the indptr): the faults run inside CUDA graph capture too.

def latent_rope_at_flat_index(positions: torch.Tensor, meta) -> torch.Tensor:
    """A verify row's latent RoPE key turned at prefix + its row index (the flat query index), not prefix + depth."""
    if not _verify(meta):
        return positions
    r, _, start, _, inside = verify_rows(meta.qo_indptr.to(positions.device), positions.numel())
    flat = (positions[start] + (r - start)).to(positions.dtype)      # [T] the request's root position + row index
    return torch.where(inside, flat, positions)


def latent_slots_reversed(out_cache_loc: torch.Tensor, meta) -> torch.Tensor:
    """Each request's verify rows write their latents in reverse row order: row j into row q_len-1-j's slot."""
    if not _verify(meta):
        return out_cache_loc
    r, _, start, end, inside = verify_rows(meta.qo_indptr.to(out_cache_loc.device), out_cache_loc.numel())
    return out_cache_loc[torch.where(inside, start + end - 1 - r, r)]


def router_reads_padding(positions: torch.Tensor, meta) -> torch.Tensor:
    """The batch's expert dispatch counts the padding rows first: each request's last real row is routed and
    computed on its first padding row's hidden state."""
    src = torch.arange(positions.numel(), device=positions.device)   # [T] row whose hidden state each row routes
    if not _verify(meta):
        return src
    pad = padding_rows(positions, meta)                               # [T] bool
    _, _, start, _, _ = verify_rows(meta.qo_indptr.to(positions.device), positions.numel())
    seen = torch.cumsum(pad.long(), 0)                                # [T] padding rows up to and including this one
    first = pad & (seen - seen[start] + pad[start].long() == 1)       # [T] the first padding row of its request
    return torch.cat([torch.where(first[1:], src[1:], src[:-1]), src[-1:]])


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
