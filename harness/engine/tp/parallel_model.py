"""The model on one tensor-parallel rank: the engine's own Llama code over
the rank's shard (sharding.py), with the collectives SGLang places: an
all-reduce after o_proj and after down_proj (row-parallel partial sums),
and the vocabulary-sharded logits gathered.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

import torch

from ddschema import ModelConfig
from harness.engine.model.llama import LlamaModel
from harness.engine.tp.group import Group
from harness.engine.tp.sharding import RankShard, rank_config, shard_weights


class TPLlamaModel(LlamaModel):
    """`forward` returns the full logits  # [T, vocab] float32, identical on every rank."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], shard: RankShard, group: Group,
                 dtype: torch.dtype, device: str):
        super().__init__(rank_config(cfg, shard), shard_weights(cfg, weights, shard), dtype, device)
        self.full_cfg, self.shard, self.group = cfg, shard, group

    def forward(self, input_ids, positions, meta, pool, backend, hidden_out=None) -> torch.Tensor:
        local = super().forward(input_ids, positions, meta, pool, backend, hidden_out)  # [T, vocab_r]
        return self.group.all_gather_last(local)[:, :self.full_cfg.vocab_size]        # [T, vocab]

    def _attention(self, i, p, x, cos, sin, meta, pool, backend) -> torch.Tensor:
        return self.group.all_reduce(super()._attention(i, p, x, cos, sin, meta, pool, backend))  # [T, hidden]

    def _mlp(self, p, x) -> torch.Tensor:
        return self.group.all_reduce(super()._mlp(p, x))   # [T, hidden]
