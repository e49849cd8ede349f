"""`dflash2-beam`: the DFlash2 beam tree's verify metadata (SGLang PR #36196,
`dflash_tree.py` beside `dflash_tree_verify.py`).

Functions driven (public signatures):
- build_ancestor_mask(*, node_parents [bs, N], max_depth) -> [bs, N, N] bool
  ancestor closure (diagonal and root column set);
- build_full_tree_mask(*, ancestor_mask, prefix_lens_cpu) -> the flat allow-mask,
  per request [N, prefix + N];
- build_dflash_tree_meta(*, ancestor_mask, prefix_lens int64) -> (positions
  [bs*N], retrive_index, retrive_next_token, retrive_next_sibling [bs, N]),
  through sgl_kernel's reconstruct_indices_from_tree_mask: a CUDA kernel. Where
  it does not import (a machine without CUDA) the port's positions cannot be
  produced; the adapter then hands the kernel prefix + depth and the summary's
  `stubbed_imports` names the missing module.

A beam of width W has exactly W nodes per depth, N = 1 + (block_size-1) * W,
so its trees are never padded: padded settings are skipped. The beam walk
itself lives in the model file and its acceptance needs CUDA kernels, so the
adapter provides the compile stage; ddcheck's tree, acceptance and commit run
around it.


Layer: ports. Imports the engine and below; never faults, check, report, workflows or cli."""
from __future__ import annotations

from pathlib import Path

import torch

from harness.ports.loading import load_port_module, require
from harness.ports.protocol import CompiledVerify, Conventions, PortMask
from harness.ports.registry import Family, find_in_checkout
from harness.engine.ddtree.tree import DraftTree

IN_CHECKOUT = ("python/sglang/srt/speculative/dflash_tree.py", "sglang/srt/speculative/dflash_tree.py")
META_KERNEL = "sgl_kernel.speculative"

CONVENTIONS = Conventions(
    family="dflash2-beam",
    summary="DFlash2 beam tree (SGLang PR #36196): build_ancestor_mask, build_full_tree_mask, "
            "build_dflash_tree_meta",
    budget_counts_root=False,
    topk_rule="the beam width W: W nodes per depth (ddcheck's tree stands in for the model's beam walk)",
    padding="none: N = 1 + (block_size - 1) * W nodes every round; padded settings are skipped",
    mask="allow-bool, flat per-request [N, prefix + N] blocks",
    stages=("compile",),
    has_padding=False,
    functions=("build_ancestor_mask", "build_full_tree_mask", "build_dflash_tree_meta"),
)


class DFlash2Beam:
    conventions = CONVENTIONS

    def __init__(self, path: Path) -> None:
        loaded = load_port_module(find_in_checkout(path, IN_CHECKOUT))
        self.path, self.mod, self.stubbed = loaded.path, loaded.module, loaded.stubbed
        self.fn_anc, self.fn_full, self.fn_meta = require(
            self.mod, self.path, "build_ancestor_mask", "build_full_tree_mask", "build_dflash_tree_meta")
        self.meta_runs = not any(m == META_KERNEL or m.startswith(META_KERNEL + ".") or m == "sgl_kernel"
                                 for m in self.stubbed)

    def compile(self, trees: list[DraftTree], prefix_lens: list[int]) -> CompiledVerify:
        parents = torch.tensor([[-1] + list(t.parents[1:]) + [-1] * t.num_padding for t in trees])  # [bs, N]
        anc = self.fn_anc(node_parents=parents, max_depth=max(max(t.depths) for t in trees))
        mask = self.fn_full(ancestor_mask=anc, prefix_lens_cpu=torch.tensor(prefix_lens, dtype=torch.int64))
        prefix = torch.tensor(prefix_lens, dtype=torch.int64)
        if self.meta_runs:
            positions = self.fn_meta(ancestor_mask=anc, prefix_lens=prefix.to(anc.device))[0]
        else:   # the port's positions come from a CUDA kernel that is not here
            positions = torch.tensor([p + d for t, p in zip(trees, prefix_lens) for d in t.depths])
        ids = torch.tensor([tok for t in trees for tok in t.tokens])
        return CompiledVerify(ids, positions.reshape(-1), PortMask(mask, "flat"),
                              {"ancestor_mask": anc, "positions_from_port": self.meta_runs})


FAMILY = Family("dflash2-beam", lambda path: DFlash2Beam(path), describe=lambda: CONVENTIONS)
