"""A node's correct low-precision twin: what the same model, weights, dtype
and attention backend compute for the node without a tree.

For node i that is the last position of a plain causal extend over
prefix + root_path(i): no tree mask, no verify metadata, no padding rows, a
scratch KV pool of its own. Its distance from the float64 oracle is the
noise a correct low-precision computation of that node has; the noise-floor
verdict (harness/verdict/noise_floor.py) judges the engine's node against it.

As in the oracle, causality is used and nothing else: each request's
committed prefix is kept between steps (its K/V in a pool of its own), never
prefilled whole again (640-900 tokens of prompt). A step's twins are one
extend batch with one sequence per path end (a leaf's root path, or an asked
node on no other asked node's path), each reading the kept prefix's slots and
writing its own; only the rows judged get logits (LlamaModel.forward's
logit_rows: a node's second occurrence and every other row get none). The
tokens committed since the kept prefix (a step's accepted tokens, at most
MERGE_UP_TO of them) lead every sequence of that batch, at their own
positions, causal, ahead of its chain: one forward per call. The first
sequence writes their K/V to the kept prefix's continuation slots, which the
prefix then keeps; the other sequences' copies and every chain go to scratch
slots after them. A new prefix, or more tokens than that, is extended by a
forward of its own first (repeating it per sequence would cost more than the
second forward). A prefix extended in pieces, or a sequence carrying its last
tokens, is the same causal computation as one prefilled at once, up to the
low-precision kernel's rounding of another split. The twin
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
# at most this many tokens committed since the kept prefix are computed in front of every path sequence of the
# step's one forward; more get a forward of their own first (each sequence would repeat them)
MERGE_UP_TO = 16


@dataclass
class _Prefix:
    tokens: tuple[int, ...]   # the prefix whose K/V the pool holds at slots FIRST_SLOT ..
    pool: KVPool


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
        self.max_context = max_context
        self.threads = threads
        self.merge_up_to = merge_up_to
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
        prefix, p = tuple(prefix), len(prefix)
        chains = [list(tree.ancestors(end)) for end in _path_ends(tree, nodes)]   # root .. end, one sequence each
        lens = [len(c) for c in chains]
        kept = self._kept(prefix, p + sum(lens))
        c = len(kept.tokens)
        # the tokens committed since ride in front of every chain (one forward) when the kept prefix is there to
        # read and they are few; a new prefix, or many tokens, get a forward of their own (copies would cost more)
        more = p - c if 0 < c and p - c <= self.merge_up_to else 0
        self._room(kept, p + sum(lens) + (len(chains) - 1) * more, c)
        if p > c and not more:
            self._extend(kept, prefix)
        read = p - more                     # every sequence reads the kept prefix's slots [0, read)
        seq_lens = [more + n for n in lens]
        starts = torch.tensor([0] + seq_lens, device=self.device).cumsum(0)    # [leaves + 1]
        # slots from `read` on, in row order: the first sequence's `more` rows continue the kept prefix (its
        # K/V are kept); the other sequences' copies and every chain are scratch
        meta = AttnMetadata(
            qo_indptr=starts,
            kv_indptr=torch.arange(len(chains) + 1, device=self.device) * read,
            kv_indices=_slots(0, read, self.device).repeat(len(chains)),
            out_cache_loc=_slots(read, sum(seq_lens), self.device), custom_mask=None, mask_indptr=None,
            max_len_extend=max(seq_lens))
        ids = [t for chain in chains for t in list(prefix[read:]) + [tree.tokens[i] for i in chain]]
        positions = [q for n in lens for q in list(range(read, p)) + [p + depth for depth in range(n)]]
        first: dict[int, int] = {}   # node -> its first chain row in the batch (causality: the one of its own path)
        flat = 0
        for chain in chains:
            flat += more             # a `more` row is never a node's
            for node in chain:
                first.setdefault(node, flat)
                flat += 1
        rows = torch.tensor([first[i] for i in nodes], device=self.device)   # [len(nodes)]
        logits = self._forward(ids, positions, meta, kept.pool, rows)       # [len(nodes), vocab]
        kept.tokens = prefix
        return logits

    def _kept(self, prefix: tuple[int, ...], room: int) -> _Prefix:
        """The kept prefix that `prefix` extends (the longest), now the most recently used; when none is, a new
        empty one whose pool has room for `room` slots."""
        kept = max((c for c in self.prefixes if prefix[:len(c.tokens)] == c.tokens), key=lambda c: len(c.tokens),
                   default=None)
        if kept is None:
            kept = _Prefix((), self._pool(room))
            self.prefixes = self.prefixes[-(MAX_PREFIXES - 1):]
        else:
            self.prefixes.remove(kept)
        self.prefixes.append(kept)
        return kept

    def _room(self, kept: _Prefix, room: int, keep: int) -> None:
        """kept's pool with room for `room` slots, its first `keep` cached positions held."""
        if FIRST_SLOT + room > kept.pool.k_buffer[0].shape[0]:   # a wide tree's chains can outgrow the context
            kept.pool = self._grown(kept.pool, room, keep)

    def _extend(self, kept: _Prefix, prefix: tuple[int, ...]) -> None:
        """kept extended to `prefix` by a causal extend of the tokens committed since (K/V only: no logits)."""
        c, p = len(kept.tokens), len(prefix)
        meta = AttnMetadata(qo_indptr=torch.tensor([0, p - c], device=self.device),
                            kv_indptr=torch.tensor([0, c], device=self.device),
                            kv_indices=_slots(0, c, self.device), out_cache_loc=_slots(c, p - c, self.device),
                            custom_mask=None, mask_indptr=None, max_len_extend=p - c)
        self._forward(list(prefix[c:]), list(range(c, p)), meta, kept.pool,
                      torch.zeros(0, dtype=torch.int64, device=self.device))
        kept.tokens = prefix

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
