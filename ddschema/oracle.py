"""The contract an oracle fulfils; harness/ finds one through an entry point.

harness/ never imports reference/: the CLI looks the oracle up in the
`ddcheck.oracles` entry-point group (pyproject.toml) and talks to it only
through this protocol, with plain lists and tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from ddschema.config import ModelConfig


@dataclass(frozen=True)
class Routing:
    """Which routed experts each of n tokens picked in each MoE layer, and how
    close it came to picking others.

    experts: [n, L, k] int64, ascending along k (L = len(layers) MoE layers,
             k = num_experts_per_tok)
    margin:  [n, L] float64 >= 0: the selection-score gap to the nearest
             different choice (the k-th minus the (k+1)-th expert's biased
             sigmoid score among the kept groups, or the last kept group's
             score minus the next one's, whichever is smaller; inf when no
             other choice exists). Under a precision's noise: a router near tie.
    layers:  the MoE layers' indices, ascending
    """

    experts: torch.Tensor
    margin: torch.Tensor
    layers: tuple[int, ...]

    def __post_init__(self) -> None:
        e, m = self.experts, self.margin
        if e.dim() != 3 or e.dtype != torch.int64:
            raise ValueError(f"Routing.experts must be int64 [n, L, k], got {e.dtype} {list(e.shape)}")
        if m.dtype != torch.float64 or tuple(m.shape) != tuple(e.shape[:2]):
            raise ValueError(f"Routing.margin must be float64 [n, L] = {list(e.shape[:2])}, got {m.dtype} {list(m.shape)}")
        if len(self.layers) != e.shape[1] or list(self.layers) != sorted(set(self.layers)):
            raise ValueError(f"Routing.layers must name the {e.shape[1]} MoE layers in ascending order")
        if e.shape[2] > 1 and not bool((e[..., 1:] > e[..., :-1]).all()):
            raise ValueError("Routing.experts must be distinct and ascending along k")
        if bool((m < 0).any()) or bool(m.isnan().any()):
            raise ValueError("Routing.margin must be >= 0")


class Oracle(Protocol):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None: ...

    config: ModelConfig  # the oracle's own reading of the model

    @classmethod
    def from_checkpoint(cls, directory, device: str = "cpu", **options) -> "Oracle":
        """The oracle over its OWN reading of a Hugging Face checkpoint
        directory (config.json + *.safetensors): the harness never hands it
        parsed weights in a run. `device`: where it computes (float64 there;
        its outputs are on the CPU all the same). Raises ValueError for a
        checkpoint it refuses."""

    def weight(self, name: str) -> torch.Tensor:
        """The tensor it computes with under a Hugging Face name (float64;
        `lm_head.weight` is the embedding when the embeddings are tied)."""

    def acceptance(self, tokens: Sequence[int], parents: Sequence[int], logits: torch.Tensor):
        """Its own greedy walk over a tree given its logits [n, vocab]: an
        object with `rows` (accepted rows, root first), `bonus` and `gaps`
        (top-1 minus top-2 logit at each accepted row)."""

    def draft_tree(self, root_token: int, draft_logprobs: torch.Tensor, budget: int, topk: int):
        """Its own best-first DDTree from draft log-probs [L, vocab]: an object
        with `tokens`, `parents` (-1 for the root), `depths`, `scores` and
        `paths()` (each row's draft tokens, root ())."""

    def tree_logits(self, prefix: Sequence[int], tokens: Sequence[int],
                    parents: Sequence[int]) -> torch.Tensor:
        """Float64 logits [n, vocab] of every tree node.

        `tokens[0]` is the root (parent -1), `parents[i] < i` for the others.
        Node i's logits are the last position of plain causal attention over
        prefix + (root .. node i path).
        """

    def rounded_tree_logits(self, prefix: Sequence[int], tokens: Sequence[int], parents: Sequence[int],
                            dtype: str, probabilities: bool = False) -> torch.Tensor:
        """tree_logits [n, vocab] (float64 values) of the same model computed
        with every stored tensor (weights and activations) rounded to `dtype`
        ("bfloat16" or "float16") by the oracle's own code: an independent
        low-precision computation, the noise yardstick of bf16/fp16 verdicts.
        probabilities: attention's unnormalized probabilities are rounded to
        `dtype` before P @ V too, where the engine's kernel stores them there
        (the backend's `probability_dtype`)."""

    def greedy(self, prompt: Sequence[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
        """Plain autoregressive greedy continuation and, per emitted token,
        the gap between its logit and the runner-up's (for near-tie verdicts)."""

    def path_hidden(self, tokens: Sequence[int]) -> list[torch.Tensor]:
        """Hidden state of the last position after the embedding and after
        each layer: num_layers + 1 tensors [hidden], float64."""

    def path_kv(self, tokens: Sequence[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer K and V [len(tokens), kv_heads, head_dim] (K after RoPE)."""

    # optional: the harness asks with getattr(oracle, "prepare_step", None) and calls it before a step's
    # tree_logits / rounded_tree_logits calls; an oracle without it answers each call on its own

    def prepare_step(self, trees: Sequence[tuple[Sequence[int], Sequence[int], Sequence[int]]],
                     rounded: Sequence[tuple[str, bool]] = ()) -> None:
        """A verify step's trees, (prefix, tokens, parents) per request, about
        to be asked for by tree_logits and, per (dtype, probabilities) in
        `rounded`, by rounded_tree_logits: the oracle may judge them together
        now (one pass over its weights) and answer those calls from it. The
        answers must equal the per-call ones (the same definition)."""

    # optional, for multi-head latent attention and mixture-of-experts models (DeepSeek-V3 layout);
    # the harness asks with getattr(oracle, "path_latent", None)

    def path_latent(self, tokens: Sequence[int]) -> torch.Tensor:
        """Per layer and position the cached MLA latent [num_layers, len(tokens),
        kv_lora_rank + qk_rope_head_dim] float64: the normed compressed latent,
        then the RoPE key rotated at the position, its pairs (2i, 2i+1)
        interleaved as the checkpoint stores them. ValueError for a model without MLA."""

    def routing(self, prefix: Sequence[int], tokens: Sequence[int], parents: Sequence[int]) -> "Routing | None":
        """Each tree node's expert choice and margin at its own position of
        prefix + root_path(node) (as tree_logits); None for a model without routed experts."""

    def rounded_routing(self, prefix: Sequence[int], tokens: Sequence[int], parents: Sequence[int],
                        dtype: str) -> "Routing | None":
        """routing() of rounded_tree_logits' model (every stored tensor in `dtype`): the oracle's
        own low-precision choice, the yardstick of a router near tie."""
