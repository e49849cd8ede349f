"""Stage 1, draft: L = block_size - 1 independent per-position distributions
per round, as a DFlash block-diffusion drafter returns them.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DrafterConfig:
    block_size: int = 8
    sharpness: float = 4.0   # logit boost of the drafter's chosen top-1 token
    noise: float = 1.0       # std of the background logits

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")

    @property
    def depth_cap(self) -> int:
        return self.block_size - 1


class NoisyOracleDrafter:
    """Seeded stand-in for a trained drafter: at each depth the target's own
    greedy token is the drafter's top-1 with probability `accuracy` (per
    request), otherwise a random other token is, and the true token still gets
    some mass so wide trees (topk > 1) can recover it.

    `continuation` is the target's greedy continuation of the prompt; an
    accurate (code-like) request therefore fills deep trees and an inaccurate
    (poem-like) one stops early, as the seed's two prompts did.
    """

    def __init__(self, cfg: DrafterConfig, vocab: int, seed: int) -> None:
        self.cfg = cfg
        self.vocab = vocab
        self.seed = seed

    def propose(self, continuation: list[int], emitted: int, accuracy: float,
                request_seed: int, step: int) -> torch.Tensor:
        """draft_logprobs  # [L, vocab] for depths 1..L after `emitted` tokens."""
        gen = torch.Generator().manual_seed(hash((self.seed, request_seed, step)) % (2**63))
        L = self.cfg.depth_cap
        logits = self.cfg.noise * torch.randn((L, self.vocab), generator=gen, dtype=torch.float64)
        hits = torch.rand(L, generator=gen, dtype=torch.float64) < accuracy
        decoys = torch.randint(0, self.vocab, (L,), generator=gen)
        for d in range(L):
            idx = emitted + d
            true_tok = continuation[idx] if idx < len(continuation) else int(decoys[d])
            if hits[d]:
                logits[d, true_tok] += self.cfg.sharpness
            else:
                decoy = int(decoys[d]) if int(decoys[d]) != true_tok else (true_tok + 1) % self.vocab
                logits[d, decoy] += self.cfg.sharpness
                logits[d, true_tok] += self.cfg.sharpness / 2
        return torch.log_softmax(logits, dim=-1)
