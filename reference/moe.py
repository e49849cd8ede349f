"""DeepSeek-V3's expert routing in float64 (noaux_tc), written from its definition.

For one token with router logits z [E] (E = n_routed_experts):
  * scores s = sigmoid(z); selection scores c = s + e_score_correction_bias
    (the bias steers which experts are picked, never how much they weigh);
  * the E experts fall in n_group consecutive groups; a group's score is the
    sum of its two best c; the topk_group best groups stay, the others' experts
    are out;
  * the num_experts_per_tok = k best c among the experts left are picked;
  * their weights are s (unbiased), divided by (their sum + 1e-20) when
    norm_topk_prob, then times routed_scaling_factor;
  * the layer's output is sum_j weight_j * expert_j(x) plus the shared experts' SwiGLU.

A routing margin says how far a token is from picking another set: the gap
between the k-th and the (k+1)-th selection score among the kept groups'
experts and, when groups are dropped, the gap between the topk_group-th and
the next group's score; the smaller of the two (float64; inf when nothing
could flip). A margin under a precision's noise is a router near tie: an
engine in that precision may honestly pick another expert.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ddschema.config import MoeConfig

NORM_EPS = 1e-20   # added to the weights' sum before dividing (DeepSeek's and Hugging Face's code)


class Selection(NamedTuple):
    """One MoE layer's choice for T tokens.

    experts: [T, k] long, ascending per row
    weights: [T, k] float64, the weight of experts[t, j]
    margin:  [T] float64 >= 0, the distance to a different choice (the module docstring)
    """

    experts: Tensor
    weights: Tensor
    margin: Tensor


def _top_gap(values: Tensor, k: int) -> Tensor:
    """values [T, n] (-inf for excluded) -> [T]: k-th largest minus (k+1)-th, inf if there is no (k+1)-th."""
    if values.shape[1] <= k:
        return torch.full(values.shape[:1], float("inf"), dtype=values.dtype)
    top = torch.topk(values, k + 1, dim=-1).values  # [T, k+1]
    gap = top[:, k - 1] - top[:, k]
    return torch.where(torch.isinf(top[:, k]), torch.full_like(gap, float("inf")), gap)


def select_experts(logits: Tensor, bias: Tensor, moe: MoeConfig) -> Selection:
    """Route T tokens: logits [T, E] float64 (hidden @ gate.weight^T), bias [E]."""
    t, e = logits.shape
    scores = torch.sigmoid(logits)  # [T, E]
    choice = scores + bias[None, :]  # [T, E] selection scores
    per_group = e // moe.n_group
    grouped = choice.view(t, moe.n_group, per_group)  # [T, G, E/G]
    group_scores = torch.topk(grouped, min(2, per_group), dim=-1).values.sum(-1)  # [T, G]
    kept_groups = torch.topk(group_scores, moe.topk_group, dim=-1).indices  # [T, topk_group]
    keep = torch.zeros(t, moe.n_group, dtype=torch.bool, device=logits.device)
    keep.scatter_(1, kept_groups, True)
    candidates = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))  # [T, E]
    k = moe.num_experts_per_tok
    picked = torch.topk(candidates, k, dim=-1).indices  # [T, k]
    experts = picked.sort(dim=-1).values  # [T, k] ascending
    weights = scores.gather(1, experts)  # [T, k] unbiased
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + NORM_EPS)
    weights = weights * moe.routed_scaling_factor
    margin = _top_gap(candidates, k)  # [T]
    if moe.topk_group < moe.n_group:
        margin = torch.minimum(margin, _top_gap(group_scores, moe.topk_group))
    return Selection(experts, weights, margin)


def combine(x: Tensor, selection: Selection, expert, shared) -> Tensor:
    """sum_j weights[t, j] * expert(experts[t, j], x[rows]) (+ shared(x)): x [T, hidden] -> [T, hidden].
    `expert(e, rows_x)` and `shared(x)` are SwiGLUs [N, hidden] -> [N, hidden]; shared may be None."""
    out = torch.zeros_like(x)  # [T, hidden]
    for e in selection.experts.unique().tolist():
        rows, slot = torch.nonzero(selection.experts == e, as_tuple=True)  # token rows choosing e, its slot there
        out.index_add_(0, rows, expert(e, x[rows]) * selection.weights[rows, slot][:, None])
    return out if shared is None else out + shared(x)
