"""`dflash-tree`: JetSpec's tree DFlash (`dflash_tree.py`, SGLang PR #29587 / #29524).

Functions driven (public signatures):
- build_tree(root_token, topk_tokens [L, W], topk_logprobs [L, W], *, tree_width,
  budget, construction) -> DFlashDraftTree(tokens, parent_indices, depths,
  num_nodes); the budget counts the root; construction "depth_first" (the
  greedy spine first, then side branches) by default, or "opt_prefix";
- tree_to_verify_buffers(trees, num_verify_tokens, base_positions) -> dict of
  draft_token / positions [bs, N] and retrieve_* links (-1 for none); short trees
  are padded with isolated nodes (token 0, position 0);
- build_tree_custom_mask(trees, num_verify_tokens, kv_lens) -> flat allow-mask,
  per request [N, kv_len + N];
- verify_tree_greedy_cpu(tree, target_predict) -> {accept_indices, bonus_token}.


Layer: ports. Imports the engine and below; never faults, check, report, workflows or cli."""
from __future__ import annotations

from pathlib import Path

import torch

from harness.ports.loading import load_port_module, parameters, require
from harness.ports.protocol import BuiltTrees, CompiledVerify, Conventions, PortError, PortMask
from harness.ports.registry import Family, find_in_checkout
from harness.engine.ddtree.accept import Acceptance
from harness.engine.ddtree.tree import DraftTree

IN_CHECKOUT = ("python/sglang/srt/speculative/dflash_tree.py", "sglang/srt/speculative/dflash_tree.py")

CONVENTIONS = Conventions(
    family="dflash-tree",
    summary="JetSpec's dflash_tree.py (SGLang PR #29587): build_tree, tree_to_verify_buffers, "
            "build_tree_custom_mask, verify_tree_greedy_cpu",
    budget_counts_root=True,
    topk_rule="tree_width = the run's --topk; its default construction is depth_first (greedy spine, then "
              "side branches), not DDTree's best-first",
    padding="isolated nodes: token 0, position 0, parent -1; each sees the root and itself",
    mask="allow-bool, flat per-request [N, kv_len + N] blocks",
    stages=("build", "compile", "accept"),
    padding_token="zero", padding_position="zero",
    functions=("build_tree", "tree_to_verify_buffers", "build_tree_custom_mask", "verify_tree_greedy_cpu"),
)


class DFlashTree:
    conventions = CONVENTIONS

    def __init__(self, path: Path) -> None:
        loaded = load_port_module(find_in_checkout(path, IN_CHECKOUT))
        self.path, self.mod, self.stubbed = loaded.path, loaded.module, loaded.stubbed
        self.fn_build, self.fn_buffers, self.fn_mask, self.fn_accept = require(
            self.mod, self.path, "build_tree", "tree_to_verify_buffers", "build_tree_custom_mask",
            "verify_tree_greedy_cpu")
        tree_cls = getattr(self.mod, "DFlashDraftTree", None)
        if tree_cls is None:
            raise PortError(f"{self.path}: no DFlashDraftTree (the tree type its functions take)")
        self.tree_cls = tree_cls
        if "tree_width" not in parameters(self.fn_build):
            raise PortError(f"{self.path}: build_tree takes no tree_width; the adapter knows "
                            "build_tree(root_token, topk_tokens, topk_logprobs, *, tree_width, budget, ...)")

    def _native(self, tree: DraftTree):
        return self.tree_cls(tokens=list(tree.tokens), parent_indices=[-1] + list(tree.parents[1:]),
                             depths=list(tree.depths), num_nodes=tree.num_rows)

    def build(self, topk_logprobs, topk_ids, roots, budget, draft_logprobs=None) -> BuiltTrees:
        trees, native = [], []
        for b, root in enumerate(roots):
            t = self.fn_build(int(root), topk_ids[b].long(), topk_logprobs[b].float(),
                              tree_width=int(topk_ids.shape[-1]), budget=budget)
            native.append(t)
            n = int(t.num_nodes)
            trees.append(DraftTree(tuple(int(x) for x in t.tokens[:n]),
                                   (None,) + tuple(int(p) for p in t.parent_indices[1:n]),
                                   tuple(int(d) for d in t.depths[:n]), q_len=self.conventions.q_len(budget)))
        return BuiltTrees(tuple(trees), {"trees": native})

    def compile(self, trees, prefix_lens) -> CompiledVerify:
        q = trees[0].q_len
        native = [self._native(t) for t in trees]
        bufs = self.fn_buffers(native, q, torch.tensor(prefix_lens, dtype=torch.int64))
        mask = self.fn_mask(native, q, list(prefix_lens))
        return CompiledVerify(bufs["draft_token"].reshape(-1), bufs["positions"].reshape(-1),
                              PortMask(mask, "flat"), {"buffers": bufs})

    def accept(self, trees, target_argmax) -> list[Acceptance]:
        out = []
        for b, t in enumerate(trees):
            r = self.fn_accept(self._native(t), target_argmax[b])
            out.append(Acceptance(tuple(int(i) for i in r["accept_indices"]), int(r["bonus_token"])))
        return out


FAMILY = Family("dflash-tree", lambda path: DFlashTree(path), describe=lambda: CONVENTIONS)
