"""How one tensor-parallel rank holds the model, as SGLang shards it:
query heads split evenly; KV heads split evenly when there are at least as
many as ranks, else each replicated over tp / num_kv_heads ranks (the rank
holds the one KV head its query heads read); q/k/v and gate/up split by
output rows (column parallel), o_proj and down_proj by input columns (row
parallel, summed by an all-reduce; o_proj's bias added on rank 0 only); the
LM head split by vocabulary rows (padded to a multiple of tp), its logits
gathered. Embeddings and norms are replicated.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from ddschema import ModelConfig
from harness.engine.settings import UsageError

# (rank, tp, num_kv_heads) -> the KV heads this rank holds
KVHeadLayout = Callable[[int, int, int], tuple[int, ...]]


def kv_heads_of_rank(rank: int, tp: int, num_kv_heads: int) -> tuple[int, ...]:
    """SGLang's rule: an even split, or (fewer KV heads than ranks) the one
    head of rank // (tp / num_kv_heads), replicated on that many ranks."""
    if num_kv_heads >= tp:
        per = num_kv_heads // tp
        return tuple(range(rank * per, (rank + 1) * per))
    return (rank // (tp // num_kv_heads),)


@dataclass(frozen=True)
class RankShard:
    """What rank `rank` of `tp` holds (head and row indices of the full model)."""

    rank: int
    tp: int
    q_heads: tuple[int, ...]
    kv_heads: tuple[int, ...]
    mlp_rows: tuple[int, int]     # [start, end) of intermediate_size
    vocab_rows: tuple[int, int]   # [start, end) of the padded vocabulary (rows past vocab_size are zero)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.tp:
            raise ValueError(f"rank {self.rank} is outside a group of {self.tp}")
        if not self.q_heads or not self.kv_heads:
            raise ValueError(f"rank {self.rank} holds no query or no KV head")
        if self.mlp_rows[0] >= self.mlp_rows[1] or self.vocab_rows[0] >= self.vocab_rows[1]:
            raise ValueError(f"rank {self.rank}: empty MLP or vocabulary shard")


def tp_refusal(cfg: ModelConfig, tp: int) -> str | None:
    """Why `cfg` cannot be sharded over `tp` ranks (None: it can)."""
    if cfg.mla is not None or cfg.moe is not None:
        return "--tp shards Llama-family attention and a dense MLP; this model uses MLA or MoE layers"
    if cfg.num_heads % tp:
        return f"--tp {tp} must divide the model's {cfg.num_heads} attention heads"
    kv = cfg.num_kv_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        return f"--tp {tp} and the model's {kv} KV heads: one must divide the other"
    if cfg.intermediate_size % tp:
        return f"--tp {tp} must divide the model's intermediate size {cfg.intermediate_size}"
    return None


def shard_plan(cfg: ModelConfig, rank: int, tp: int, kv_layout: KVHeadLayout = kv_heads_of_rank) -> RankShard:
    reason = tp_refusal(cfg, tp)
    if reason:
        raise UsageError(reason)
    hq, mlp, vocab = cfg.num_heads // tp, cfg.intermediate_size // tp, -(-cfg.vocab_size // tp)
    return RankShard(rank, tp, tuple(range(rank * hq, (rank + 1) * hq)), tuple(kv_layout(rank, tp, cfg.num_kv_heads)),
                     (rank * mlp, (rank + 1) * mlp), (rank * vocab, (rank + 1) * vocab))


def kv_heads_read(cfg: ModelConfig, q_heads: tuple[int, ...]) -> tuple[int, ...]:
    """The KV heads the query heads `q_heads` read under GQA (head h reads h // group)."""
    group = cfg.num_heads // cfg.num_kv_heads
    return tuple(sorted({h // group for h in q_heads}))


def rank_config(cfg: ModelConfig, shard: RankShard) -> ModelConfig:
    """The rank's own view: its heads and MLP rows; the vocabulary stays whole (the logits are gathered)."""
    return replace(cfg, num_heads=len(shard.q_heads), num_kv_heads=len(shard.kv_heads),
                   intermediate_size=shard.mlp_rows[1] - shard.mlp_rows[0], tie_word_embeddings=False)


def shard_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], shard: RankShard) -> dict[str, torch.Tensor]:
    """The rank's tensors (views where a slice is contiguous; the caller casts and places them)."""
    d = cfg.head_dim
    q_rows = _head_rows(shard.q_heads, d)
    kv_rows = _head_rows(shard.kv_heads, d)
    m0, m1 = shard.mlp_rows
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            out[name] = t[q_rows]
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias",
                            "self_attn.v_proj.weight", "self_attn.v_proj.bias")):
            out[name] = t[kv_rows]
        elif name.endswith("self_attn.o_proj.weight"):
            out[name] = t[:, q_rows]                              # [hidden, heads_r * d]
        elif name.endswith("self_attn.o_proj.bias"):
            if shard.rank == 0:                                   # added once before the all-reduce
                out[name] = t
        elif name.endswith("self_attn.sinks"):
            out[name] = t[list(shard.q_heads)]                    # [heads_r]
        elif name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            out[name] = t[m0:m1]
        elif name.endswith("mlp.down_proj.weight"):
            out[name] = t[:, m0:m1]
        elif name == "lm_head.weight":
            continue
        else:
            out[name] = t                                          # embeddings and norms: replicated
    head = weights["model.embed_tokens.weight"] if cfg.tie_word_embeddings else weights["lm_head.weight"]
    out["lm_head.weight"] = _vocab_rows(head, *shard.vocab_rows)   # [vocab_r, hidden]
    return out


def _head_rows(heads: tuple[int, ...], d: int) -> torch.Tensor:
    return torch.cat([torch.arange(h * d, (h + 1) * d) for h in heads])


def _vocab_rows(head: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows [start, end) of the LM head, zero past its end (the padded vocabulary)."""
    rows = head[start:min(end, head.shape[0])]
    if rows.shape[0] == end - start:
        return rows
    return torch.cat([rows, head.new_zeros(end - start - rows.shape[0], head.shape[1])])
