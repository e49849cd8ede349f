"""The engine's MoE router (harness/engine/model/moe.py): group-limited top-k
over biased sigmoid scores, unbiased weights normalized and scaled, and the
gap to the nearest other choice."""
from __future__ import annotations

import torch

from ddschema import MoeConfig
from harness.engine.model.moe import route

MOE = MoeConfig(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=4, n_group=4, topk_group=2,
                routed_scaling_factor=2.5)


def _logits(scores: list[float]) -> torch.Tensor:
    p = torch.tensor([scores], dtype=torch.float64)
    return torch.log(p / (1 - p))   # sigmoid(logits) == scores


def test_the_best_expert_of_a_losing_group_is_not_picked():
    # groups (0,1) (2,3) (4,5) (6,7): expert 0 is the best single score, but group 0's top-two sum is the lowest
    r = route(MOE, _logits([0.9, 0.01, 0.6, 0.55, 0.7, 0.5, 0.1, 0.1]), torch.zeros(8))
    assert r.experts.tolist() == [[2, 4]]   # groups kept: (4,5) 1.2 and (2,3) 1.15; (0,1) 0.91 is dropped


def test_bias_chooses_but_the_weights_are_the_unbiased_scores_normalized_and_scaled():
    scores = [0.5, 0.4, 0.3, 0.2, 0.45, 0.1, 0.1, 0.1]
    bias = torch.tensor([0.0, 0.3, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    r = route(MOE, _logits(scores), bias)
    assert r.experts.tolist() == [[0, 1]]   # expert 1 (0.4 + 0.3) beats expert 4 (0.45) only through the bias
    want = torch.tensor([0.5, 0.4]) / 0.9 * 2.5
    assert torch.allclose(r.weights[0], want.float(), atol=1e-6)


def test_the_gap_is_the_distance_to_the_nearest_other_choice():
    r = route(MOE, _logits([0.8, 0.7, 0.75, 0.1, 0.2, 0.1, 0.1, 0.1]), torch.zeros(8))
    # experts: 0 (0.8) and 2 (0.75); next eligible 1 (0.7): gap 0.05; the groups (1.5, 0.85 | 0.3, 0.2) are far apart
    assert r.experts.tolist() == [[0, 2]] and abs(float(r.gap[0]) - 0.05) < 1e-6


def test_a_cuda_graph_replay_reads_its_buckets_captured_routing():
    """A CUDA replay runs no Python: the routing tensors kept at the bucket's capture (which the replay rewrites
    in the graph's memory) are read back; a capture's warm-up and capture forwards keep the last one's."""
    from types import SimpleNamespace
    from harness.engine.loop import Engine
    from harness.engine.model.presets import PRESETS
    engine = Engine.__new__(Engine)
    engine.cfg, engine._graph_routing = PRESETS["tiny-deepseek-v3"], {}   # one MoE layer
    engine.graph = SimpleNamespace(last=SimpleNamespace(bucket=4))
    assert engine._round_routing(["warm-up", "capture"]) == ["capture"]
    assert engine._round_routing([]) == ["capture"]
    engine.graph.last.bucket = 2
    assert engine._round_routing([]) is None and engine._round_routing(None) is None
