"""`dflash-tree-utils`: the DFlash tree of vincentzed/sglang
(`dflash_tree_utils.py`, beside its dflash_worker_v2.py).

Functions driven (public signatures):
- build_tree_from_topk_cpu(root_token, topk_tokens [L, W], topk_logprobs [L, W],
  budget, *, depth_first=False, ...) -> DraftTreeCPU(token_ids, parent_indices,
  depths, num_nodes); the budget counts the root; breadth-first by default (a
  popped node gets all its W children at once);
- pad_tree_to_budget(tree, *, num_verify_tokens, pad_token=0) -> the tree padded
  with nodes of token pad_token, parent 0 (the root) and depth 1;
- build_tree_custom_mask(*, parent_indices_batch, num_real_nodes, prefix_lens,
  num_verify_tokens, device) -> flat allow-mask, per request [N, prefix + N];
- tree_accept_greedy(tree_tokens, parent_indices, target_tokens, *, num_nodes)
  -> (accepted path root first, accepted drafts, bonus token).

Verify positions are prefix + depth of the padded tree, as the worker lays
them out (padding rows at prefix + 1).


Layer: ports. Imports the engine and below; never faults, check, report, workflows or cli."""
from __future__ import annotations

from pathlib import Path

import torch

from harness.ports.loading import load_port_module, require
from harness.ports.protocol import BuiltTrees, CompiledVerify, Conventions, PortMask
from harness.ports.registry import Family, find_in_checkout
from harness.engine.ddtree.accept import Acceptance
from harness.engine.ddtree.tree import DraftTree

IN_CHECKOUT = ("python/sglang/srt/speculative/dflash_tree_utils.py", "sglang/srt/speculative/dflash_tree_utils.py")

CONVENTIONS = Conventions(
    family="dflash-tree-utils",
    summary="vincentzed/sglang's dflash_tree_utils.py: build_tree_from_topk_cpu, pad_tree_to_budget, "
            "build_tree_custom_mask, tree_accept_greedy",
    budget_counts_root=True,
    topk_rule="W = the run's --topk; breadth-first expansion by accumulated log-prob (all W children at once)",
    padding="token 0, parent 0 (the root), depth 1: position prefix + 1; each sees only itself",
    mask="allow-bool, flat per-request [N, prefix + N] blocks",
    stages=("build", "compile", "accept"),
    padding_token="zero",
    functions=("build_tree_from_topk_cpu", "pad_tree_to_budget", "build_tree_custom_mask", "tree_accept_greedy"),
)


class DFlashTreeUtils:
    conventions = CONVENTIONS

    def __init__(self, path: Path) -> None:
        loaded = load_port_module(find_in_checkout(path, IN_CHECKOUT))
        self.path, self.mod, self.stubbed = loaded.path, loaded.module, loaded.stubbed
        self.fn_build, self.fn_pad, self.fn_mask, self.fn_accept = require(
            self.mod, self.path, "build_tree_from_topk_cpu", "pad_tree_to_budget", "build_tree_custom_mask",
            "tree_accept_greedy")
        self.tree_cls = require(self.mod, self.path, "DraftTreeCPU")

    def _native(self, t: DraftTree):
        return self.tree_cls(token_ids=list(t.tokens), parent_indices=[-1] + list(t.parents[1:]),
                             depths=list(t.depths), num_nodes=t.num_rows)

    def build(self, topk_logprobs, topk_ids, roots, budget, draft_logprobs=None) -> BuiltTrees:
        trees = []
        for b, root in enumerate(roots):
            t = self.fn_build(int(root), topk_ids[b].long(), topk_logprobs[b].float(), budget)
            n = int(t.num_nodes)
            trees.append(DraftTree(tuple(int(x) for x in t.token_ids[:n]),
                                   (None,) + tuple(int(p) for p in t.parent_indices[1:n]),
                                   tuple(int(d) for d in t.depths[:n]), q_len=self.conventions.q_len(budget)))
        return BuiltTrees(tuple(trees))

    def compile(self, trees, prefix_lens) -> CompiledVerify:
        q = trees[0].q_len
        padded = [self.fn_pad(self._native(t), num_verify_tokens=q) for t in trees]
        mask = self.fn_mask(parent_indices_batch=[torch.tensor(p.parent_indices) for p in padded],
                            num_real_nodes=[t.num_rows for t in trees],
                            prefix_lens=torch.tensor(prefix_lens, dtype=torch.int64), num_verify_tokens=q,
                            device="cpu")
        ids = torch.tensor([tok for p in padded for tok in p.token_ids])
        pos = torch.tensor([pre + d for p, pre in zip(padded, prefix_lens) for d in p.depths])
        return CompiledVerify(ids, pos, PortMask(mask, "flat"))

    def accept(self, trees, target_argmax) -> list[Acceptance]:
        out = []
        for b, t in enumerate(trees):
            path, _, bonus = self.fn_accept(torch.tensor(t.tokens), torch.tensor([-1] + list(t.parents[1:])),
                                            target_argmax[b], num_nodes=t.num_rows)
            out.append(Acceptance(tuple(int(i) for i in path), int(bonus)))
        return out


FAMILY = Family("dflash-tree-utils", lambda path: DFlashTreeUtils(path), describe=lambda: CONVENTIONS)
