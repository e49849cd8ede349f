"""The verify pipeline as swappable stages. Each field is a plain function;
a user (or a fault) replaces one with dataclasses.replace.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from harness.engine.graph import GraphOptions
from harness.engine.model.stages import ModelStages
from harness.engine.ddtree.accept import cut_at_stop, greedy_walk
from harness.engine.ddtree.commit import commit_kv
from harness.engine.ddtree.commit_paged import commit_paged
from harness.engine.ddtree.mask import flat_custom_mask
from harness.engine.ddtree.tree import build_tree
from harness.engine.ddtree.verify_inputs import build_verify_batch
from harness.engine.ddtree.verify_inputs import prefill_metadata
from harness.engine.ddtree.verify_slots import place_batch
from harness.engine.ddtree.window import fold_window


def verify_width(budget: int) -> int:
    """q_len = budget + 1: the root plus `budget` draft nodes."""
    return budget + 1


@dataclass(frozen=True)
class Pipeline:
    build_tree: Callable = build_tree               # (root, draft_logprobs, budget, topk) -> DraftTree
    build_mask: Callable = flat_custom_mask         # (trees, prefix_lens) -> (custom_mask, mask_indptr)
    build_verify_batch: Callable = build_verify_batch
    window: Callable = fold_window                  # (verify batch, sliding window) -> the batch with its window mask
    accept: Callable = greedy_walk                  # (tree, predicts) -> Acceptance
    stop: Callable = cut_at_stop                    # (tree, acceptance, eos_id) -> acceptance committed
    commit: Callable = commit_kv                    # (req_to_token, allocator, req, seq_len, row_slots, acc) -> seq_len
    graph: GraphOptions = GraphOptions()
    # what build_tree claims to be: "ddtree-best-first" (the budget best draft prefixes, at most topk
    # per depth) is checked against the oracle's own build every step; None (e.g. a port's own tree) is not
    tree_builder: str | None = "ddtree-best-first"
    width: Callable[[int], int] = verify_width      # budget -> verify width q_len
    # a batched commit replaces `commit` when set (a port's own commit code):
    # (req_pool, kv_pool, req_pool_indices, seq_lens, out_cache_loc [bs*q_len], trees, acceptances) -> seq_lens
    commit_batch: Optional[Callable] = None
    # a batched bonus read replaces each acceptance's bonus when set:
    # (predicts [bs*q_len] the batch's argmax, b, q_len, trees, acceptance) -> bonus token
    read_bonus: Optional[Callable] = None
    # page size > 1 (harness/engine/ddtree/verify_slots.py, commit_paged.py): the rows' slots in branch regions,
    # (allocator, pool, trees, seq_lens, prefix_slots) -> (out_cache_loc [bs*q_len], placements), and the
    # compaction, (req_to_token, pool, req_pool_idx, seq_len, placement, acceptance) -> seq_len
    place_rows: Callable = place_batch
    commit_paged: Callable = commit_paged
    # wraps the run's attention backend (a change to the kernel itself): backend -> backend; None: as made
    attention: Optional[Callable] = None
    # tensor parallelism (harness/engine/tp): each rank's own pipeline, (pipeline, rank, tp) -> pipeline (a stage
    # broken on one rank); None: every rank runs this one. Picklable: it travels to the ranks
    rank_stages: Optional[Callable] = None
    # the KV heads each rank holds, (rank, tp, num_kv_heads) -> heads; None: SGLang's rule (tp/sharding.py)
    kv_head_layout: Optional[Callable] = None
    # the model's own stages (MLA's latent RoPE position and slot, the MoE's dispatch): harness/engine/model/stages.py
    model_stages: ModelStages = ModelStages()
    # the prefill's metadata, (prompt lens, out_cache_loc [sum lens]) -> AttnMetadata: a causal extend of whole prompts
    prefill_metadata: Callable = prefill_metadata
