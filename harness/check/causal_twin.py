"""A node's correct low-precision twin: what the same model, weights, dtype
and attention backend compute for the node without a tree.

For node i that is the last position of a plain causal extend over
prefix + root_path(i): no tree mask, no verify metadata, no padding rows, a
scratch KV pool of its own. Its distance from the float64 oracle is the
noise a correct low-precision computation of that node has; the noise-floor
verdict (harness/verdict/noise_floor.py) judges the engine's node against it.

As in the oracle, causality is used and nothing else: each request's
committed prefix is kept between steps (its K/V in the twin's pool,
check/twin_slots.py), never prefilled whole again (640-900 tokens of
prompt). A step's twins, every request's at once (step_logits), are one
extend batch with one sequence per path end (a leaf's root path, or an asked
node on no other asked node's path), each reading its request's kept prefix
and writing slots of its own; only the rows judged get logits
(LlamaModel.forward's logit_rows: a node's second occurrence and every
other row get none). The tokens committed since the kept prefix (a step's
accepted tokens, at most MERGE_UP_TO of them) lead every sequence of their
request, at their own positions, causal, ahead of its chain: one forward per
step. The request's first sequence writes their K/V to slots the prefix then
keeps; the other sequences' copies and every chain go to scratch slots,
free again after the forward. A new prefix, or more tokens than that, is
extended first, by one forward for every request that needs it (repeating
them per sequence would cost more than the second forward). A prefix
extended in pieces, or a sequence carrying its last tokens, is the same
causal computation as one prefilled at once, up to the low-precision
kernel's rounding of another split. The twin is the engine's own model code
on the causal path: a bug shared by that path (a RoPE or loader error)
moves both and is left to the ceiling and to the fixed float32 runs.


Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from harness.check.step_clock import oracle_threads
from harness.check.twin_slots import FIRST_SLOT, TwinSlots
from harness.engine.attn.base import AttentionBackend
from harness.engine.ddtree.tree import DraftTree
from harness.engine.ddtree.verify_inputs import AttnMetadata
from harness.engine.model.llama import LlamaModel

__all__ = ["CausalTwin", "FIRST_SLOT", "MAX_PREFIXES", "MERGE_UP_TO"]

MAX_PREFIXES = 16   # committed prefixes kept (one per request of a batch; the least recently used goes first)
# at most this many tokens committed since the kept prefix are computed in front of every path sequence of the
# step's one forward; more get a forward of their own first (each sequence would repeat them)
MERGE_UP_TO = 16

Ask = tuple[Sequence[int], DraftTree, "list[int] | None"]   # (prefix, tree, nodes: None for every node)


@dataclass
class _Prefix:
    tokens: tuple[int, ...]   # a committed prefix
    slots: torch.Tensor       # [len(tokens)] int64: the pool slots of its K/V, in position order


@dataclass
class _Part:
    """One request's share of a step's forward."""

    prefix: tuple[int, ...]
    tree: DraftTree
    nodes: list[int]
    kept: _Prefix | None      # this step's alone (a prefix two requests share is copied for the second)
    chains: list[list[int]]   # root .. end, one sequence per path end


class CausalTwin:
    def __init__(self, model: LlamaModel, backend: AttentionBackend, device: str, max_context: int,
                 threads: int | None = None, merge_up_to: int = MERGE_UP_TO) -> None:
        """merge_up_to: the most tokens committed since the kept prefix that ride in front of every path
        sequence (MERGE_UP_TO; 0: always a forward of their own). threads: torch's intra-op threads while the
        twin computes (None: whatever the caller has set). The twin is the engine's computation and runs on
        the engine's threads (prepare.py twin_for), not on the float64 oracle's around it: its per-sequence
        attention is many small ops, and on shared cores each parallel region of one waits for a descheduled
        thread (check/step_clock.py idle_cores)."""
        self.model, self.backend, self.device = model, backend, device
        self.merge_up_to = merge_up_to
        self.threads = threads
        self.slots = TwinSlots(model.cfg, model.dtype, device, max_context)
        self.prefixes: list[_Prefix] = []   # least recently used first

    def tree_logits(self, prefix: Sequence[int], tree: DraftTree, nodes: list[int] | None = None) -> torch.Tensor:
        """Twin logits [len(nodes), vocab] float32 on the twin's device, row j for tree node nodes[j] (default:
        every node, row i for node i). Only the paths to those nodes are computed."""
        return self.step_logits([(prefix, tree, nodes)])[0]

    def step_logits(self, asks: Sequence[Ask]) -> list[torch.Tensor]:
        """tree_logits of every (prefix, tree, nodes) of one step, in one forward (and one more first for the
        prefixes new or far behind)."""
        if self.threads is None:
            return self._step_logits(asks)
        with oracle_threads(self.threads):
            return self._step_logits(asks)

    def _step_logits(self, asks: Sequence[Ask]) -> list[torch.Tensor]:
        parts = self._parts(asks)
        self._extend([pt for pt in parts if pt.chains and not self._merges(pt)])
        logits = self._paths([pt for pt in parts if pt.chains])
        out = [logits.pop(0) if pt.chains else torch.zeros(0, self.model.cfg.vocab_size, device=self.device)
               for pt in parts]
        self._evict()
        return out

    def _parts(self, asks: Sequence[Ask]) -> list[_Part]:
        parts, taken = [], set()
        for prefix, tree, nodes in asks:
            nodes = list(range(tree.num_rows)) if nodes is None else list(nodes)
            prefix = tuple(int(t) for t in prefix)
            chains = [list(tree.ancestors(end)) for end in _path_ends(tree, nodes)]   # root .. end
            kept = self._kept(prefix, taken) if chains else None   # nothing asked: nothing computed or kept
            if kept is not None:
                taken.add(id(kept))
            parts.append(_Part(prefix, tree, nodes, kept, chains))
        return parts

    def _kept(self, prefix: tuple[int, ...], taken: set[int]) -> _Prefix:
        """The kept prefix that `prefix` extends (the longest, one no other request of this step took first; a
        copy when another did; an empty new one when none extends it), now the most recently used."""
        kept = max((c for c in self.prefixes if prefix[:len(c.tokens)] == c.tokens),
                   key=lambda c: (len(c.tokens), id(c) not in taken), default=None)
        if kept is None or id(kept) in taken:
            slots = torch.zeros(0, dtype=torch.int64, device=self.device)
            kept = _Prefix(kept.tokens, self.slots.copy(kept.slots)) if kept is not None else _Prefix((), slots)
        else:
            self.prefixes.remove(kept)
        self.prefixes.append(kept)
        return kept

    def _merges(self, pt: _Part) -> bool:
        """Whether the tokens committed since pt's kept prefix ride in front of its sequences."""
        since = len(pt.prefix) - len(pt.kept.tokens)
        return since == 0 or (len(pt.kept.tokens) > 0 and since <= self.merge_up_to)

    def _extend(self, parts: list[_Part]) -> None:
        """Each part's kept prefix extended to its prefix by one causal extend of all their new tokens (K/V
        only: no logits)."""
        if not parts:
            return
        news = [self.slots.alloc(len(pt.prefix) - len(pt.kept.tokens)) for pt in parts]
        self._forward([(pt.kept.slots, list(pt.prefix[len(pt.kept.tokens):]), [new]) for pt, new in zip(parts, news)],
                      [list(range(len(pt.kept.tokens), len(pt.prefix))) for pt in parts],
                      torch.zeros(0, dtype=torch.int64, device=self.device))
        for pt, new in zip(parts, news):
            pt.kept.slots, pt.kept.tokens = torch.cat([pt.kept.slots, new]), pt.prefix

    def _paths(self, parts: list[_Part]) -> list[torch.Tensor]:
        """Every part's chains in one forward, each led by the tokens committed since its kept prefix: the
        asked nodes' logits, per part; each kept prefix then holds its part's prefix."""
        if not parts:
            return []
        seqs, positions, rows, leads, scratch = [], [], [], [], []
        flat = 0   # rows of the batch so far
        for pt in parts:
            c, p = len(pt.kept.tokens), len(pt.prefix)
            first: dict[int, int] = {}   # node -> its first chain row in the batch (causality: its own path's)
            for j, chain in enumerate(pt.chains):
                lead, rest = self.slots.alloc(p - c), self.slots.alloc(len(chain))
                (leads if j == 0 else scratch).append(lead)   # the first sequence's lead is kept, the others' not
                scratch.append(rest)
                seqs.append((pt.kept.slots, list(pt.prefix[c:]) + [pt.tree.tokens[i] for i in chain], [lead, rest]))
                positions.append(list(range(c, p)) + [p + depth for depth in range(len(chain))])
                flat += p - c
                for node in chain:
                    first.setdefault(node, flat)
                    flat += 1
            rows.append([first[i] for i in pt.nodes])
        logits = self._forward(seqs, positions, torch.tensor([r for rs in rows for r in rs], device=self.device))
        for slots in scratch:
            self.slots.release(slots)
        for pt, lead in zip(parts, leads):
            pt.kept.slots, pt.kept.tokens = torch.cat([pt.kept.slots, lead]), pt.prefix
        return list(logits.split([len(r) for r in rows]))

    def _forward(self, seqs: list[tuple[torch.Tensor, list[int], list[torch.Tensor]]], positions: list[list[int]],
                 rows: torch.Tensor) -> torch.Tensor:
        """One extend over sequences (slots read [k] in position order, token ids, the slots their rows write
        in row order) at `positions`: logits [len(rows), vocab] float32 of the batch's rows `rows`."""
        reads = [read for read, _, _ in seqs]
        lens = [len(ids) for _, ids, _ in seqs]
        dev = self.device
        meta = AttnMetadata(
            qo_indptr=torch.tensor([0] + lens, device=dev).cumsum(0),
            kv_indptr=torch.tensor([0] + [r.numel() for r in reads], device=dev).cumsum(0),
            kv_indices=torch.cat(reads), out_cache_loc=torch.cat([s for _, _, ss in seqs for s in ss]),
            custom_mask=None, mask_indptr=None, max_len_extend=max(lens))
        tokens = torch.tensor([t for _, ids, _ in seqs for t in ids], device=dev)
        pos = torch.tensor([q for ps in positions for q in ps], device=dev)
        return self.model.forward(tokens, pos, meta, self.slots.pool, self.backend, logit_rows=rows).float()

    def _evict(self) -> None:
        """The least recently used prefixes beyond MAX_PREFIXES dropped, their slots free."""
        while len(self.prefixes) > MAX_PREFIXES:
            self.slots.release(self.prefixes.pop(0).slots)


def _path_ends(tree: DraftTree, nodes: list[int]) -> list[int]:
    """The nodes on no other one's root path (every node: the tree's leaves), in order: one sequence each covers
    every node asked for."""
    if any(not 0 <= i < tree.num_rows for i in nodes):
        raise ValueError(f"twin rows must be tree nodes in [0, {tree.num_rows}), got {nodes}")
    above = {a for i in nodes for a in tree.ancestors(i) if a != i}
    return sorted(i for i in set(nodes) if i not in above)
