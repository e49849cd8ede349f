"""StreamedOracle: the whole-model oracle's answers, holding one layer at a time.

A 70B-class model in float64 (560 GB) fits no GPU and few hosts. This oracle
never holds it: every forward runs layer by layer over every sequence it
judges at once, reading layer l's weights from the checkpoint
(reference/lazy_checkpoint.py; the next layer on a background thread,
reference/layer_reader.py), running every pending sequence's rows through
it, and letting it go before layer l + 1. `prepare_step` puts every request
of a verify step, float64 and rounded, in one such pass. The embedding is
read by the rows its tokens use, the output projection a slice of the
vocabulary at a time, a routed expert when a token picks it. Memory: two
layers' float64 weights (one computed, one read), plus the activations and
K/V of the sequences in flight (a step's prefixes and leaf paths).

The arithmetic is the whole-model oracle's own: DenseLlama's decoder_layer,
embed and head (reference/model.py; DenseDeepseekV3's for MLA + MoE,
reference/streamed_mla.py) over the weights held now, float64 on the
oracle's device. What differs is the order of work, not the math: a
step's leaf paths go through each layer together (their rows share the
projections' matmuls), so a float64 result can differ from the one-forward-
per-leaf whole-model oracle's in the last bits of a sum (tests hold both
equal to 1e-12).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

import torch
from torch import Tensor

from ddschema.config import ModelConfig
from ddschema.oracle import Routing
from reference.deepseek_v3 import MlaForwardResult, moe_layers
from reference.layer_reader import LayerReader
from reference.lazy_checkpoint import LazyCheckpoint
from reference.model import DTYPE, DenseLlama, ForwardResult, rounding_to
from reference.oracle import DenseOracle, _routing, ancestry, leaves, validate_tree
from reference.prefix_cache import CausalPrefix, PrefixCache
from reference.streamed_mla import StreamedMlaPart, split_selection

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

    def rows(self, name: str, start: int, stop: int, out: Tensor | None = None) -> Tensor:
        return self.w[name][start:stop]

    def gather_rows(self, name: str, ids: Tensor) -> Tensor:
        return self.w[name][ids.to(self.device)]

    def read(self, name: str, out: Tensor | None = None) -> Tensor:
        return self.w[name]

    def layer(self, layer: int, buffers: dict | None = None, routed_experts: bool = True) -> dict[str, Tensor]:
        prefix = f"model.layers.{layer}."
        return {n: t for n, t in self.w.items()
                if n.startswith(prefix) and (routed_experts or ".mlp.experts." not in n)}


class Lane(NamedTuple):
    """One model's sequences in a pass: a StreamedLlama (float64 or rounded) and what it runs."""

    model: "StreamedLlama"
    sequences: Sequence[PendingPath]
    head: str = "judged"   # logits of: "judged" rows (from each judged_from), "last" row, "none"
    keep_hiddens: bool = False


def part_of(config: ModelConfig, device: str) -> DenseLlama:
    """The model's math holding no weights (DenseLlama.over_part): MLA + MoE layers, or the Llama family's."""
    return (StreamedMlaPart if config.mla is not None else DenseLlama).over_part(config, device)


class StreamedLlama:
    """The whole-model oracle's forward, one layer's weights held at a time, over many sequences at once."""

    def __init__(self, config: ModelConfig, source, device: str = "cpu", prefetch: bool = True) -> None:
        self.config, self.source = config, source
        self.part = part_of(config, device)
        self.reader = LayerReader(source, config.num_layers, self.part.device, prefetch)
        self.buffers: dict[str, Tensor] = {}   # the output projection's slice, refilled slice after slice

    def rounded(self, dtype: torch.dtype, probabilities: bool = False) -> "StreamedLlama":
        """The same model storing every tensor in `dtype` (DenseLlama.rounded's meaning), streamed too."""
        other = object.__new__(StreamedLlama)
        other.config, other.source, other.reader = self.config, self.source, self.reader
        other.buffers = self.buffers   # the two run in one pass or one after another: they share the reads
        other.part = part_of(self.config, str(self.part.device))
        other.part.store = rounding_to(dtype)
        other.part.probs_store = other.part.store if probabilities else None
        return other

    def forward(self, token_ids: list[int], positions: list[int] | None = None, visible: Tensor | None = None,
                last_logits_only: bool = False, past: tuple[list[Tensor], list[Tensor]] | None = None):
        """DenseLlama.forward's result for one sequence (DenseDeepseekV3's with its routes for MLA),
        except that `hiddens` hold each layer's LAST position only ([1, hidden]: what path_hidden reads)."""
        seg = self.part.segment(token_ids, positions, visible, past)
        lane = Lane(self, [PendingPath(tuple(token_ids), past)], "last" if last_logits_only else "judged", True)
        return run_lanes([lane], [[seg]])[0][0]

    def forward_many(self, sequences: Sequence[PendingPath], last_logits_only: bool = False) -> list:
        """One causal forward per sequence (each over its own past), all
        through each layer together; hiddens are not kept (empty lists), and
        each sequence's logits start at its `judged_from` row ([T - judged_from, V])."""
        return run_many([Lane(self, sequences, "last" if last_logits_only else "judged")])[0]

    __call__ = forward


def run_many(lanes: Sequence[Lane]) -> list[list]:
    """Every lane's sequences through each layer, each layer read once for all of them (run_lanes)."""
    return run_lanes(lanes, [[lane.model.part.segment(list(q.tokens), past=q.past) for q in lane.sequences]
                             for lane in lanes])


def run_lanes(lanes: Sequence[Lane], segs: list[list]) -> list[list]:
    """Per lane, one result per sequence (ForwardResult; MlaForwardResult with each sequence's routes
    over ALL its rows for MLA): the embedding rows of every lane's tokens read once, each layer read
    once (reference/layer_reader.py) and run by every lane, the output projection read a slice at a time."""
    first = lanes[0].model
    ids = torch.cat([s.ids for lane_segs in segs for s in lane_segs])  # [all rows]
    table = first.source.gather_rows("model.embed_tokens.weight", ids)  # [all rows, hidden]
    sizes = [sum(s.length for s in lane_segs) for lane_segs in segs]
    hs = [lane.model.part.embed(rows) for lane, rows in zip(lanes, table.split(sizes))]  # each [N, hidden]
    spans = [_spans(lane_segs) for lane_segs in segs]
    hiddens = [[[h[b - 1:b]] if lane.keep_hiddens else [] for _, b in sp] for lane, h, sp in zip(lanes, hs, spans)]
    ks = [[[] for _ in lane_segs] for lane_segs in segs]
    vs = [[[] for _ in lane_segs] for lane_segs in segs]
    routes = [[[] for _ in lane_segs] for lane_segs in segs]
    for layer, weights in first.reader.layers():
        for i, lane in enumerate(lanes):
            part = lane.model.part
            part.hold(weights)   # one read of the layer serves every lane
            layer_pasts = [None if q.past is None else (q.past[0][layer], q.past[1][layer]) for q in lane.sequences]
            if isinstance(part, StreamedMlaPart):
                hs[i], k, v, selection = part.routed_layer(layer, hs[i], segs[i], layer_pasts)
            else:
                (hs[i], k, v), selection = part.decoder_layer(layer, hs[i], segs[i], layer_pasts), None
            part.hold({})   # let go before the next layer is asked for
            for j, (a, b) in enumerate(spans[i]):
                ks[i][j].append(k[j])
                vs[i][j].append(v[j])
                if lane.keep_hiddens:
                    hiddens[i][j].append(hs[i][b - 1:b])
            if selection is not None:
                for j, cut in enumerate(split_selection(selection, spans[i])):
                    routes[i][j].append(cut)
    logits = _head(lanes, hs, spans)
    mla = first.config.mla is not None
    return [[MlaForwardResult(lg, hd, k, v, tuple(r)) if mla else ForwardResult(lg, hd, k, v)
             for lg, hd, k, v, r in zip(*per_lane)] for per_lane in zip(logits, hiddens, ks, vs, routes)]


def _spans(segs: list) -> list[tuple[int, int]]:
    """Each segment's [start, stop) rows in the pass's residual stream."""
    ends = torch.tensor([s.length for s in segs]).cumsum(0).tolist()
    return [(e - s.length, e) for s, e in zip(segs, ends)]


def _head(lanes: Sequence[Lane], hs: list[Tensor], spans: list[list[tuple[int, int]]]) -> list[list[Tensor]]:
    """Per lane, per sequence, the logits its `head` asks for ([rows, V]; [0, V] for "none"),
    the final norm and each slice of the output projection read once for every lane."""
    first = lanes[0].model
    src, vocab, buffers = first.source, first.config.vocab_size, first.buffers
    picks = []   # per lane: the rows [judged rows, hidden] whose logits it wants, and how many per sequence
    for lane, h, sp in zip(lanes, hs, spans):
        if lane.head == "none":
            spans_kept = [(b, b) for _, b in sp]
        elif lane.head == "last":
            spans_kept = [(b - 1, b) for _, b in sp]
        else:
            spans_kept = [(a + q.judged_from, b) for (a, b), q in zip(sp, lane.sequences)]
        picks.append((torch.cat([h[a:b] for a, b in spans_kept]), [b - a for a, b in spans_kept]))
    if all(sum(counts) == 0 for _, counts in picks):
        return [[h.new_zeros(0, vocab) for _ in counts] for h, counts in picks]
    norm = {"model.norm.weight": src.read("model.norm.weight")}
    normed = []
    for lane, (rows, _) in zip(lanes, picks):
        lane.model.part.hold(norm)
        normed.append(lane.model.part.final_norm(rows))  # [judged rows, hidden]
        lane.model.part.hold({})
    out: list[list[Tensor]] = [[] for _ in lanes]
    for start in range(0, vocab, VOCAB_ROWS):
        rows = src.rows("lm_head.weight", start, min(vocab, start + VOCAB_ROWS), buffers.get("lm_head"))
        buffers["lm_head"] = rows
        for i, lane in enumerate(lanes):
            lane.model.part.hold({"lm_head.weight": rows})
            out[i].append(lane.model.part.unembed(normed[i]))   # [judged rows, slice]
            lane.model.part.hold({})
    return [torch.cat(o, dim=1).split(counts) for o, (_, counts) in zip(out, picks)]   # each [rows, V]


class Judged(NamedTuple):
    """One tree's answers from a pass: logits [n, V] float64 on CPU, its routing (None without MoE)."""

    logits: Tensor
    routing: Routing | None


class StreamedOracle(DenseOracle):
    """ddschema.Oracle answered as DenseOracle answers it, with a StreamedLlama:
    one decoder layer's float64 weights held at a time (two with prefetch: the
    next one is read while this one computes; see the module doc). All outputs
    are float64 on CPU. `prepare_step` judges every request of a step in one
    pass over the weights."""

    def __init__(self, config: ModelConfig, weights, device: str = "cpu", owned: bool = False,
                 allow_missing: bool = False, prefetch: bool = True) -> None:
        """weights: a LazyCheckpoint (its tensors read when used), or a dict of tensors held in memory.
        allow_missing is accepted for the dense oracle's signature: the lazy reading refuses a missing tensor.
        prefetch: read the next layer on a background thread (reference/layer_reader.py)."""
        self.config = config
        source = weights if isinstance(weights, LazyCheckpoint) else InMemorySource(config, weights, device)
        self.source = source
        self.model = StreamedLlama(config, source, device, prefetch)
        self.prefixes = PrefixCache()
        self.low_precision = {}
        self.prepared: dict[tuple, Judged] = {}   # the last prepare_step's answers, by (model, tree)

    @classmethod
    def from_checkpoint(cls, directory, device: str = "cpu", **options) -> "StreamedOracle":
        """The oracle over its own lazy reading of a checkpoint directory (only
        the headers now); raises CheckpointRefused (a ValueError)."""
        source = LazyCheckpoint(directory, device)
        return cls(source.config, source, device, **options)

    def weight(self, name: str) -> Tensor:
        """The float64 tensor under `name`, read now (lm_head.weight is the embedding when tied)."""
        return self.source.read(name)

    def prepare_step(self, trees: Sequence[tuple[Sequence[int], Sequence[int], Sequence[int]]],
                     rounded: Sequence[tuple[str, bool]] = ()) -> None:
        """Judge a step's trees, each (prefix, tokens, parents), in ONE pass over the weights (two
        where a prefix is new: its prompt first): tree_logits and routing of each, and with
        each (dtype, probabilities) of `rounded` rounded_tree_logits and rounded_routing's of that model
        too, all through each layer together. The answers stand until the next prepare_step."""
        lanes = [(self.model, self.prefixes)] + [self._rounded(*r) for r in rounded]
        self.prepared = {}
        self.prepared = self._answer_lanes(lanes, [(tuple(int(t) for t in p), tuple(int(t) for t in k),
                                                    tuple(int(x) for x in q)) for p, k, q in trees])

    def _judge(self, model: StreamedLlama, prefixes: PrefixCache, prefix: Sequence[int], tokens: Sequence[int],
               parents: Sequence[int]) -> Tensor:
        """tree_logits over `model`: [n, V] float64 on CPU (node i's row at its position in the first
        leaf's path below it), from prepare_step's pass when it judged this tree, else a pass now."""
        return self._answered(model, prefixes, prefix, tokens, parents).logits

    def routing(self, prefix: Sequence[int], tokens: Sequence[int], parents: Sequence[int]) -> Routing | None:
        """DenseOracle.routing's answer, from the same pass as tree_logits (None without routed experts)."""
        return self._answered(self.model, self.prefixes, prefix, tokens, parents).routing

    def rounded_routing(self, prefix: Sequence[int], tokens: Sequence[int], parents: Sequence[int],
                        dtype: str) -> Routing | None:
        """DenseOracle.rounded_routing's answer (the model storing every tensor in `dtype`)."""
        return self._answered(*self._rounded(dtype), prefix, tokens, parents).routing

    def _answered(self, model, prefixes, prefix, tokens, parents) -> Judged:
        key = (id(model), tuple(int(t) for t in prefix), tuple(int(t) for t in tokens), tuple(int(x) for x in parents))
        if key in self.prepared:
            return self.prepared[key]
        return self._answer_lanes([(model, prefixes)], [key[1:]])[key]   # not kept: asked once

    def _answer_lanes(self, lanes: list[tuple[StreamedLlama, PrefixCache]], trees: list[tuple]) -> dict[tuple, Judged]:
        """Every tree's answers for every lane, by (id(model), prefix, tokens, parents): each leaf's root
        path over the prefix's K/V, the tokens the prefix gained since the cached one (the last step's commits, at most
        FOLD_MAX) in front of every leaf path, judged by none; the first path's K/V of them extend the cache."""
        for prefix, tokens, parents in trees:
            validate_tree(tokens, parents)
            if len(prefix) == 0:
                raise ValueError("tree_logits needs a non-empty prefix")
        self._extend_far_prefixes(lanes, [t[0] for t in trees])
        plans, runs, answers = [], [], {}
        for model, prefixes in lanes:
            bases = [prefixes.longest(prefix) for prefix, _, _ in trees]
            chains = [[ancestry(parents, leaf) for leaf in leaves(parents)] for _, _, parents in trees]   # root .. leaf
            paths = []
            for (prefix, tokens, _), base, tree_chains in zip(trees, bases, chains):
                more = prefix[len(base.tokens):]
                paths += [PendingPath(more + tuple(tokens[i] for i in chain), base.past, len(more))
                          for chain in tree_chains]
            plans.append((model, prefixes, bases, chains))
            runs.append(Lane(model, paths))
        for (model, prefixes, bases, chains), results in zip(plans, run_many(runs)):
            for (prefix, tokens, parents), base, tree_chains in zip(trees, bases, chains):
                mine, results = results[:len(tree_chains)], results[len(tree_chains):]
                answers[(id(model), prefix, tokens, parents)] = self._gather(tree_chains, mine, len(prefix) -
                                                                                    len(base.tokens), len(tokens))
                gained = len(prefix) - len(base.tokens)
                if gained:   # the first path's K/V [gained, ...] of the gained tokens, per layer
                    ks = tuple(torch.cat([a, k[:gained]]) for a, k in zip(base.ks, mine[0].ks))
                    vs = tuple(torch.cat([a, v[:gained]]) for a, v in zip(base.vs, mine[0].vs))
                    prefixes.put(CausalPrefix(prefix, ks, vs))
        return answers

    def _extend_far_prefixes(self, lanes, prefixes_asked: list[tuple[int, ...]]) -> None:
        """Prefixes with nothing cached, or more than FOLD_MAX tokens past the longest cached one: their
        K/V computed first, every lane's in one pass (no logits), and cached."""
        runs, todo = [], []
        for model, prefixes in lanes:
            far = {}
            for prefix in prefixes_asked:
                base = prefixes.longest(prefix)
                if not base.tokens or len(prefix) - len(base.tokens) > FOLD_MAX:
                    far[prefix] = base
            todo.append((prefixes, list(far.items())))
            runs.append(Lane(model, [PendingPath(p[len(b.tokens):], b.past) for p, b in far.items()], "none"))
        busy = [i for i, lane in enumerate(runs) if lane.sequences]
        if not busy:
            return
        for i, results in zip(busy, run_many([runs[i] for i in busy])):
            prefixes, far = todo[i]
            for (prefix, base), result in zip(far, results):
                if not base.tokens:
                    prefixes.put(CausalPrefix(prefix, tuple(result.ks), tuple(result.vs)))
                else:
                    prefixes.put(CausalPrefix(prefix, tuple(torch.cat([a, k]) for a, k in zip(base.ks, result.ks)),
                                              tuple(torch.cat([a, v]) for a, v in zip(base.vs, result.vs))))

    def _gather(self, chains: list[list[int]], results: list, gained: int, n: int) -> Judged:
        """A tree's rows from its leaf paths' results: node i at its position in the first leaf's path below it."""
        rows: list[Tensor | None] = [None] * n
        routes: list[Routing | None] = [None] * n
        moe = bool(moe_layers(self.config))
        for chain, result in zip(chains, results):
            path = _routing(result.routes, self.config) if moe else None   # over ALL the path's rows
            for position, node in enumerate(chain):
                if rows[node] is None:
                    rows[node] = result.logits[position]
                    if moe:
                        at = gained + position
                        routes[node] = Routing(path.experts[at:at + 1], path.margin[at:at + 1], path.layers)
        routing = (Routing(torch.cat([r.experts for r in routes]), torch.cat([r.margin for r in routes]),
                           routes[0].layers) if moe else None)
        return Judged(torch.stack(rows).cpu(), routing)  # [n, V]
