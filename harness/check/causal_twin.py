"""A node's correct low-precision twin: what the same model, weights, dtype
and attention backend compute for the node without a tree.

For node i that is the last position of a plain causal extend over
prefix + root_path(i): no tree mask, no verify metadata, no padding rows, a
scratch KV pool of its own. Its distance from the float64 oracle is the
noise a correct low-precision computation of that node has; the noise-floor
verdict (harness/verdict/noise_floor.py) judges the engine's node against it.

As in the oracle, causality is used and nothing else: each request's
committed prefix is kept between steps (its K/V in a pool of its own; a step
extends it by the tokens committed since, instead of a prefill of the whole
640-900-token prompt every step), then one extend batch with one sequence per
leaf's root path (each reading the prefix's slots, writing its own) gives
every node on it, and only the rows judged get logits (LlamaModel.forward's
logit_rows: the prefix's rows and a node's second occurrence get none). A
prefix extended in pieces is the same causal computation as one prefilled at
once, up to the low-precision kernel's rounding of another split. The twin
is the engine's own model code on the causal path: a bug shared by
that path (a RoPE or loader error) moves both and is left to the ceiling and
to the fixed float32 runs.


Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.check.step_clock import oracle_threads
from harness.engine.attn.base import AttentionBackend
from harness.engine.ddtree.tree import DraftTree
from harness.engine.ddtree.verify_inputs import AttnMetadata
from harness.engine.mem.pool import KVPool
from harness.engine.model.llama import LlamaModel

FIRST_SLOT = 1  # slot 0 stays the pool's padding slot, as in the engine's pool


MAX_PREFIXES = 16   # committed prefixes kept (one per request of a batch; the least recently used goes first)


@dataclass
class _Prefix:
    tokens: tuple[int, ...]   # the prefix whose K/V the pool holds at slots FIRST_SLOT ..
    pool: KVPool


class CausalTwin:
    def __init__(self, model: LlamaModel, backend: AttentionBackend, device: str, max_context: int,
                 threads: int | None = None) -> None:
        """threads: torch's intra-op threads while the twin computes (None: whatever the caller has set). The
        twin is the engine's computation and runs on the engine's threads (prepare.py twin_for), not on the
        float64 oracle's around it: its per-sequence attention is many small ops, and on shared cores each
        parallel region of one waits for a descheduled thread (check/step_clock.py idle_cores)."""
        self.model, self.backend, self.device = model, backend, device
        self.max_context = max_context
        self.threads = threads
        self.prefixes: list[_Prefix] = []   # least recently used first

    def tree_logits(self, prefix: tuple[int, ...], tree: DraftTree, nodes: list[int] | None = None) -> torch.Tensor:
        """Twin logits [len(nodes), vocab] float32 on the twin's device, row j for tree node nodes[j] (default:
        every node, row i for node i). Only the paths to those nodes are computed."""
        nodes = list(range(tree.num_rows)) if nodes is None else list(nodes)
        if self.threads is None:
            return self._tree_logits(prefix, tree, nodes)
        with oracle_threads(self.threads):
            return self._tree_logits(prefix, tree, nodes)

    def _tree_logits(self, prefix: tuple[int, ...], tree: DraftTree, nodes: list[int]) -> torch.Tensor:
        if not nodes:
            return torch.zeros(0, self.model.cfg.vocab_size, device=self.device)
        p = len(prefix)
        chains = [list(tree.ancestors(end)) for end in _path_ends(tree, nodes)]   # root .. end, one sequence each
        lens = [len(c) for c in chains]
        total = sum(lens)
        cached = self._extend(tuple(prefix), p + total)
        starts = torch.tensor([0] + lens, device=self.device).cumsum(0)      # [leaves + 1]
        meta = AttnMetadata(
            qo_indptr=starts,
            kv_indptr=torch.arange(len(chains) + 1, device=self.device) * p,   # every sequence reads the prefix
            kv_indices=_slots(0, p, self.device).repeat(len(chains)),
            out_cache_loc=_slots(p, total, self.device), custom_mask=None, mask_indptr=None, max_len_extend=max(lens))
        ids = [tree.tokens[i] for c in chains for i in c]
        positions = [p + depth for n in lens for depth in range(n)]         # each sequence from the prefix's end
        first: dict[int, int] = {}   # node -> its first position in the batch (causality: the one of its own path)
        flat = 0
        for chain in chains:
            for node in chain:
                first.setdefault(node, flat)
                flat += 1
        rows = torch.tensor([first[i] for i in nodes], device=self.device)   # [len(nodes)]
        return self._forward(ids, positions, meta, cached.pool, rows)       # [len(nodes), vocab]

    def _extend(self, prefix: tuple[int, ...], room: int) -> _Prefix:
        """The kept prefix that `prefix` extends (the longest), extended to it by a causal extend of the tokens
        committed since; a new one prefilled when none is. Its pool has room for `room` slots."""
        kept = max((c for c in self.prefixes if prefix[:len(c.tokens)] == c.tokens), key=lambda c: len(c.tokens),
                   default=None)
        if kept is None:
            kept = _Prefix((), self._pool(room))
            self.prefixes = self.prefixes[-(MAX_PREFIXES - 1):]
        else:
            self.prefixes.remove(kept)
        self.prefixes.append(kept)
        c, p = len(kept.tokens), len(prefix)
        if FIRST_SLOT + room > kept.pool.k_buffer[0].shape[0]:   # a wide tree's chains can outgrow the context
            kept.pool = self._grown(kept.pool, room, c)
        if p > c:
            meta = AttnMetadata(qo_indptr=torch.tensor([0, p - c], device=self.device),
                                kv_indptr=torch.tensor([0, c], device=self.device),
                                kv_indices=_slots(0, c, self.device), out_cache_loc=_slots(c, p - c, self.device),
                                custom_mask=None, mask_indptr=None, max_len_extend=p - c)
            self._forward(list(prefix[c:]), list(range(c, p)), meta, kept.pool,
                          torch.zeros(0, dtype=torch.int64, device=self.device))   # K/V only: no logits
        kept.tokens = prefix
        return kept

    def _pool(self, room: int) -> KVPool:
        return KVPool(self.model.cfg, FIRST_SLOT + max(room, self.max_context) + 1, self.model.dtype, self.device)

    def _grown(self, pool: KVPool, room: int, keep: int) -> KVPool:
        """A larger pool holding the first `keep` cached positions of `pool`."""
        new = self._pool(room)
        for old_k, old_v, k, v in zip(pool.k_buffer, pool.v_buffer, new.k_buffer, new.v_buffer):
            k[:FIRST_SLOT + keep] = old_k[:FIRST_SLOT + keep]
            if v.data_ptr() != k.data_ptr():   # MLA: V is a view of K's latent
                v[:FIRST_SLOT + keep] = old_v[:FIRST_SLOT + keep]
        return new

    def _forward(self, ids: list[int], positions: list[int], meta: AttnMetadata, pool: KVPool,
                 rows: torch.Tensor) -> torch.Tensor:
        tokens = torch.tensor(ids, device=self.device)
        pos = torch.tensor(positions, device=self.device)
        return self.model.forward(tokens, pos, meta, pool, self.backend, logit_rows=rows).float()


def _slots(start: int, n: int, device: str) -> torch.Tensor:
    return torch.arange(FIRST_SLOT + start, FIRST_SLOT + start + n, device=device)


def _path_ends(tree: DraftTree, nodes: list[int]) -> list[int]:
    """The nodes on no other one's root path (every node: the tree's leaves), in order: one sequence each covers
    every node asked for."""
    if any(not 0 <= i < tree.num_rows for i in nodes):
        raise ValueError(f"twin rows must be tree nodes in [0, {tree.num_rows}), got {nodes}")
    above = {a for i in nodes for a in tree.ancestors(i) if a != i}
    return sorted(i for i in set(nodes) if i not in above)
