"""The fault catalog (DOMAIN.md section 4). Each fault swaps one pipeline
stage or flips one graph option; none of them is special-cased elsewhere.

Layer: faults. Imports the engine and below; never ports, check, report, workflows or cli."""
from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch

from harness.faults.fault import (Fault, all_of, batch_padded, has_branch, has_padding, has_window, num_nodes,
                                  reads_max_kv_len, reads_prefix_mask, two_steps)
from harness.engine.attn.base import PLAIN
from harness.engine.attn.registry import serves_batches
from harness.engine.ddtree.accept import Acceptance, depth_order_parents, greedy_walk, walk_parents
from harness.engine.ddtree.mask import flatten_blocks, request_mask_block, tree_visibility
from harness.engine.ddtree.tree import DraftTree
from harness.engine.ddtree.verify_inputs import VerifyBatch, build_verify_batch
from harness.engine.ddtree.commit_paged import commit_paged, compaction_plan
from harness.engine.ddtree.verify_slots import place_batch
from harness.engine.ddtree.window import with_window
from harness.faults.mla_moe import MLA_MOE_FAULTS
from harness.faults.tp_faults import TP_FAULTS


def _graph(**switches):
    return lambda p: replace(p, graph=replace(p.graph, **switches))


# -- mask stage ---------------------------------------------------------------------

def _mask_padding_visible(trees: list[DraftTree], prefix_lens: list[int]):
    """Real rows also see every padding row's column (the seed's bug)."""
    blocks = []
    for t, p in zip(trees, prefix_lens):
        block = request_mask_block(t, p)
        block[:t.num_rows, p + t.num_rows:] = True
        blocks.append(block)
    return flatten_blocks(blocks)


def _mask_row_stride(trees: list[DraftTree], prefix_lens: list[int]):
    """Rows written at stride prefix + real rows (the padding columns dropped)
    into a block the kernel reads at stride prefix + q_len."""
    blocks = []
    for t, p in zip(trees, prefix_lens):
        good = request_mask_block(t, p)                     # [q_len, p+q_len]
        width = p + t.num_rows
        flat = torch.zeros(good.numel(), dtype=torch.bool)
        flat[:t.q_len * width] = good[:, :width].reshape(-1)
        blocks.append(flat)
    return flatten_blocks(blocks)


def _mask_rectangle(trees: list[DraftTree], prefix_lens: list[int]):
    """One padded rectangle [bs, q_len, max_prefix + q_len]: each request's
    prefix left-aligned, its draft part at max_prefix (SGLang PR 27509)."""
    n, maxp, bs = trees[0].q_len, max(prefix_lens), len(trees)
    rect = torch.zeros((bs, n, maxp + n), dtype=torch.bool)
    for b, (t, p) in enumerate(zip(trees, prefix_lens)):
        rect[b, :, :p] = True
        rect[b, :, maxp:] = tree_visibility(t)
    return rect.reshape(-1), torch.arange(bs + 1, dtype=torch.int64) * n * (maxp + n)


def _mask_padding_rows_empty(trees: list[DraftTree], prefix_lens: list[int]):
    """Padding rows see nothing at all, not even their own diagonal."""
    blocks = []
    for t, p in zip(trees, prefix_lens):
        block = request_mask_block(t, p)
        block[t.num_rows:] = False
        blocks.append(block)
    return flatten_blocks(blocks)


def _mask_other_requests_tree(trees: list[DraftTree], prefix_lens: list[int]):
    """Request i's block holds request i+1's tree (cyclically): the blocks are
    sized and placed right, but filled in another request order."""
    bs = len(trees)
    return flatten_blocks([request_mask_block(trees[(i + 1) % bs], p) for i, p in enumerate(prefix_lens)])


# -- verify-inputs stage ------------------------------------------------------------

def _inputs_then(edit):
    """A verify-inputs stage: SGLang's layout, then `edit(vb, trees)` on copies."""
    def stage(trees, seq_lens, req_pool_indices, req_to_token, out_cache_loc, mask_builder):
        vb = build_verify_batch(trees, seq_lens, req_pool_indices, req_to_token, out_cache_loc, mask_builder)
        vb = replace(vb, input_ids=vb.input_ids.clone(), positions=vb.positions.clone(),
                     attn=replace(vb.attn, out_cache_loc=vb.attn.out_cache_loc.clone(),
                                  custom_mask=vb.attn.custom_mask.clone()))
        edit(vb, trees)
        return vb
    return stage


def _relabel_reversed(vb: VerifyBatch, trees: list[DraftTree]) -> None:
    """Draft rows renumbered in reverse (children before parents) in the
    tokens, positions and mask, while the engine reads logits, accepts and
    commits in the tree's numbering."""
    n = vb.q_len
    for b, (t, p) in enumerate(zip(trees, vb.seq_lens.tolist())):
        order = torch.tensor([0] + list(range(t.num_rows - 1, 0, -1)) + list(range(t.num_rows, n)))
        rows = slice(b * n, (b + 1) * n)
        vb.input_ids[rows] = vb.input_ids[rows][order]
        vb.positions[rows] = vb.positions[rows][order]
        start = int(vb.attn.mask_indptr[b])
        block = vb.attn.custom_mask[start:start + n * (p + n)].view(n, p + n)  # [q_len, p+q_len]
        cols = torch.cat([torch.arange(p), p + order])
        block.copy_(block[order][:, cols])


def _positions_from_index(vb: VerifyBatch, trees: list[DraftTree]) -> None:
    """positions = prefix + row index instead of prefix + depth."""
    n = vb.q_len
    for b, (t, p) in enumerate(zip(trees, vb.seq_lens.tolist())):
        vb.positions[b * n:b * n + t.num_rows] = p + torch.arange(t.num_rows)


def _positions_shifted(vb: VerifyBatch, trees: list[DraftTree]) -> None:
    """Every real row's position one past prefix + depth (the prefix length counted with the root)."""
    n = vb.q_len
    for b, t in enumerate(trees):
        vb.positions[b * n:b * n + t.num_rows] += POSITION_OFFSET


POSITION_OFFSET = 1


def _padding_slots_alias(vb: VerifyBatch, trees: list[DraftTree]) -> None:
    """Padding rows write their K/V into draft rows' slots (1, 2, ... cyclically)."""
    n, loc = vb.q_len, vb.attn.out_cache_loc
    for b, t in enumerate(trees):
        for j in range(t.num_rows, n):
            loc[b * n + j] = loc[b * n + 1 + (j - t.num_rows) % (t.num_rows - 1)]


# -- window stage ----------------------------------------------------------------------

def _window_by_row_index(vb: VerifyBatch, window: int) -> VerifyBatch:
    """The window measured from prefix + row index (the flattened query index, as SGLang's kernel applies its own
    sliding_window_size) instead of each row's position prefix + depth: siblings lose keys at the window's edge."""
    attn = with_window(vb.attn, vb.positions, window,
                       row_positions=lambda b, prefix, rows: prefix + torch.arange(rows.numel()))
    return replace(vb, attn=attn)


def _window_ignored(vb: VerifyBatch, window: int) -> VerifyBatch:
    """No window mask is built for the verify: the sliding layers read the full tree mask."""
    return vb


# -- accept and commit stages -------------------------------------------------------

def _bonus_from_root(tree: DraftTree, predicts: list[int]) -> Acceptance:
    """The walk is right, but the bonus is the root's argmax, not the last accepted row's."""
    return Acceptance(greedy_walk(tree, predicts).rows, predicts[0])


def _accept_level_map(tree: DraftTree, predicts: list[int]) -> Acceptance:
    """The walk looks the next row up in a token-keyed map per depth, {(depth, token): row},
    filled in row order: a later node at the same depth with the same token (DDTree's
    per-depth top-k repeats tokens under different parents) shadows the earlier one, and
    the walk stops where the found row is not a child of the current one."""
    level = {(tree.depths[r], tree.tokens[r]): r for r in range(1, tree.num_rows)}
    cur, rows = 0, [0]
    while (nxt := level.get((tree.depths[cur] + 1, predicts[cur]))) is not None and tree.parents[nxt] == cur:
        cur = nxt
        rows.append(cur)
    return Acceptance(tuple(rows), predicts[cur])


def _accept_on_depth_order(tree: DraftTree, predicts: list[int]) -> Acceptance:
    """The walk reads the parent table of the tree renumbered in depth order (a
    breadth-first layout, as before a reorder into pop order), while tokens,
    predicts and the rows it returns are in the verified numbering: it walks a
    different tree than the verify masked."""
    return walk_parents(tree, depth_order_parents(tree), predicts)


def _bonus_at_packed_offset(predicts: list[int], b: int, q_len: int, trees: list[DraftTree],
                            acceptance: Acceptance) -> int:
    """The bonus read from the batch's flat argmax at the packed offset (the real rows of
    the earlier requests) instead of the padded one (b * q_len)."""
    return predicts[sum(t.num_rows for t in trees[:b]) + acceptance.rows[-1]]


def _stop_ignored(tree: DraftTree, acceptance: Acceptance, eos_id: int | None) -> Acceptance:
    """The whole accepted chunk is committed, an end-of-sequence token inside it notwithstanding."""
    return acceptance


def _commit_contiguous(req_to_token, allocator, req_pool_idx, seq_len, row_slots, acceptance) -> int:
    """req_to_token gets the first n rows' slots (out_cache_loc[:n]) instead of
    the accepted rows' slots: right only when the accept is rows 0..n-1."""
    n = acceptance.num_committed
    req_to_token.req_to_token[req_pool_idx, seq_len:seq_len + n] = row_slots[:n].to(req_to_token.req_to_token.device)
    allocator.free(row_slots[n:].cpu())
    return seq_len + n


def _commit_frees_last_accepted(req_to_token, allocator, req_pool_idx, seq_len, row_slots, acceptance) -> int:
    """req_to_token is re-pointed right, but the keep mask drops the last
    accepted row (as if its K/V were recomputed with the bonus next round):
    its slot is freed while position seq_len + n - 1 still points at it."""
    rows = torch.tensor(acceptance.rows, dtype=torch.int64)
    n = rows.numel()
    req_to_token.req_to_token[req_pool_idx, seq_len:seq_len + n] = row_slots[rows].to(req_to_token.req_to_token.device)
    keep = torch.zeros(row_slots.numel(), dtype=torch.bool)
    keep[rows[:-1]] = True
    allocator.free(row_slots[~keep].cpu())
    return seq_len + n


# -- paged KV (page size > 1) ----------------------------------------------------------

def _plan_permuted(placed, acceptance):
    """The compaction plan with two accepted tokens' sources swapped where their
    committed positions share a page: each slot gets the other's K/V."""
    win, tgt, src = compaction_plan(placed, acceptance)
    ps = placed.page_size
    j = next((j for j in range(tgt.numel() - 1) if int(tgt[j]) // ps == int(tgt[j + 1]) // ps), None)
    if j is not None:
        src = src.clone()
        src[[j, j + 1]] = src[[j + 1, j]]
    return win, tgt, src


NEED_PAGED = lambda s, v: s.page_size > 1  # noqa: E731


# -- the catalog ----------------------------------------------------------------------

def _stage(**stages):
    return lambda p: replace(p, **stages)


# ddcheck's own graph runner (a serving backend replays SGLang's own graph state, which has no such switches)
NEED_GRAPH = lambda s, v: s.cuda_graph and not serves_batches(s.backend)  # noqa: E731
NEED_TWO_NODES = lambda s, v: num_nodes(s, v) >= 2  # noqa: E731
NEED_WALK = lambda s, v: s.accept == "walk"  # noqa: E731
NEED_BATCH = lambda s, v: s.batch >= 2  # noqa: E731
ANY = lambda s, v: True  # noqa: E731
NEED_EOS = lambda s, v: s.eos_id is not None  # noqa: E731

CATALOG = (
    Fault("padded-kv-visible", "padding columns left visible to real rows: real nodes attend to padded KV slots",
          "padding rows (actual < budget, e.g. --budget 16 --topk 1)", "padding-leak",
          _stage(build_mask=_mask_padding_visible), has_padding, source="seed"),
    Fault("mask-row-stride", "mask rows laid out at stride prefix + real rows instead of the kernel's prefix + q_len",
          "padding rows (actual < budget, e.g. --budget 16 --topk 1)", "mask-shift",
          _stage(build_mask=_mask_row_stride), has_padding,
          source="TensorRT-LLM PR #13081"),
    Fault("padded-rectangle-mask", "batch mask built as one [bs, q_len, max_prefix + q_len] rectangle, "
          "not per-request blocks", "--batch >= 2 (prompts of different lengths)", "batch-mask-layout",
          _stage(build_mask=_mask_rectangle), NEED_BATCH, source="SGLang PR #27509"),
    Fault("short-graph-mask", "graph mask buffer declared with the live batch's length; batch-padding "
          "requests read past its end", "--cuda-graph, --batch not a power of two (e.g. 3 -> bucket 4), "
          "a backend that reads the prefix columns (--backend torch)", "mask-out-of-bounds",
          _graph(mask_buffer_for_bucket=False), all_of(NEED_GRAPH, batch_padded, reads_prefix_mask),
          source="SGLang #6309"),
    Fault("graph-captured-causal", "graph captured without the custom mask: replay runs causal, the tree is ignored",
          "--cuda-graph, --topk >= 2, --budget >= --block-size (a branching tree)", "graph-causal-mask",
          _graph(capture_custom_mask=False), all_of(NEED_GRAPH, has_branch)),
    Fault("stale-graph-mask", "graph replays without refilling the mask buffer: the capture's mask is reused",
          "--cuda-graph, --max-new-tokens > --block-size + 1 (a second replay)", "stale-graph-mask",
          _graph(refill_mask=False), all_of(NEED_GRAPH, two_steps)),
    Fault("stale-kv-indices", "graph replays without refilling kv_indices: prefixes read the capture's slots",
          "--cuda-graph, --max-new-tokens > --block-size + 1 (a second replay)", "stale-kv-indices",
          _graph(refill_kv_indices=False), all_of(NEED_GRAPH, two_steps),
          source="SGLang PR #37975 (kv_indptr)"),
    Fault("no-kv-compaction", "after a scattered accept req_to_token gets out_cache_loc[:n], not the accepted rows' slots",
          "--topk >= 2, --budget >= --block-size, --max-new-tokens > --block-size + 1", "kv-not-compacted",
          _stage(commit=_commit_contiguous), all_of(has_branch, two_steps)),
    Fault("padded-row-fully-masked", "padding rows see no key at all: 0/0 softmax, NaN in their output",
          "padding rows and a backend that reads the prefix columns (--backend torch); "
          "SGLang's kernel always sees the prefix", "fully-masked-row",
          _stage(build_mask=_mask_padding_rows_empty), all_of(has_padding, reads_prefix_mask),
          source="PyTorch #103749"),
    Fault("child-before-parent", "draft rows renumbered in reverse (children before parents) in the inputs and mask",
          "at least 2 draft nodes", "node-order",
          _stage(build_verify_batch=_inputs_then(_relabel_reversed)), NEED_TWO_NODES),
    Fault("position-from-index", "positions = prefix + row index instead of prefix + depth",
          "--topk >= 2, --budget >= --block-size (a node whose index differs from its depth)", "wrong-position",
          _stage(build_verify_batch=_inputs_then(_positions_from_index)), has_branch,
          source="mlxcel PR #1214"),
    Fault("padding-slot-alias", "padding rows' out_cache_loc aliases draft rows' slots: their write clobbers "
          "a node's K/V", "padding rows, at least 2 draft nodes, --max-new-tokens > --block-size + 1 "
          "(shows after commit)", "slot-alias",
          _stage(build_verify_batch=_inputs_then(_padding_slots_alias)), all_of(has_padding, NEED_TWO_NODES, two_steps),
          source="vLLM PR #56734"),
    Fault("bonus-from-wrong-node", "bonus token taken from the root's argmax instead of the last accepted row's",
          "--accept walk, --max-new-tokens > --block-size + 1 (shows in the stream)", "wrong-bonus",
          _stage(accept=_bonus_from_root), all_of(NEED_WALK, two_steps),
          source="EAGLE PR #47"),
    Fault("free-slot-read", "the commit frees the last accepted row's slot while req_to_token still points at it: "
          "the next verify's kv_indices reach a freed slot", "--max-new-tokens > --block-size + 1 (a second verify "
          "reads it)", "free-slot-read", _stage(commit=_commit_frees_last_accepted), two_steps),
    Fault("position-base-offset", f"every real row's position shifted by {POSITION_OFFSET}: prefix + depth + "
          f"{POSITION_OFFSET}", "any settings", "position-offset",
          _stage(build_verify_batch=_inputs_then(_positions_shifted)), ANY,
          source="SGLang PR #25015"),
    Fault("stale-graph-positions", "graph replays without refilling the positions buffer: rows keep the "
          "previous replay's positions", "--cuda-graph, --max-new-tokens > --block-size + 1 (a second replay)",
          "stale-graph-positions", _graph(refill_positions=False), all_of(NEED_GRAPH, two_steps),
          source="SGLang PR #10892"),
    Fault("mask-request-permutation", "request i's mask block holds request i+1's tree: blocks sized and placed "
          "right, filled in another request order", "--batch >= 2, --topk >= 2, --budget >= --block-size "
          "(trees of different shapes)", "mask-of-other-request",
          _stage(build_mask=_mask_other_requests_tree), all_of(NEED_BATCH, has_branch), source="vLLM PR #14645"),
    Fault("bonus-stride-cross-request", "bonus read from the batch's argmax at the packed offset (earlier "
          "requests' real rows) instead of b * q_len: it lands in another request's rows",
          "--batch >= 2 and padding rows (actual < budget)", "bonus-cross-request",
          _stage(read_bonus=_bonus_at_packed_offset), all_of(NEED_BATCH, has_padding)),
    Fault("duplicate-sibling-token", "acceptance finds the next row in a token-keyed map per depth: a later node "
          "with the same token at that depth shadows the child, the walk stops early",
          "--topk >= 2, --budget >= --block-size (nodes repeating a token at one depth)", "token-shadowed",
          _stage(accept=_accept_level_map), all_of(NEED_WALK, has_branch)),
    Fault("commit-past-stop", "a whole accepted chunk is committed and emitted past an end-of-sequence token "
          "accepted inside it", "--eos-id, a token the target's greedy stream emits as an accepted draft (not "
          "as the bonus)", "commit-past-stop", _stage(stop=_stop_ignored), NEED_EOS,
          source="transformers #47912"),
    Fault("padded-entry-live", "graph batch-padding entries repeat the last live request's seq_len, kv_indices, "
          "positions and out_cache_loc instead of dummies: their K/V writes land in that request's verify slots",
          "--cuda-graph, --batch not a power of two (e.g. 3 -> bucket 4)", "padded-entry-live",
          _graph(dummy_padding_entries=False), all_of(NEED_GRAPH, batch_padded),
          source="TensorRT-LLM PR #9873 (Mamba state)"),
    Fault("stale-graph-scalar", "the graph freezes max_kv_len (the prefix loop's bound, a host scalar) at the "
          "capturing batch's longest prefix: later, longer prefixes lose their tail keys",
          "--cuda-graph, --max-new-tokens > --block-size + 1 (a second replay), a backend that bounds its "
          "prefix loop by max_kv_len (--backend torch)", "stale-graph-scalar",
          _graph(max_kv_len_at_capacity=False), all_of(NEED_GRAPH, two_steps, reads_max_kv_len),
          source="flash-attention #1164"),
    Fault("accept-topology-mismatch", "acceptance walks the parent table of the tree in depth order while the verify "
          "masked it in pop order: the accepted rows are not a path of the verified tree",
          "--topk >= 2, --budget >= --block-size (pop order differs from depth order)",
          "accept-topology-mismatch", _stage(accept=_accept_on_depth_order), all_of(NEED_WALK, has_branch)),
    Fault("paged-compaction-permutation", "the paged compaction copies two accepted tokens' K/V into each other's "
          "slots inside a page: req_to_token stays page-consistent, the bytes are permuted",
          "--page-size > 1, --max-new-tokens > --block-size + 1 (a second verify reads them)",
          "kv-compaction-permuted", _stage(commit_paged=partial(commit_paged, plan=_plan_permuted)),
          all_of(NEED_PAGED, two_steps), source="SGLang #31218"),
    Fault("paged-branch-shared-tail", "every branch region starts in the request's own partial tail page instead of "
          "a copy of it: branches write over each other's tail slots", "--page-size > 1, --topk >= 2, --budget >= "
          "--block-size (branches), --max-new-tokens > --block-size + 1", "branch-shared-tail",
          _stage(place_rows=partial(place_batch, share_tail=True)), all_of(NEED_PAGED, has_branch, two_steps),
          source="SGLang PR #26972"),
    Fault("swa-window-by-row-index", "the sliding window measured from prefix + row index instead of prefix + depth: "
          "rows past their depth lose the prefix keys at the window's edge", "a sliding window (--sliding-window N "
          "or a windowed preset), --topk >= 2, --budget >= --block-size (siblings near the window's edge)",
          "swa-window-row-index", _stage(window=_window_by_row_index), all_of(has_window, has_branch),
          source="SGLang PR #39287"),
    Fault("swa-window-ignored", "the verify's sliding-window metadata is never filled: sliding layers attend to the "
          "whole prefix", "a sliding window shorter than the prompts (--sliding-window N or a windowed preset)",
          "swa-window-ignored", _stage(window=_window_ignored), has_window, source="SGLang #22679"),
)

# -- attention backend ------------------------------------------------------------

class _SinksFirstRowOnly:
    """The run's backend, but each request's sink logits reach its first verify row only: the other rows
    run the same kernel without sinks (TensorRT-LLM #15739 applied sinks to the first row's heads only)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name, self.mask_regions, self.graph_capturable = inner.name, inner.mask_regions, inner.graph_capturable

    def __getattr__(self, attr):   # precision, key_tiles, reads_max_kv_len: the kernel's own
        return getattr(self.inner, attr)

    def forward(self, q, k, v, layer, k_buffer, v_buffer, meta, layer_attn=PLAIN):
        with_sinks = self.inner.forward(q, k, v, layer, k_buffer, v_buffer, meta, layer_attn)
        if layer_attn.sinks is None:
            return with_sinks
        without = self.inner.forward(q, k, v, layer, k_buffer, v_buffer, meta, replace(layer_attn, sinks=None))
        first = torch.zeros(q.shape[0], dtype=torch.bool, device=q.device)   # [T] each request's row 0
        first[meta.qo_indptr[:-1].to(q.device)] = True
        return torch.where(first[:, None, None], with_sinks, without)


def _has_sinks(s, vocab: int) -> bool:
    """The model has attention sinks (a preset or checkpoint with self_attn.sinks tensors)."""
    from harness.engine.model.presets import model_config
    return model_config(s.model).attn_sinks


SINKS_FIRST_ROW_ONLY = Fault(
    "sinks-first-row-only", "the layer's sink logits are applied to the first verify row of each request only",
    "a model with attention sinks (--model tiny-sinks)", "sinks-first-row-only",
    lambda p: replace(p, attention=_SinksFirstRowOnly), _has_sinks, source="TensorRT-LLM #15739")


def _by_name(faults) -> dict[str, Fault]:
    out: dict[str, Fault] = {}
    for f in faults:
        if f.name in out:
            raise ValueError(f"fault {f.name!r} is in the catalog twice")
        out[f.name] = f
    return out


FAULTS: dict[str, Fault] = _by_name(CATALOG + (SINKS_FIRST_ROW_ONLY,) + TP_FAULTS + MLA_MOE_FAULTS)
