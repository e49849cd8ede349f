"""Stage 1, draft: L = block_size - 1 independent per-position distributions
per round, as a DFlash block-diffusion drafter returns them.

Two drafters (DRAFTERS, `--drafter`): `noisy`, a seeded stand-in that plants
the target's greedy token or a decoy on top of random logits, and `self`, a
self-draft from the target's own first k layers with its final norm and
output head (an early exit), run along the target's greedy chain. Both see
the greedy chain, as a drafter conditioned on the accepted context would;
`self` proposes what a model of the target's own weights proposes, near ties
and plausible alternatives included, which the noisy stand-in cannot.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class DrafterConfig:
    block_size: int = 8
    sharpness: float = 4.0   # logit boost of the drafter's chosen top-1 token
    noise: float = 1.0       # std of the background logits
    kind: str = "noisy"      # a key of DRAFTERS
    layers: int = 1          # the self-draft's k: the target's first k layers

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.kind not in DRAFTERS:
            raise ValueError(f"drafter must be one of {', '.join(DRAFTERS)}, got {self.kind!r}")
        if self.layers < 1:
            raise ValueError(f"the self-draft's layers must be >= 1, got {self.layers}")

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

    def propose(self, r, step: int) -> torch.Tensor:
        """draft_logprobs  # [L, vocab] for depths 1..L after request r's emitted tokens."""
        return self.propose_along(r.continuation, len(r.emitted), r.spec.accuracy, r.rid, step)

    def propose_along(self, continuation: list[int], emitted: int, accuracy: float,
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


class SelfDrafter:
    """The target's first `cfg.layers` layers + final norm + output head over
    the prompt followed by the target's greedy continuation (one causal pass
    per request, kept): the draft for depth d after e emitted tokens is the
    early exit's next-token distribution at the position of the greedy chain's
    token e - 2 + d (depth 1: at the root, the last emitted token)."""

    def __init__(self, cfg: DrafterConfig, model) -> None:
        from harness.engine.model.llama import LlamaModel
        t = model.cfg
        k = min(cfg.layers, t.num_layers)
        sliding = tuple(i for i in t.sliding_layers if i < k)
        cut = replace(t, num_layers=k, sliding_layers=sliding, sliding_window=t.sliding_window if sliding else None)
        self.cfg = cfg
        self.early = LlamaModel(cut, model.w, model.dtype, model.inv_freq.device.type)  # the target's tensors, shared
        self.chains: dict[int, torch.Tensor] = {}   # rid -> [prompt + continuation, vocab] float64 log-probs

    def propose(self, r, step: int) -> torch.Tensor:
        if r.rid not in self.chains:
            self.chains[r.rid] = early_exit_logprobs(self.early, list(r.prompt) + list(r.continuation))
        lp, L = self.chains[r.rid], self.cfg.depth_cap
        start = len(r.prompt) + len(r.emitted) - 1    # the root's position in the chain
        rows = lp[start:start + L]                     # [<= L, vocab]
        if rows.shape[0] < L:   # past the chain's end: the last row repeated (never reached within max_new_tokens)
            rows = torch.cat([rows, rows[-1:].expand(L - rows.shape[0], -1)])
        return rows


def early_exit_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """log_softmax of `model`'s logits at every position of one causal pass
    over `tokens` through the plain torch backend  # [len(tokens), vocab] float64."""
    from harness.engine.attn.torch_backend import TorchBackend
    from harness.engine.ddtree.verify_inputs import prefill_metadata
    from harness.engine.mem.pool import KVPool
    device = model.inv_freq.device.type
    n = len(tokens)
    pool = KVPool(model.cfg, n + 1, model.dtype, device)
    meta = prefill_metadata([n], torch.arange(1, n + 1, device=device)).to(device)
    logits = model.forward(torch.tensor(tokens, device=device), torch.arange(n, device=device), meta, pool,
                           TorchBackend(device, model.dtype))
    return torch.log_softmax(logits.double().cpu(), dim=-1)


DRAFTERS = {"noisy": lambda cfg, model, seed: NoisyOracleDrafter(cfg, model.cfg.vocab_size, seed),
            "self": lambda cfg, model, seed: SelfDrafter(cfg, model)}


def make_drafter(cfg: DrafterConfig, model, seed: int):
    """The drafter `cfg.kind` names, over the target `model` (a LlamaModel)."""
    return DRAFTERS[cfg.kind](cfg, model, seed)
