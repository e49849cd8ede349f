"""`sglang-eagle`: SGLang's own EAGLE tree metadata builder on a DDTree.

ddcheck's best-first tree is written in EAGLE's candidate-lineage encoding
(the flat candidate index whose `// topk` names the parent's lineage slot,
`parent_list` mapping a slot to the parent's flat index, as SGLang's
organize_draft_results hands them over), and SGLang 0.5.23's
`sgl_build_tree_kernel_triton` (FULL_MASK) builds the verify mask, positions
and first-child / next-sibling links from it; `verify_tree_greedy_triton`
walks those links. On CPU both run under the Triton interpreter.

Encoding, with E = the most nodes any depth holds (EAGLE's topk, widened so
that any DDTree fits): a depth-1 node in slot j has flat index j; a deeper
node, child r of the parent in slot j_p of the previous depth, has flat index
E + (d-2)*E*E + j_p*E + r, so flat // E = 1 + (d-2)*E + j_p, and
parent_list[1 + (d-2)*E + j_p] is the parent's flat index. EAGLE's verify has
no padding rows (num_verify_tokens - 1 drafts every round): settings whose
trees would be padded are skipped.


Layer: ports. Imports the engine and below; never faults, check, report, workflows or cli."""
from __future__ import annotations

import importlib

import torch

from harness.ports.protocol import BuiltTrees, CompiledVerify, Conventions, PortError, PortMask
from harness.ports.registry import Family
from harness.engine.ddtree.accept import Acceptance
from harness.engine.ddtree.accept_sglang import TreeLinks, sglang_accept_batch
from harness.engine.ddtree.tree import DraftTree, build_tree

SPEC_TREE = "sglang.kernels.ops.speculative.spec_tree"

CONVENTIONS = Conventions(
    family="sglang-eagle",
    summary="SGLang 0.5.23's EAGLE tree builder (sgl_build_tree_kernel_triton, FULL_MASK) and "
            "verify_tree_greedy_triton, fed ddcheck's DDTree in EAGLE's candidate-lineage encoding",
    budget_counts_root=False,
    topk_rule="the run's --topk per depth (ddcheck's best-first build); EAGLE's topk widened to the widest depth",
    padding="none: EAGLE verifies num_verify_tokens - 1 drafts every round; padded settings are skipped",
    mask="allow-bool, flat per-request [q, prefix+q] blocks (FULL_MASK), prefix columns filled True",
    stages=("build", "compile", "accept"),
    has_padding=False,
    functions=("sgl_build_tree_kernel_triton", "verify_tree_greedy_triton"),
)


def _spec_tree():
    from harness.engine.attn.sglang_triton import prepare_interpreter
    prepare_interpreter()
    try:
        return importlib.import_module(SPEC_TREE)
    except Exception as e:  # noqa: BLE001
        raise PortError(f"sglang-eagle needs SGLang's {SPEC_TREE} ({type(e).__name__}: {e})".splitlines()[0]) from None


def eagle_encoding(tree: DraftTree, e: int | None = None) -> tuple[list[int], list[int], int]:
    """(selected_index  # [num_rows-1] flat candidate index per draft row,
        parent_list  # [1 + (L-1)*E] lineage slot -> parent's flat index, E).
    E defaults to the tree's widest depth; a batch passes its own (one topk for all)."""
    by_depth: dict[int, list[int]] = {}
    for row in range(1, tree.num_rows):
        by_depth.setdefault(tree.depths[row], []).append(row)
    e = e or max((len(v) for v in by_depth.values()), default=1)
    slot = {row: j for rows in by_depth.values() for j, row in enumerate(rows)}
    parent_list = [-1] + [0] * ((max(by_depth, default=1) - 1) * e)
    flat: dict[int, int] = {}
    for row in range(1, tree.num_rows):
        d, parent = tree.depths[row], tree.parents[row]
        if d == 1:
            flat[row] = slot[row]
        else:
            flat[row] = e + (d - 2) * e * e + slot[parent] * e + tree.children(parent).index(row)
            parent_list[1 + (d - 2) * e + slot[parent]] = flat[parent]
    return [flat[r] for r in range(1, tree.num_rows)], parent_list, e


def eagle_order(tree: DraftTree) -> DraftTree:
    """The tree with its draft rows in EAGLE's order: ascending flat candidate
    index, as organize_draft_results sorts top_scores_index."""
    selected, _, _ = eagle_encoding(tree)
    order = [0] + [r for _, r in sorted(zip(selected, range(1, tree.num_rows)))]
    new_of = {old: new for new, old in enumerate(order)}
    parents = tuple(None if tree.parents[o] is None else new_of[tree.parents[o]] for o in order)
    return DraftTree(tuple(tree.tokens[o] for o in order), parents, tuple(tree.depths[o] for o in order), tree.q_len)


class SGLangEagle:
    conventions = CONVENTIONS

    def __init__(self) -> None:
        self.mod = _spec_tree()

    def build(self, topk_logprobs, topk_ids, roots, budget, draft_logprobs=None) -> BuiltTrees:
        trees = []
        for b, root in enumerate(roots):
            lp = torch.full((topk_logprobs.shape[1], int(topk_ids.max()) + 1), float("-inf"), dtype=torch.float64)
            lp.scatter_(1, topk_ids[b].long(), topk_logprobs[b].double())  # [L, vocab'] -inf off the top-K
            tree = build_tree(root, lp, budget, topk_ids.shape[-1])
            trees.append(eagle_order(tree))
        return BuiltTrees(tuple(trees))

    def _kernel(self, trees: list[DraftTree], prefix_lens: list[int]):
        """SGLang's builder for the batch: (tree_mask flat bool, positions [bs*q], retrive [3, bs, q])."""
        bs, q = len(trees), trees[0].q_len
        if any(t.num_padding for t in trees):
            raise PortError("sglang-eagle: EAGLE's builder has no padding rows (the tree has fewer rows than q_len)")
        e = max(eagle_encoding(t)[2] for t in trees)
        enc = [eagle_encoding(t, e)[:2] for t in trees]
        depth = max(max(t.depths) for t in trees)
        width = max(len(p) for _, p in enc)
        i64 = dict(dtype=torch.int64)
        parent_list = torch.tensor([p + [0] * (width - len(p)) for _, p in enc], **i64)    # [bs, 1+(L-1)E]
        selected = torch.tensor([s for s, _ in enc], **i64)                                # [bs, q-1]
        seq_lens = torch.tensor(prefix_lens, **i64)
        mask = torch.ones(sum(prefix_lens) * q + q * q * bs, dtype=torch.bool)             # prefix columns True
        positions = torch.empty(bs * q, **i64)
        retrive = torch.full((3, bs, q), -1, **i64)
        dev = _device()
        args = [x.to(dev) for x in (parent_list, selected, seq_lens, mask, positions, retrive[0], retrive[1], retrive[2])]
        self.mod.sgl_build_tree_kernel_triton(*args, e, depth, q, self.mod.TreeMaskMode.FULL_MASK)
        return args[3].cpu(), args[4].cpu(), torch.stack(args[5:8]).cpu()

    def compile(self, trees, prefix_lens) -> CompiledVerify:
        mask, positions, retrive = self._kernel(list(trees), list(prefix_lens))
        ids = torch.tensor([tok for t in trees for tok in t.tokens], dtype=torch.int64)
        return CompiledVerify(ids, positions, PortMask(mask, "flat"), {"retrive": retrive})

    def accept(self, trees, target_argmax) -> list[Acceptance]:
        _, _, retrive = self._kernel(list(trees), [0] * len(trees))
        links = {b: TreeLinks(*(tuple(retrive[k, b].tolist()) for k in range(3))) for b in range(len(trees))}
        return sglang_accept_batch(list(trees), target_argmax, lambda t, off: links[off // t.q_len])


def _device() -> str:
    from harness.engine.attn.sglang_triton import use_interpreter
    return "cpu" if use_interpreter() else "cuda"


FAMILY = Family("sglang-eagle", lambda path: SGLangEagle(), needs_path=False, describe=lambda: CONVENTIONS)
