"""A stage proven guilty by replacing its output (issue 21 point 3), for the
first divergent verify step: the run is repeated deterministically (same
settings, seeds and pipeline) and, at that step only, one stage's output is
replaced by an independent correct one; the step is then judged against the
oracle as the run judged it. The first stage whose replacement makes the
step correct is the cause.

  committed KV    after the previous step's commit, every live request's
                  cache is rebuilt from its token ids: fresh slots, K/V
                  recomputed by a causal forward over the committed tokens,
                  req_to_token and the length set from the ids
  verify inputs   the step's verify batch laid out again from the trees,
                  the token ids and req_to_token (lengths from the ids,
                  visibility from each tree's ancestors), not by the stage
  graph           (graph runs) the whole run without the graph runner
  attention       the backend's attention of the step computed in float64
                  from the same q, k, v and metadata (engine/attn/exact.py),
                  over the cache rebuilt as above (an attention bug reaches
                  the step through every K/V its earlier forwards wrote)

A crash of the engine under test has its own rungs, each replacing a stage
from the start of the run: the tree by the oracle's own best-first build
from the same drafts, the mask by masks from each tree's ancestors, the
verify inputs by batches laid out from the trees and token ids (as above)
and the prefill's metadata by one laid out from the prompts' lengths and slots,
the graph replay by the eager forward (graph runs only), the attention kernel
by the float64 attention, the acceptance by the oracle's walk, the commit by
the cache rebuilt from the ids after each round, the model's forward by the
oracle's (crash_rungs.py), and where the engine raised inside a validator,
the run without that validator (harness/check/refusal.py); when the replaced
run reaches the crashed step and it matches the oracle, the replaced stage is
the one that crashed. A crash before there is an engine (at its import or
construction) is proven by the same run again in new processes, one stage
replaced from the start each (harness/check/from_start.py).

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Callable

import torch

from harness.check.compare.metrics import compare_rows, engine_block
from harness.check.localize.crash_rungs import accept_rung, kv_allocation_rung, model_rung
from harness.check.localize.memory_rungs import rebuild_committed, rebuilt_commit_throughout
from harness.check.prefill_layout import independent_prefill_metadata
from harness.check.refusal import refusal_stage, validator_skipped
from harness.engine.attn.exact import ArmedAttention
from harness.engine.attn.base import serving_of
from harness.engine.ddtree.tree import DraftTree
from harness.engine.ddtree.verify_inputs import AttnMetadata, VerifyBatch


@dataclass(frozen=True)
class Replacement:
    """One rung: which stage's output was replaced, by what, and the step's error before and after, as the
    largest error over its real rows relative to the bound it was judged at (> 1: a divergent row)."""

    stage: str                 # wrong.STAGE_WORDS' words (a refusal's validator: refusal.py's, "shared schema")
    replaced_by: str           # what stood in for its output
    step: int
    error_before: float | None   # None: the step crashed
    error_after: float | None    # None: the replaced run crashed or did not reach the step
    correct: bool                # the replaced step matches the oracle: this stage is the cause
    note: str = ""               # why it could not be judged, or what the rerun raised
    judged_at: int | None = None  # the step the replaced run was judged at where not `step`: the run ended after
                                  # step - 1 without raising (the crash was after the run's last step)

    def to_record(self) -> dict:
        return {"stage": self.stage, "replaced_by": self.replaced_by, "step": self.step,
                "error_before": self.error_before, "error_after": self.error_after, "correct": self.correct,
                "note": self.note, "judged_at": self.judged_at, "sentence": self.sentence()}

    def sentence(self) -> str:
        before = "crashed" if self.error_before is None else f"error {self.error_before:.3g}x its bound"
        after = (f"crashed or did not reach it ({self.note})" if self.error_after is None
                 else f"error {self.error_after:.3g}x its bound" + (f" ({self.note})" if self.note else ""))
        verdict = "correct: the cause" if self.correct else "still wrong"
        what = "committed KV (the commit's, or the emitted ids')" if self.stage == "commit" else self.stage
        return f"{what} replaced by {self.replaced_by}: step {self.step} {before} -> {after} ({verdict})"


def proven(found: list[Replacement]) -> Replacement | None:
    """The first rung (in pipeline order) whose replacement made the step correct."""
    return next((r for r in found if r.correct), None)


def prove_divergent_step(p, step: int) -> list[Replacement]:
    """The rungs for a step whose nodes diverged (p: the run's Prepared), at any page size (the rebuilt cache and
    batches go through req_to_token). Empty where the engine's layout is not one these replacements rebuild (a
    serving backend, MLA, --tp, a port)."""
    if not _replaceable(p, any_page_size=True):
        return []
    before = _judged_step(p, step, None)[0]
    # a cache the ids do not give is the commit's, or the emission's (the ids themselves): the bookkeeping audit
    # (localize/bookkeeping.py) tells those two apart, this rung only that the cache disagrees with the ids
    rungs = [("commit", "the cache rebuilt from the token ids", None, _rebuild_committed_kv),
             ("verify inputs", "a batch laid out from the trees and token ids", None, _independent_verify_inputs)]
    # the attention before the graph runner: the narrower replacement first (the eager forward replaces the
    # backend's graph-only path too, so a backend bug seen only under graphs would be the graph's)
    rungs.append(("attention", "a float64 softmax of the same inputs", None, _exact_attention_at_step))
    if p.settings.cuda_graph:   # the run without the graph runner: the same batches, forwarded eagerly
        rungs.append(("graph", "the eager forward", _eager, None))
    return _climb(p, step, before, rungs)


def prove_crash(p, step: int, refusal: str | None = None) -> list[Replacement]:
    """The crash rungs, each from the start of the run: the tree stage -> the oracle's own best-first build from
    the same drafts (reference/tree.py), the mask stage -> masks from each tree's ancestors, the
    verify-inputs stage -> batches laid out from the trees and token ids (the prefill's metadata from the prompts'
    lengths and slots), attention kernel -> float64, graph
    replay -> eager (graph runs only), the acceptance -> the oracle's walk over the engine's argmax, the commit ->
    each round's rows freed and every live request's cache rebuilt from its token ids, KV allocation -> the
    allocator and the row placement (memory_rungs.py), the model's forward -> the oracle's (crash_rungs.py). A
    crash upstream of the replaced stage crashes the replaced run too. At any page size. Last, where the crash was
    a validator's refusal (`refusal`: "module:Class", harness/check/refusal.py), the same run without that
    validator: a stage that handed it a wrong value had its rung above."""
    if not _replaceable(p, any_page_size=True):
        return []
    rungs = [("tree build", "the oracle's best-first build from the same drafts, budget + 1 wide", _oracle_tree, None),
             ("mask", "masks from each tree's ancestors", None, _independent_mask_throughout),
             ("verify inputs", "the prefill's metadata from the prompts' lengths and slots, batches laid out from the "
              "trees and token ids", None,
              _independent_verify_inputs_throughout)]
    rungs.append(("attention", "a float64 softmax of the same inputs", None, _exact_attention_throughout))
    if p.settings.cuda_graph:   # after the attention, as for a divergent step
        rungs.append(("graph", "the eager forward", _eager, None))
    rungs.append(accept_rung())   # before the commit: a bad acceptance the commit raises on is the acceptance's
    rungs.append(("commit", "the cache rebuilt from the token ids after each round", None, _rebuilt_commit_throughout))
    rungs.append(kv_allocation_rung())   # its own memory from the engine's construction (memory_start.py)
    rungs.append(model_rung())    # the widest replacement (crash_rungs.py says why)
    if refusal is not None:
        rungs.append(refusal_rung(refusal))
    return _climb(p, step, None, rungs, to_end=True)


def refusal_rung(spec: str) -> tuple:
    """The run without the validator of class `spec` ("module:Class"), put back after (harness/check/refusal.py)."""
    module, _, cls = spec.partition(":")
    return (refusal_stage(module), f"the same run without {cls}'s validator (its refusal then proven false)", None,
            None, lambda: validator_skipped(spec))


def _climb(p, step: int, before: float | None, rungs: list, to_end: bool = False) -> list[Replacement]:
    """Each rung (stage, what replaced it, base run, swap) in turn, up to the first whose replaced step is
    correct; before: the step's error as run (None: it crashed); to_end: as _judged_step's."""
    out = []
    for stage, what, base, swap, *around in rungs:   # around: a context the replaced run runs in
        with around[0]() if around else nullcontext():
            after, note, judged_at = _judged_step(p, step, swap, base, to_end)
        out.append(Replacement(stage, what, step, before, after, after is not None and after <= 1.0, note,
                               None if judged_at == step else judged_at))
        if out[-1].correct:
            break
    return out


def _replaceable(p, any_page_size: bool = False) -> bool:
    """The engine's layout is one the rungs rebuild: its own backend, one rank, no port, no MLA, and a token-slot
    pool unless `any_page_size` (the crash rungs: their caches go through req_to_token)."""
    s = p.settings
    return (serving_of(p.engine.kernel) is None and (s.page_size == 1 or any_page_size) and s.tp == 1
            and p.port is None and p.engine.cfg.mla is None)


# -- the rerun ---------------------------------------------------------------------------------------------------

def _judged_step(p, step: int, swap: Callable | None, base: Callable | None = None,
                 to_end: bool = False) -> tuple[float | None, str, int]:
    """A fresh engine run to `step` with `swap(prepared, step)` installed (it returns a hook called once the
    engine is built, or None); the step's error relative to its bound, or None and what stopped it; and the step
    judged. to_end (a crash after step - 1, the last step the crashed run produced): a replaced run that ends
    after step - 1 without raising, its requests retired, is judged at step - 1 (the engine raised after the
    run's last step, retiring them)."""
    from harness.check.prepare import derive
    last = None
    try:
        q = base(p) if base is not None else derive(p)
        hook = swap(q, step) if swap is not None else None
        if hook is not None:
            hook(q.engine)
        for result in q.engine.rounds():
            if result.step == step:
                return _step_error(q, result), "", step
            last = result
    except Exception as e:  # noqa: BLE001  (a rerun that raises proves nothing; it is said)
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}", step
    if to_end and last is not None and last.step == step - 1:
        return _step_error(q, last), f"the run ends after step {step - 1} without raising", step - 1
    return None, f"the run ended before step {step}", step


def _step_error(q, result) -> float:
    """max over the step's real rows of rel_err / bound (the run's tolerance, or its noise-floor bound);
    inf where a row or a padding row is not finite."""
    worst = 0.0
    vocab = q.engine.cfg.vocab_size
    for rs in result.requests:
        tree = rs.tree
        logits, _ = engine_block(rs.logits, tree.q_len, vocab)   # [q_len, vocab]
        parents = [-1] + [int(x) for x in tree.parents[1:]]
        ref = q.oracle.tree_logits(list(rs.prefix), list(tree.tokens), parents)   # [num_rows, vocab] float64
        real = tree.num_rows
        bounds = _bounds(q, rs, ref, parents)
        for m, bound in zip(compare_rows(logits[:real], ref[:real]), bounds):
            worst = max(worst, m.rel_err / bound if m.finite else float("inf"))
        if not bool(torch.isfinite(logits[real:]).all()):
            worst = float("inf")
    return worst


def _bounds(q, rs, ref: torch.Tensor, parents: list[int]) -> list[float]:
    real = rs.tree.num_rows
    if q.rule is None:
        return [q.tolerance] * real
    twin = q.twin.tree_logits(rs.prefix, rs.tree)
    rounded = q.oracle.rounded_tree_logits(list(rs.prefix), list(rs.tree.tokens), parents, q.settings.dtype,
                                           q.rounded_probabilities)
    return [q.rule.bound(t.rel_err, r.rel_err) for t, r in zip(compare_rows(twin[:real], ref[:real]),
                                                               compare_rows(rounded[:real], ref[:real]))]


# -- committed KV --------------------------------------------------------------------------------------------------

def _rebuild_committed_kv(q, step: int):
    """Once the commit before `step` is done (the prefill's, for step 0), every live request's committed
    state is rebuilt from its token ids."""
    def install(engine) -> None:
        if step == 0:
            prefill = engine.prefill

            def prefill_then_rebuild() -> None:
                prefill()
                rebuild_committed(engine)
            engine.prefill = prefill_then_rebuild
            return
        rounds = engine.rounds

        def rebuilt_before(target=step):
            for result in rounds():
                yield result
                if result.step == target - 1:
                    rebuild_committed(engine)
        engine.rounds = rebuilt_before
    return install


def _rebuilt_commit_throughout(q, step: int):
    """The commit stage replaced from the start, at any page size: the round's rows freed, the accepted ones on
    fresh slots, the cache rebuilt from the token ids after each round (memory_rungs.rebuilt_commit_throughout)."""
    return rebuilt_commit_throughout(q, step)


# -- verify inputs -------------------------------------------------------------------------------------------------

def _oracle_tree(q):
    """q's setting with its tree stage replaced, the verify width included: each round's trees are the oracle's
    own best-first build from the same drafts (reference/tree.py), budget + 1 rows wide (the root and `budget`
    draft nodes, padded)."""
    from harness.check.prepare import derive
    oracle = q.oracle

    def build_tree(root: int, draft_logprobs, budget: int, topk: int) -> DraftTree:
        ref = oracle.draft_tree(int(root), draft_logprobs, budget, topk)
        return DraftTree(tuple(ref.tokens), (None, *ref.parents[1:]), tuple(ref.depths), budget + 1)
    pipeline = replace(q.engine.pipeline, build_tree=build_tree, width=lambda budget: budget + 1)
    return derive(q, q.settings, tuple(q.prompts), pipeline)


def _independent_mask_throughout(q, step: int):
    def install(engine) -> None:
        engine.pipeline = replace(engine.pipeline, build_mask=independent_mask)
    return install


def _independent_verify_inputs_throughout(q, step: int):
    """Every round's verify batch, and the prefill's metadata before them, laid out independently (the prefill's
    from the prompts' lengths and slots: harness/check/prefill_layout.py)."""
    def install(engine) -> None:
        engine.pipeline = replace(engine.pipeline, prefill_metadata=independent_prefill_metadata,
                                  build_verify_batch=lambda *args: independent_batch(engine, *args))
    return install


def visibility_block(tree: DraftTree, prefix_len: int) -> torch.Tensor:
    """One request's rows over its prefix and its tree  # [q_len, prefix_len + q_len] bool: every row sees the
    prefix, a real row its ancestors and itself (DraftTree.ancestors), a padding row its own column."""
    q_len = tree.q_len
    block = torch.zeros((q_len, prefix_len + q_len), dtype=torch.bool)
    block[:, :prefix_len] = True
    for row in range(q_len):
        cols = tree.ancestors(row) if row < tree.num_rows else [row]
        block[row, [prefix_len + c for c in cols]] = True
    return block


def independent_mask(trees: list[DraftTree], prefix_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The mask stage's output from the same trees and prefix lengths, by visibility_block:
    custom_mask  # [sum_b q_len*(prefix_b+q_len)] flat bool; mask_indptr  # [bs+1]"""
    blocks = [visibility_block(t, int(n)).reshape(-1) for t, n in zip(trees, prefix_lens)]
    sizes = torch.tensor([0] + [b.numel() for b in blocks], dtype=torch.int64)
    return torch.cat(blocks), sizes.cumsum(0)


def _independent_verify_inputs(q, step: int):
    def install(engine) -> None:
        _at_step(engine, step, lambda own, *args: independent_batch(engine, *args))
    return install


def independent_batch(engine, trees: list[DraftTree], seq_lens, req_pool_indices, req_to_token,
                      out_cache_loc, mask_builder=None) -> VerifyBatch:
    """The verify batch from the trees and the token ids alone: each request's length is its committed
    tokens' count, its keys req_to_token's first that many slots, its rows see the prefix and their
    ancestors (a padding row its own column), rows carry the tree's tokens at prefix + depth."""
    by_idx = {r.req_pool_idx: r for r in engine.requests if not r.finished}
    lens = [len(by_idx[int(i)].committed_tokens()) for i in req_pool_indices]
    q_len = trees[0].q_len
    ids, pos = [], []
    for tree, n in zip(trees, lens):
        pad = tree.q_len - tree.num_rows
        ids += list(tree.tokens) + [tree.tokens[0]] * pad
        pos += [n + d for d in tree.depths] + [n] * pad
    custom_mask, mask_indptr = independent_mask(trees, lens)
    kv = [req_to_token[int(i), :n].cpu() for i, n in zip(req_pool_indices, lens)]
    attn = AttnMetadata(qo_indptr=torch.arange(0, (len(trees) + 1) * q_len, q_len, dtype=torch.int64),
                        kv_indptr=torch.tensor([0] + lens, dtype=torch.int64).cumsum(0),
                        kv_indices=torch.cat(kv).to(torch.int64), out_cache_loc=out_cache_loc,
                        custom_mask=custom_mask, mask_indptr=mask_indptr, max_len_extend=q_len)
    return VerifyBatch(torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64),
                       torch.tensor(lens, dtype=torch.int64), torch.tensor(list(map(int, req_pool_indices))),
                       attn, q_len)


def _at_step(engine, step: int, build: Callable) -> None:
    """The pipeline's verify-inputs stage, its call of round `step` (one call per round) handed to
    build(own stage, *its arguments)."""
    own, calls = engine.pipeline.build_verify_batch, [0]

    def stage(*args):
        calls[0] += 1
        return build(own, *args) if calls[0] - 1 == step else own(*args)
    engine.pipeline = replace(engine.pipeline, build_verify_batch=stage)


# -- attention -----------------------------------------------------------------------------------------------------

def _exact_attention_throughout(q, step: int):
    def install(engine) -> None:
        engine.backend = ArmedAttention(engine.backend, armed=True)
    return install


def _exact_attention_at_step(q, step: int):
    """The step's attention, and the cache it reads (rebuilt as the commit rung rebuilds it), in float64: an
    attention bug reaches the step through every K/V its earlier forwards wrote."""
    rebuild = _rebuild_committed_kv(q, step)

    def install(engine) -> None:
        rebuild(engine)
        armed = ArmedAttention(engine.backend)
        engine.backend = armed

        def arm(own, *args):
            armed.armed = True
            return own(*args)
        _at_step(engine, step, arm)
    return install


def _eager(q):
    """q's setting without the graph runner."""
    from harness.check.prepare import derive
    return derive(q, replace(q.settings, cuda_graph=False), tuple(q.prompts), q.engine.pipeline)
