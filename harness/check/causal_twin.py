"""A node's correct low-precision twin: what the same model, weights, dtype
and attention backend compute for the node without a tree.

For node i that is the last position of a plain causal extend over
prefix + root_path(i): no tree mask, no verify metadata, no padding rows, a
scratch KV pool of its own. Its distance from the float64 oracle is the
noise a correct low-precision computation of that node has; the noise-floor
verdict (harness/verdict/noise_floor.py) judges the engine's node against it.

As in the oracle, causality is used and nothing else: the prefix is extended
once per step, then one extend batch with one sequence per leaf's root path
(each reading the prefix's slots, writing its own) gives every node on it.
The twin is the engine's own model code on the causal path: a bug shared by
that path (a RoPE or loader error) moves both and is left to the ceiling and
to the fixed float32 runs.


Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

import torch

from harness.engine.attn.base import AttentionBackend
from harness.engine.ddtree.tree import DraftTree
from harness.engine.ddtree.verify_inputs import AttnMetadata, prefill_metadata
from harness.engine.mem.pool import KVPool
from harness.engine.model.llama import LlamaModel

FIRST_SLOT = 1  # slot 0 stays the pool's padding slot, as in the engine's pool


class CausalTwin:
    def __init__(self, model: LlamaModel, backend: AttentionBackend, device: str, max_context: int) -> None:
        self.model, self.backend, self.device = model, backend, device
        self.pool = KVPool(model.cfg, FIRST_SLOT + max_context + 1, model.dtype, device)

    def tree_logits(self, prefix: tuple[int, ...], tree: DraftTree) -> torch.Tensor:
        """Twin logits [num_rows, vocab] float32 on CPU, row i for tree node i."""
        p = len(prefix)
        chains = [list(tree.ancestors(leaf)) for leaf in _leaves(tree)]   # root .. leaf, one sequence each
        lens = [len(c) for c in chains]
        total = sum(lens)
        self._reserve(p + total)
        self._forward(list(prefix), list(range(p)), prefill_metadata([p], self._slots(0, p)).to(self.device))  # causal
        starts = torch.tensor([0] + lens, device=self.device).cumsum(0)      # [leaves + 1]
        meta = AttnMetadata(
            qo_indptr=starts,
            kv_indptr=torch.arange(len(chains) + 1, device=self.device) * p,   # every sequence reads the prefix
            kv_indices=self._slots(0, p).repeat(len(chains)),
            out_cache_loc=self._slots(p, total), custom_mask=None, mask_indptr=None, max_len_extend=max(lens))
        ids = [tree.tokens[i] for c in chains for i in c]
        positions = [p + depth for n in lens for depth in range(n)]         # each sequence from the prefix's end
        logits = self._forward(ids, positions, meta)                          # [total, vocab]
        rows: list[torch.Tensor | None] = [None] * tree.num_rows
        flat = 0
        for chain in chains:
            for node in chain:
                if rows[node] is None:
                    rows[node] = logits[flat]
                flat += 1
        return torch.stack(rows)

    def _reserve(self, n: int) -> None:
        """Room for n slots after the padding slot (a wide tree's chains can outgrow the context)."""
        if FIRST_SLOT + n > self.pool.k_buffer[0].shape[0]:
            self.pool = KVPool(self.model.cfg, FIRST_SLOT + n, self.model.dtype, self.device)

    def _slots(self, start: int, n: int) -> torch.Tensor:
        return torch.arange(FIRST_SLOT + start, FIRST_SLOT + start + n, device=self.device)

    def _forward(self, ids: list[int], positions: list[int], meta: AttnMetadata) -> torch.Tensor:
        tokens = torch.tensor(ids, device=self.device)
        pos = torch.tensor(positions, device=self.device)
        return self.model.forward(tokens, pos, meta, self.pool, self.backend).float().cpu()


def _leaves(tree: DraftTree) -> list[int]:
    parents = {int(x) for x in tree.parents[1:tree.num_rows]}
    return [i for i in range(tree.num_rows) if i not in parents]
