"""DenseOracle: the ddschema Oracle protocol answered by brute force.

Every answer comes from a fresh, full, causal float64 forward of DenseLlama
over an explicit token sequence. No KV cache, no tree mask, no shared work
between nodes or steps: correctness by construction, speed not a goal.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from ddschema.config import ModelConfig
from reference.accept import ReferenceAcceptance, greedy_acceptance
from reference.checkpoint import load_checkpoint
from reference.model import DenseLlama
from reference.tree import ReferenceTree, best_first_tree


def validate_tree(tokens: Sequence[int], parents: Sequence[int]) -> None:
    """Raise ValueError unless (tokens, parents) is a tree in topological order:
    same length >= 1, parents[0] == -1 and 0 <= parents[i] < i for i >= 1."""
    if len(tokens) != len(parents):
        raise ValueError(f"tokens ({len(tokens)}) and parents ({len(parents)}) differ in length")
    if len(tokens) == 0:
        raise ValueError("a tree needs at least its root")
    if parents[0] != -1:
        raise ValueError(f"parents[0] must be -1 (the root), got {parents[0]}")
    for i in range(1, len(parents)):
        if not 0 <= parents[i] < i:
            raise ValueError(f"parents[{i}] = {parents[i]} must satisfy 0 <= parent < {i}")


def root_path(tokens: Sequence[int], parents: Sequence[int], node: int) -> list[int]:
    """Tokens from the root down to `node`, both included."""
    path = []
    while node != -1:
        path.append(int(tokens[node]))
        node = parents[node]
    return path[::-1]


class DenseOracle:
    """ddschema.Oracle over a DenseLlama. All outputs are float64 on CPU."""

    def __init__(self, config: ModelConfig, weights: dict[str, Tensor]) -> None:
        self.config = config
        self.model = DenseLlama(config, weights)

    @classmethod
    def from_checkpoint(cls, directory, **options) -> "DenseOracle":
        """The oracle over its own reading of a checkpoint directory
        (reference/checkpoint.py); raises CheckpointRefused (a ValueError)."""
        config, weights = load_checkpoint(directory)
        return cls(config, weights, **options)

    def weight(self, name: str) -> Tensor:
        """The float64 tensor the oracle computes with under `name` (for a
        tied checkpoint, lm_head.weight is the embedding)."""
        return self.model.w[name]

    def acceptance(self, tokens: Sequence[int], parents: Sequence[int], logits: Tensor) -> ReferenceAcceptance:
        """The oracle's own greedy walk over a tree (reference/accept.py)."""
        return greedy_acceptance(tokens, parents, logits)

    def draft_tree(self, root_token: int, draft_logprobs: Tensor, budget: int, topk: int) -> ReferenceTree:
        """The oracle's own best-first DDTree from a draft distribution (reference/tree.py)."""
        return best_first_tree(root_token, draft_logprobs, budget, topk)

    def tree_logits(self, prefix: Sequence[int], tokens: Sequence[int],
                    parents: Sequence[int]) -> Tensor:
        """Logits [n, V] float64: row i is the last position of a causal
        forward over prefix + root_path(node i). One forward per node."""
        validate_tree(tokens, parents)
        rows = []
        for node in range(len(tokens)):
            sequence = list(prefix) + root_path(tokens, parents, node)
            rows.append(self.model.forward(sequence, last_logits_only=True).logits[-1])  # [V]
        return torch.stack(rows)  # [n, V]

    def greedy(self, prompt: Sequence[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
        """Argmax continuation recomputing the whole sequence each step.

        Returns (new tokens, gaps) with gaps[t] = top-1 minus top-2 logit at
        step t (>= 0; ties go to the lowest token id, as torch.argmax does).
        """
        if len(prompt) == 0:
            raise ValueError("greedy needs a non-empty prompt")
        if max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        sequence, emitted, gaps = list(prompt), [], []
        for _ in range(max_new_tokens):
            last = self.model.forward(sequence, last_logits_only=True).logits[-1]  # [V]
            token = int(torch.argmax(last))
            gaps.append(top_gap(last))
            emitted.append(token)
            sequence.append(token)
        return emitted, gaps

    def path_hidden(self, tokens: Sequence[int]) -> list[Tensor]:
        """Residual stream at the last position after the embedding and after
        each layer: num_layers + 1 tensors [hidden] float64."""
        hiddens = self.model.forward(list(tokens)).hiddens
        return [h[-1].clone() for h in hiddens]

    def path_kv(self, tokens: Sequence[int]) -> tuple[list[Tensor], list[Tensor]]:
        """Per layer K (after RoPE) and V [len(tokens), kv_heads, head_dim]."""
        result = self.model.forward(list(tokens))
        return list(result.ks), list(result.vs)


def top_gap(logits: Tensor) -> float:
    """Top-1 minus top-2 of logits [V]; 0.0 would be an exact tie. inf for V == 1."""
    if logits.numel() < 2:
        return float("inf")
    top2 = torch.topk(logits, 2).values  # [2]
    return float(top2[0] - top2[1])
