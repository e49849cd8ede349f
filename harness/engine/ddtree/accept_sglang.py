"""Stage 5 through SGLang's own tree-verify helper: `verify_tree_greedy_triton`
from `sglang.kernels.ops.speculative.spec_tree`, fed first-child /
next-sibling links built from the DDTree parents (DOMAIN.md section 3).

The engine runs one acceptor (RunSettings.accept) and cross-checks the other
every step; harness/check/differential.py turns a disagreement into an `accept` record.


Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch

from harness.engine.ddtree.accept import Acceptance
from harness.engine.ddtree.tree import DraftTree

SPEC_TREE_MODULE = "sglang.kernels.ops.speculative.spec_tree"
ACCEPTORS = ("walk", "sglang")
Acceptor = Callable[[DraftTree, list], Acceptance]   # (tree, predicts) -> Acceptance


@dataclass(frozen=True)
class TreeLinks:
    """SGLang's retrive_* arrays for one request, -1 meaning none; padding rows all -1.

    index  # [q_len] flat row index into the batch's [bs*q_len] verify rows
    next_token  # [q_len] first child of the row
    next_sibling  # [q_len] next child of the row's parent
    """

    index: tuple[int, ...]
    next_token: tuple[int, ...]
    next_sibling: tuple[int, ...]

    def __post_init__(self) -> None:
        if not len(self.index) == len(self.next_token) == len(self.next_sibling):
            raise ValueError("index, next_token and next_sibling must have one entry per verify row")


def build_links(tree: DraftTree, batch_offset: int = 0) -> TreeLinks:
    """First child and next sibling in row order (parent < child, so the
    first child is the lowest-numbered one); batch_offset = b * q_len."""
    n = tree.q_len
    index, first, sibling = [-1] * n, [-1] * n, [-1] * n
    last_child: dict[int, int] = {}
    for row in range(tree.num_rows):
        index[row] = batch_offset + row
        parent = tree.parents[row]
        if parent is None:
            continue
        if parent in last_child:
            sibling[last_child[parent]] = row
        else:
            first[parent] = row
        last_child[parent] = row
    return TreeLinks(tuple(index), tuple(first), tuple(sibling))


LinkBuilder = Callable[[DraftTree, int], TreeLinks]


def import_verify_tree_greedy():
    """SGLang's Triton greedy tree walk; BackendUnavailable when SGLang is missing."""
    from harness.engine.attn.base import BackendUnavailable
    from harness.engine.attn.sglang_triton import INSTALL_HINT, prepare_interpreter
    prepare_interpreter()
    try:
        return importlib.import_module(SPEC_TREE_MODULE).verify_tree_greedy_triton
    except Exception as e:  # noqa: BLE001  (any failure of SGLang's import chain is "unavailable")
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise BackendUnavailable(f"SGLang's verify_tree_greedy_triton does not import "
                                 f"({SPEC_TREE_MODULE}: {first_line}); {INSTALL_HINT}") from None


def sglang_accept_batch(trees: list[DraftTree], predicts: torch.Tensor,
                        links: LinkBuilder | None = None) -> list[Acceptance]:
    """Greedy acceptance for a batch through verify_tree_greedy_triton.

    predicts  # [bs, q_len] target argmax per verify row (target_predict)
    The kernel walks from the root: next_token gives the first child, the
    sibling chain is searched for the candidate equal to the target's token.
    """
    from harness.engine.attn.sglang_triton import use_interpreter
    links = links or build_links
    fn = import_verify_tree_greedy()
    device = "cpu" if use_interpreter() else "cuda"
    bs, n = len(trees), trees[0].q_len
    i64 = dict(dtype=torch.int64, device=device)
    lk = [links(t, b * n) for b, t in enumerate(trees)]
    candidates = torch.tensor([list(t.tokens) + [0] * t.num_padding for t in trees], **i64)  # [bs, q_len]
    retrive_index = torch.tensor([l.index for l in lk], **i64)                # [bs, q_len]
    retrive_next_token = torch.tensor([l.next_token for l in lk], **i64)      # [bs, q_len]
    retrive_next_sibling = torch.tensor([l.next_sibling for l in lk], **i64)  # [bs, q_len]
    target_predict = predicts.to(device=device, dtype=torch.int64).reshape(bs, n)
    depth_slots = max(max(t.depths) for t in trees) + 1  # root + deepest possible acceptance
    accept_index = torch.full((bs, depth_slots), -1, dtype=torch.int32, device=device)  # [bs, depth+1] flat rows
    accept_token_num = torch.zeros(bs, dtype=torch.int32, device=device)             # [bs] accepted drafts
    out_predicts = torch.full((bs * n,), -1, dtype=torch.int32, device=device)       # [bs*q_len]
    fn(out_predicts, accept_index, accept_token_num, candidates, retrive_index,
       retrive_next_token, retrive_next_sibling, target_predict)
    accept_index, accept_token_num = accept_index.cpu(), accept_token_num.cpu()
    out_predicts = out_predicts.cpu()
    result = []
    for b in range(bs):
        flat = accept_index[b, :int(accept_token_num[b]) + 1].tolist()
        result.append(Acceptance(tuple(i - b * n for i in flat), int(out_predicts[flat[-1]])))
    return result


def sglang_accept(tree: DraftTree, predicts: list[int]) -> Acceptance:
    """Pipeline-stage signature: (tree, predicts  # [q_len]) -> Acceptance."""
    return sglang_accept_batch([tree], torch.tensor([predicts]), build_links)[0]


def sglang_accept_available() -> bool:
    from harness.engine.attn.base import BackendUnavailable
    try:
        import_verify_tree_greedy()
        return True
    except BackendUnavailable:
        return False


def pick_acceptors(accept: str, walk: Acceptor) -> tuple[Acceptor, Acceptor | None]:
    """(the acceptor that drives the run, the one cross-checked against it).

    `walk` is the pipeline's accept stage. --accept sglang without SGLang
    raises BackendUnavailable (exit 2); --accept walk without SGLang runs the
    walk alone, with no cross-check.
    """
    if accept not in ACCEPTORS:
        raise ValueError(f"--accept must be one of {', '.join(ACCEPTORS)}, got {accept!r}")
    if accept == "sglang":
        import_verify_tree_greedy()
        return sglang_accept, walk
    return walk, (sglang_accept if sglang_accept_available() else None)
