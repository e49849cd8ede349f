"""StreamedOracle: the whole-model oracle's answers, holding one layer at a time.

A 70B-class model in float64 (560 GB) fits no GPU and few hosts. This oracle
never holds it: every forward runs layer by layer over every sequence it
judges at once, reading layer l's weights from the checkpoint
(reference/lazy_checkpoint.py), running every pending sequence's rows
through it, and letting it go before layer l + 1. The embedding is read by
the rows its tokens use, the output projection a slice of the vocabulary at
a time. Memory: one layer's float64 weights, plus the activations and K/V
of the sequences in flight (a step's prefix and its leaf paths).

The arithmetic is the whole-model oracle's own: DenseLlama's decoder_layer,
embed and head (reference/model.py) over the weights held now, float64 on
the oracle's device. What differs is the order of work, not the math: a
step's leaf paths go through each layer together (their rows share the
projections' matmuls), so a float64 result can differ from the one-forward-
per-leaf whole-model oracle's in the last bits of a sum (tests hold both
equal to 1e-12).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import Tensor

from ddschema.config import ModelConfig
from reference.checkpoint import CheckpointRefused
from reference.lazy_checkpoint import LazyCheckpoint
from reference.model import DTYPE, DenseLlama, ForwardResult, rounding_to
from reference.oracle import DenseOracle, ancestry, leaves, validate_tree
from reference.prefix_cache import CausalPrefix, PrefixCache

VOCAB_ROWS = 32768   # output-projection rows held at once (a [32768, 8192] float64 slice: 2 GiB)
FOLD_MAX = 64        # a prefix's uncached tail up to this many tokens rides in front of every leaf path


@dataclass(frozen=True)
class PendingPath:
    """One sequence a streamed forward runs: its tokens and, optionally, the
    per-layer K/V of the causal prefix before it (DenseLlama.forward's `past`)."""

    tokens: tuple[int, ...]
    past: tuple[list[Tensor], list[Tensor]] | None = None
    judged_from: int = 0   # rows before this one get no logits (their K/V are still returned)

    def __post_init__(self) -> None:
        if len(self.tokens) == 0:
            raise ValueError("a streamed sequence needs at least one token")
        if not 0 <= self.judged_from < len(self.tokens):
            raise ValueError(f"judged_from {self.judged_from} must lie in [0, {len(self.tokens)})")


class InMemorySource:
    """Float64 tensors already in memory, read as LazyCheckpoint reads its files
    (for an oracle built over a dict, as the Oracle protocol's constructor takes)."""

    def __init__(self, config: ModelConfig, weights: Mapping[str, Tensor], device: str = "cpu") -> None:
        self.config, self.device = config, torch.device(device)
        self.w = {n: t.detach().to(device=self.device, dtype=DTYPE) for n, t in weights.items()}
        if config.tie_word_embeddings:
            self.w["lm_head.weight"] = self.w["model.embed_tokens.weight"]
        DenseLlama(config, self.w, device, owned=True)   # a missing tensor: KeyError, as the dense oracle raises

    def read(self, name: str) -> Tensor:
        return self.w[name]

    def rows(self, name: str, start: int, stop: int, out: Tensor | None = None) -> Tensor:
        return self.w[name][start:stop]

    def gather_rows(self, name: str, ids: Tensor) -> Tensor:
        return self.w[name][ids.to(self.device)]

    def layer(self, layer: int, buffers: dict | None = None) -> dict[str, Tensor]:
        prefix = f"model.layers.{layer}."
        return {n: t for n, t in self.w.items() if n.startswith(prefix)}


class StreamedLlama:
    """DenseLlama's forward, one layer's weights held at a time, over many sequences at once."""

    def __init__(self, config: ModelConfig, source, device: str = "cpu") -> None:
        self.config, self.source = config, source
        self.part = DenseLlama.over_part(config, device)
        self.buffers: dict[str, Tensor] = {}   # one layer's float64 tensors, refilled layer after layer

    def rounded(self, dtype: torch.dtype, probabilities: bool = False) -> "StreamedLlama":
        """The same model storing every tensor in `dtype` (DenseLlama.rounded's meaning), streamed too."""
        other = StreamedLlama(self.config, self.source, str(self.part.device))
        other.buffers = self.buffers   # the two never run at once: one layer's buffers serve both
        other.part.store = rounding_to(dtype)
        other.part.probs_store = other.part.store if probabilities else None
        return other

    def forward(self, token_ids: list[int], positions: list[int] | None = None, visible: Tensor | None = None,
                last_logits_only: bool = False, past: tuple[list[Tensor], list[Tensor]] | None = None) -> ForwardResult:
        """DenseLlama.forward's result for one sequence, except that `hiddens`
        hold each layer's LAST position only ([1, hidden]: what path_hidden reads)."""
        part = self.part
        seg = part.segment(token_ids, positions, visible, past)
        return self._run([seg], [past], [0], last_logits_only, keep_hiddens=True)[0]

    def forward_many(self, sequences: Sequence[PendingPath], last_logits_only: bool = False) -> list[ForwardResult]:
        """One causal forward per sequence (each over its own past), all
        through each layer together; hiddens are not kept (empty lists), and
        each sequence's logits start at its `judged_from` row ([T - judged_from, V])."""
        segs = [self.part.segment(list(q.tokens), past=q.past) for q in sequences]
        return self._run(segs, [q.past for q in sequences], [q.judged_from for q in sequences], last_logits_only,
                         keep_hiddens=False)

    def _run(self, segs: list, pasts: list, judged_from: list[int], last_only: bool,
             keep_hiddens: bool) -> list[ForwardResult]:
        part, src, c = self.part, self.source, self.config
        ends = torch.tensor([s.length for s in segs]).cumsum(0)  # [S] each segment's end row
        h = part.embed(src.gather_rows("model.embed_tokens.weight", torch.cat([s.ids for s in segs])))  # [N, hidden]
        hiddens = [[h[e - 1:e]] for e in ends.tolist()] if keep_hiddens else [[] for _ in segs]
        ks, vs = [[] for _ in segs], [[] for _ in segs]
        for layer in range(c.num_layers):
            part.hold({})   # the previous layer let go before this one is read: never two held
            part.hold(src.layer(layer, self.buffers))   # this layer's float64 weights, in the last one's memory
            layer_pasts = [None if p is None else (p[0][layer], p[1][layer]) for p in pasts]
            h, k, v = part.decoder_layer(layer, h, segs, layer_pasts)
            for i, e in enumerate(ends.tolist()):
                ks[i].append(k[i])
                vs[i].append(v[i])
                if keep_hiddens:
                    hiddens[i].append(h[e - 1:e])
        part.hold({})
        if last_only:
            rows, counts = h[(ends - 1).to(h.device)], [1] * len(segs)   # [S, hidden]
        else:
            spans = [(int(e) - s.length + j, int(e)) for s, e, j in zip(segs, ends.tolist(), judged_from)]
            rows, counts = torch.cat([h[a:b] for a, b in spans]), [b - a for a, b in spans]   # [judged rows, hidden]
        per_seg = self._head(rows).split(counts)   # each [judged rows of it, V]
        return [ForwardResult(lg, hiddens[i], ks[i], vs[i]) for i, lg in enumerate(per_seg)]

    def _head(self, h: Tensor) -> Tensor:
        """Logits [T, V] of the residual stream [T, hidden], the output projection a slice of rows at a time."""
        part, src, vocab = self.part, self.source, self.config.vocab_size
        part.hold({"model.norm.weight": src.read("model.norm.weight")})
        normed = part.final_norm(h)  # [T, hidden]
        out = []
        for start in range(0, vocab, VOCAB_ROWS):
            part.hold({})
            rows = src.rows("lm_head.weight", start, min(vocab, start + VOCAB_ROWS), self.buffers.get("lm_head"))
            self.buffers["lm_head"] = rows
            part.hold({"lm_head.weight": rows})
            out.append(part.unembed(normed))   # [T, rows]
        part.hold({})
        return torch.cat(out, dim=1)   # [T, V]

    __call__ = forward


class StreamedOracle(DenseOracle):
    """ddschema.Oracle answered as DenseOracle answers it, with a StreamedLlama:
    one decoder layer's float64 weights held at a time (see the module doc).
    All outputs are float64 on CPU."""

    def __init__(self, config: ModelConfig, weights, device: str = "cpu", owned: bool = False,
                 allow_missing: bool = False) -> None:
        """weights: a LazyCheckpoint (its tensors read when used), or a dict of tensors held in memory.
        allow_missing is accepted for the dense oracle's signature: the lazy reading refuses a missing tensor.
        Raises CheckpointRefused for multi-head latent attention (DeepSeek-V3: --oracle dense judges it)."""
        if config.mla is not None:
            raise CheckpointRefused("the streamed oracle runs Llama-family layers; multi-head latent attention "
                                    "(DeepseekV3ForCausalLM) is judged by the dense oracle (--oracle dense)")
        self.config = config
        source = weights if isinstance(weights, LazyCheckpoint) else InMemorySource(config, weights, device)
        self.source = source
        self.model = StreamedLlama(config, source, device)
        self.prefixes = PrefixCache()
        self.low_precision = {}

    @classmethod
    def from_checkpoint(cls, directory, device: str = "cpu", **options) -> "StreamedOracle":
        """The oracle over its own lazy reading of a checkpoint directory (only
        the headers now); raises CheckpointRefused (a ValueError)."""
        source = LazyCheckpoint(directory, device)
        return cls(source.config, source, device, **options)

    def weight(self, name: str) -> Tensor:
        """The float64 tensor under `name`, read now (lm_head.weight is the embedding when tied)."""
        return self.source.read(name)

    def _judge(self, model: StreamedLlama, prefixes: PrefixCache, prefix: Sequence[int], tokens: Sequence[int],
               parents: Sequence[int]) -> Tensor:
        """Every leaf's root path over the prefix's K/V, all leaves through
        each layer together, in ONE pass over the weights: the tokens the
        prefix gained since the cached one (the last step's commits, at most
        FOLD_MAX) run in front of every leaf path and are judged by none, and
        the first path's K/V of them extend the cache. [n, V] float64 on CPU
        (node i's row at its position in the first leaf's path below it)."""
        validate_tree(tokens, parents)
        if len(prefix) == 0:
            raise ValueError("tree_logits needs a non-empty prefix")
        base = prefixes.longest(prefix)
        more = tuple(int(t) for t in prefix[len(base.tokens):])
        if not base.tokens or len(more) > FOLD_MAX:   # a new prompt: its own pass, once
            base, more = prefixes.get(model, prefix), ()
        chains = [ancestry(parents, leaf) for leaf in leaves(parents)]   # root .. leaf
        results = model.forward_many([PendingPath(more + tuple(int(tokens[i]) for i in chain), base.past, len(more))
                                      for chain in chains])
        if more:   # the first path's K/V [len(more), kv_heads, d] of the gained tokens, per layer
            ks = tuple(torch.cat([a, k[:len(more)]]) for a, k in zip(base.ks, results[0].ks))
            vs = tuple(torch.cat([a, v[:len(more)]]) for a, v in zip(base.vs, results[0].vs))
            prefixes.put(CausalPrefix(base.tokens + more, ks, vs))
        rows: list[Tensor | None] = [None] * len(tokens)
        for chain, result in zip(chains, results):
            for position, node in enumerate(chain):
                if rows[node] is None:
                    rows[node] = result.logits[position]
        return torch.stack(rows).cpu()  # [n, V]
