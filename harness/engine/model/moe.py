"""DeepSeek-V3's mixture of experts on the engine's side: a sigmoid router
with the correction bias used for choosing only, group-limited top-k (a group
scores the sum of its two best biased scores), the chosen experts' unbiased
scores as weights (normalized if norm_topk_prob, times routed_scaling_factor),
plus the shared experts, always on. The router's logits are taken in the run
dtype (as SGLang's gate GEMM), the scoring in float32.

Each forward records the rows' routing (harness/check/compare/router_tie.py
reads it): the chosen experts and the gap between the last chosen and the
best unchosen biased score, the engine's own margin.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ddschema import MoeConfig


@dataclass(frozen=True)
class LayerRouting:
    """One layer's routing of T rows: experts  # [T, k] int64 (sorted), weights  # [T, k] float32,
    gap  # [T] float32 distance to the nearest other choice: the k-th chosen minus the best unchosen expert's
    biased score in the kept groups, or the last kept group's score minus the next group's, the smaller."""

    layer: int
    experts: torch.Tensor
    weights: torch.Tensor
    gap: torch.Tensor


def route(moe: MoeConfig, logits: torch.Tensor, bias: torch.Tensor, layer: int = -1) -> LayerRouting:
    """logits  # [T, experts] router logits; bias  # [experts] the correction bias."""
    scores = torch.sigmoid(logits.float())                                       # [T, E]
    choice = scores + bias.float()[None]
    T, E, k = scores.shape[0], moe.n_routed_experts, moe.num_experts_per_tok
    groups = choice.view(T, moe.n_group, E // moe.n_group)
    group_score = groups.topk(2, dim=-1).values.sum(-1)                           # [T, groups]
    kept = group_score.topk(moe.topk_group, dim=-1).indices                       # [T, topk_group]
    eligible = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, kept, True)
    eligible = eligible[:, :, None].expand_as(groups).reshape(T, E)               # [T, E]
    masked = choice.masked_fill(~eligible, float("-inf"))
    ranked = masked.topk(min(k + 1, E), dim=-1)
    experts = ranked.indices[:, :k]
    if ranked.values.shape[1] > k:
        gap = (ranked.values[:, k - 1] - ranked.values[:, k]).nan_to_num(posinf=float("inf"))
    else:
        gap = torch.full((T,), float("inf"), device=scores.device)
    if moe.topk_group < moe.n_group:
        ranked_groups = group_score.topk(moe.topk_group + 1, dim=-1).values
        gap = torch.minimum(gap, ranked_groups[:, -2] - ranked_groups[:, -1])
    weights = scores.gather(1, experts)                                           # [T, k]
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    weights = weights * moe.routed_scaling_factor
    order = experts.argsort(-1)
    return LayerRouting(layer, experts.gather(1, order), weights.gather(1, order), gap)


def swiglu(x: torch.Tensor, w: dict, prefix: str) -> torch.Tensor:
    gate = F.linear(x, w[prefix + "gate_proj.weight"])
    return F.linear(F.silu(gate) * F.linear(x, w[prefix + "up_proj.weight"]), w[prefix + "down_proj.weight"])


@dataclass(frozen=True)
class MoeLayer:
    """One MoE layer's forward (the model's MLP registry entry "moe")."""

    layer: int

    @staticmethod
    def build(model, layer: int) -> "MoeLayer":
        return MoeLayer(layer)

    def __call__(self, model, x: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """x  # [T, hidden] normed -> [T, hidden]; rows' experts read the hidden state the dispatch
        stage names for them (each row its own)."""
        moe, w = model.cfg.moe, model.w
        p = f"model.layers.{self.layer}.mlp."
        src = model.stages.moe_dispatch(positions, meta)                          # [T] row whose state it routes
        xs = x[src]
        r = route(moe, F.linear(xs, w[p + "gate.weight"]), w[p + "gate.e_score_correction_bias"], self.layer)
        if model.routing_out is not None:
            model.routing_out.append(r)
        out = torch.zeros_like(x, dtype=torch.float32)                            # [T, hidden]
        # every expert over every row, weighted 0 where not chosen: no host sync, so a CUDA graph captures it
        for e in range(moe.n_routed_experts):
            weight = (r.weights * (r.experts == e)).sum(-1)                       # [T] float32
            out += swiglu(xs, w, p + f"experts.{e}.").float() * weight[:, None]
        out = out.to(x.dtype)
        if moe.n_shared_experts:
            out = out + swiglu(x, w, p + "shared_experts.")
        return out
