"""`ddtree-utils`: the `ddtree_utils.py` lineage (SGLang PR #27509, the
Rancy-Wang/sglang ddtree branches, PR #29907).

Functions driven (names and signatures are public facts of that file):
- build_ddtree_tree(draft_logits | None, tree_budget, device, [_out_* buffers],
  [draft_top_log_probs, draft_top_token_ids] [bs, L, K], ...) ->
  (node_token_ids [bs, B] 0-padded, node_depths [bs, B], parents [bs, B+1] -1 for
  the root and padding, child_maps, visibility [bs, B+1, B+1],
  [actual_tree_sizes [bs] root included, actual_sizes list]);
- compile_ddtree_tree(root_token_ids, node_token_ids, node_depths, visibility,
  start_positions, past_lengths, tree_budget, [actual_tree_sizes], device, ...)
  -> (input_ids [bs, q], positions [bs, q], flat allow-mask, ...);
- follow_verified_tree(child_maps, posterior_tokens [bs, q]) ->
  (accepted indices per request, root first; next tokens [bs], ...);
- compact_ddtree_kv_cache(kv_cache_pool, layer, cache_locs [bs, q], keep_indices,
  past_lengths, actual_tree_sizes), per layer: moves the kept rows' K/V to the
  request's first verify slots; the worker then points req_to_token at
  cache_locs[b, :n] and frees the rest (done here as the worker does).

Older versions take logits instead of top-K inputs, or return no
actual_tree_sizes; the adapter reads which by parameter names and output
arity. It translates and never repairs: a tree it reads back is the port's.


Layer: ports. Imports the engine and below; never faults, check, report, workflows or cli."""
from __future__ import annotations

from pathlib import Path

import torch

from harness.ports.loading import load_port_module, parameters, require
from harness.ports.protocol import BuiltTrees, CommitResult, CompiledVerify, Conventions, PortError, PortMask
from harness.ports.registry import Family, find_in_checkout
from harness.ports.worker_calls import worker_calls
from harness.engine.ddtree.accept import Acceptance
from harness.engine.ddtree.tree import DraftTree

IN_CHECKOUT = ("python/sglang/srt/speculative/ddtree_utils.py", "sglang/srt/speculative/ddtree_utils.py")

CONVENTIONS = Conventions(
    family="ddtree-utils",
    summary="ddtree_utils.py (SGLang PR #27509, Rancy-Wang/sglang ddtree branches, PR #29907): build_ddtree_tree, "
            "compile_ddtree_tree, follow_verified_tree, compact_ddtree_kv_cache",
    budget_counts_root=False,
    topk_rule="K = the last dim of draft_top_log_probs (the run's --topk); logits versions: min(budget, vocab)",
    padding="token 0 at position prefix (depth 0), parent -1; each padding row sees only its own diagonal",
    mask="bool, flat per-request [q, prefix+q] blocks (first versions: a float [bs, q, max_prefix+q] "
         "rectangle, an additive 0 / -max bias, then 1.0 / 0.0); handed to the kernel as is (nonzero = visible)",
    stages=("build", "compile", "accept", "commit"),
    padding_token="zero", padding_position="prefix",
    functions=("build_ddtree_tree", "compile_ddtree_tree", "follow_verified_tree", "compact_ddtree_kv_cache"),
    stage_functions=(("build", "build_ddtree_tree"), ("compile", "compile_ddtree_tree"),
                     ("accept", "follow_verified_tree"), ("commit", "compact_ddtree_kv_cache")),
)


class _Layer:
    """What SGLang hands as `layer`: an object with layer_id."""

    def __init__(self, layer_id: int) -> None:
        self.layer_id = layer_id


def native_tree(trees: list[DraftTree], budget: int):
    """ddcheck's trees in the lineage's arrays: node_token_ids, node_depths [bs, B],
    parents [bs, B+1] (-1 root and padding), visibility [bs, B+1, B+1], actual sizes [bs]."""
    bs, q = len(trees), budget + 1
    ids = torch.zeros(bs, budget, dtype=torch.long)
    depths = torch.zeros(bs, budget, dtype=torch.long)
    parents = torch.full((bs, q), -1, dtype=torch.long)
    vis = torch.zeros(bs, q, q, dtype=torch.bool)
    for b, t in enumerate(trees):
        n = t.num_rows
        ids[b, :n - 1] = torch.tensor(t.tokens[1:], dtype=torch.long)
        depths[b, :n - 1] = torch.tensor(t.depths[1:], dtype=torch.long)
        parents[b, 1:n] = torch.tensor(t.parents[1:], dtype=torch.long)
        for i in range(n):
            vis[b, i, t.ancestors(i)] = True
    return ids, depths, parents, vis, torch.tensor([t.num_rows for t in trees], dtype=torch.long)


class DDTreeUtils:
    conventions = CONVENTIONS

    def __init__(self, path: Path) -> None:
        loaded = load_port_module(find_in_checkout(path, IN_CHECKOUT))
        self.path, self.mod, self.stubbed = loaded.path, loaded.module, loaded.stubbed
        self.worker = worker_calls(self.path)   # what the checkout's worker side calls (None: no worker beside it)
        # the dtype the worker hands a compile that takes one (the model's: the seed's worker passed
        # torch.bfloat16); attach_port sets the run's
        self.model_dtype = torch.float32
        self.fn_build, self.fn_compile, self.fn_follow = require(
            self.mod, self.path, "build_ddtree_tree", "compile_ddtree_tree", "follow_verified_tree")
        self.fn_compact = getattr(self.mod, "compact_ddtree_kv_cache", None)
        self.build_params = parameters(self.fn_build)
        self.compile_params = parameters(self.fn_compile)

    # -- build ---------------------------------------------------------------------
    def build(self, topk_logprobs, topk_ids, roots, budget, draft_logprobs=None) -> BuiltTrees:
        if "draft_top_log_probs" in self.build_params:
            out = self.fn_build(None, budget, torch.device("cpu"), draft_top_log_probs=topk_logprobs.float(),
                                draft_top_token_ids=topk_ids.long())
        else:   # a logits version: the whole draft distribution (it picks its own K)
            if draft_logprobs is None:
                raise PortError(f"{self.path}: this build_ddtree_tree takes logits; the caller gave only top-K")
            out = self.fn_build(draft_logprobs.float(), budget, torch.device("cpu"))
        if not isinstance(out, tuple) or len(out) < 5:
            raise PortError(f"{self.path}: build_ddtree_tree returned {type(out).__name__}; the adapter knows the "
                            "5-tuple and 7-tuple versions")
        node_ids, node_depths, parents = (x.cpu() for x in out[:3])
        actual = (out[5].cpu().tolist() if len(out) >= 6 and torch.is_tensor(out[5])
                  else [int((parents[b, 1:] >= 0).sum()) + 1 for b in range(len(roots))])
        trees = []
        for b, root in enumerate(roots):
            n = int(actual[b])
            trees.append(DraftTree((int(root),) + tuple(node_ids[b, :n - 1].tolist()),
                                   (None,) + tuple(int(p) for p in parents[b, 1:n].tolist()),
                                   (0,) + tuple(node_depths[b, :n - 1].tolist()), q_len=budget + 1))
        return BuiltTrees(tuple(trees), {"child_maps": out[3]})

    # -- compile ---------------------------------------------------------------------
    def compile(self, trees, prefix_lens) -> CompiledVerify:
        q = trees[0].q_len
        budget = q - 1
        ids, depths, _, vis, actual = native_tree(trees, budget)
        past = torch.tensor(prefix_lens, dtype=torch.long)
        roots = torch.tensor([t.tokens[0] for t in trees], dtype=torch.long)
        args = dict(root_token_ids=roots, node_token_ids=ids, node_depths=depths, visibility=vis,
                    start_positions=past.clone(), past_lengths=past, tree_budget=budget,
                    actual_tree_sizes=actual, device=torch.device("cpu"), past_lens_cpu=list(prefix_lens),
                    actual_sizes_cpu=actual.tolist(), build_attention_mask=True, dtype=self.model_dtype)
        unknown = [p for p in self.compile_params[:6] if p not in args]
        if unknown:
            raise PortError(f"{self.path}: compile_ddtree_tree takes {', '.join(unknown)}, which no version this "
                            "adapter knows takes")
        out = self.fn_compile(**{k: v for k, v in args.items() if k in self.compile_params})
        input_ids, positions, mask = out[0], out[1], out[2]
        if mask is None:
            raise PortError(f"{self.path}: compile_ddtree_tree built no mask with build_attention_mask=True")
        # as the port laid it out, dtype and values untouched; the kernel reads it flat, nonzero = visible
        layout = "rectangle" if mask.dim() == 3 else "flat"
        return CompiledVerify(input_ids.reshape(-1), positions.reshape(-1), PortMask(mask, layout))

    # -- accept ----------------------------------------------------------------------
    def child_maps(self, trees: list[DraftTree]):
        """The port's own child-map builder when the file has one; else the lineage's
        {parent: {token: child}} shape, built from the tree."""
        own = getattr(self.mod, "build_child_maps_from_parent_metadata", None)
        tokens = [list(t.tokens) for t in trees]
        parents = [[-1] + list(t.parents[1:]) for t in trees]
        if callable(own):
            return own(tokens, parents, [t.num_rows for t in trees])
        maps = []
        for tok, par in zip(tokens, parents):
            m = {i: {} for i in range(len(tok))}
            for i in range(1, len(tok)):
                m[par[i]][tok[i]] = i
            maps.append(m)
        return maps

    def accept(self, trees, target_argmax) -> list[Acceptance]:
        out = self.fn_follow(self.child_maps(list(trees)), target_argmax)
        accepted, bonus = out[0], out[1]
        return [Acceptance(tuple(int(i) for i in rows), int(bonus[b]))
                for b, rows in enumerate(accepted)]

    # -- commit ----------------------------------------------------------------------
    def commit(self, trees, acceptances, state) -> CommitResult:
        if self.fn_compact is None:
            raise PortError(f"{self.path}: no compact_ddtree_kv_cache() (needed for --port-stages commit)")
        q, bs = trees[0].q_len, len(trees)
        locs = state.out_cache_loc.reshape(bs, q)
        keep = [list(a.rows) for a in acceptances]
        actual = torch.tensor([t.num_rows for t in trees], dtype=torch.long)
        for layer in range(state.token_to_kv_pool.layer_num):
            self.fn_compact(state.token_to_kv_pool, _Layer(layer), locs.to(state.token_to_kv_pool.get_key_buffer(0).device),
                            keep, state.seq_lens, actual)
        # the worker's bookkeeping after compaction: the first n verify slots hold the kept rows
        table = state.req_to_token_pool.req_to_token
        new_lens = []
        for b, (idx, prefix) in enumerate(zip(state.req_pool_indices.tolist(), state.seq_lens.tolist())):
            n = len(keep[b])
            table[idx, prefix:prefix + n] = locs[b, :n].to(table.device)
            state.token_to_kv_pool_allocator.free(locs[b, n:])
            new_lens.append(prefix + n)
        return CommitResult(tuple(new_lens))


FAMILY = Family("ddtree-utils", lambda path: DDTreeUtils(path), describe=lambda: CONVENTIONS)
