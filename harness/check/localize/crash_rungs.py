"""Three crash rungs of stage_swap.prove_crash (issue 21), each replacing a stage from the start of the run:

  accept   every request's acceptance by the oracle's own greedy walk (reference/accept.py, through the
           oracle's `acceptance`) over that request's own rows of the engine's argmax, and the acceptor
           cross-checked beside it switched off: a walk that raises, returns no acceptance (the commit then
           raises on it), or slices another request's rows is no longer run
  model    the target model's forward by the oracle's float64 forward from the token ids and each request's
           tree: a prefill's (or an extend from position 0's) last row per sequence is the oracle's logits of
           that sequence, a verify row the oracle's tree logits of its request's committed tokens; padding rows
           and the rows nobody reads are zero (finite). The engine's own forward still runs first, for its K/V
           writes and reads: a raise of the model's own code (crash.CRASH_STAGES' "model", llama.py) is set
           aside, any other raise stands, and a replaced run in which the model's code never raised proves
           nothing (the rung claims only that the model's own code is what raised)
  KV allocation  the engine built with a KV memory of the rung's own (memory_start.py: its pool, ledger and
           req_to_token table sized from the settings and the prompts), then the allocator, the row placement and
           the commit replaced (memory_rungs.strict_allocation_throughout)

Why the model rung is last, after the commit: it replaces the widest thing (every forward, so every attention
call and every K/V the forward would have used), so each narrower rung gets its chance first; and the stages
after the forward (accept, commit) are not touched by it, so their crashes stand under it. A graph run's model
rung runs eagerly: the graph rung before it has already shown that the eager forward alone does not help.

Limits: the self drafter's early-exit model (built from the same code) is not replaced; under the noise-floor
verdict the judge's twin runs the model's own code, so a crash there leaves the step unjudged (the note says so).

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from harness.check.crash import attribute, crash_stage
from harness.check.localize.memory_rungs import strict_allocation_throughout
from harness.check.localize.memory_start import own_kv_memory
from harness.engine.ddtree.tree import DraftTree

ACCEPT_REPLACED_BY = ("the oracle's greedy walk over each request's own rows of the engine's argmax, from the start "
                      "(the cross-checked acceptor off)")
MODEL_REPLACED_BY = ("the oracle's float64 forward from the token ids and each request's tree, from the start (the "
                     "engine's own forward still run for its K/V traffic, only a raise of the model's own code set "
                     "aside)")


@dataclass(frozen=True)
class WalkedAcceptance:
    """The accept rung's acceptance, in the engine's Acceptance's shape (rows, bonus) but none of its code."""

    rows: tuple[int, ...]   # accepted rows, root first
    bonus: int              # the engine's argmax at the last accepted row

    @property
    def num_committed(self) -> int:
        return len(self.rows)


def walked_acceptance(oracle, tree: DraftTree, predicts: list[int], vocab: int) -> WalkedAcceptance:
    """The oracle's greedy walk over `tree` whose row i's argmax is predicts[i]
    (predicts  # [q_len] the engine's argmax of the request's own rows; padding rows never read)."""
    n = tree.num_rows
    onehot = torch.zeros((n, vocab), dtype=torch.float64)   # [num_rows, vocab]: 1 at each row's argmax
    onehot[torch.arange(n), torch.tensor(predicts[:n], dtype=torch.int64)] = 1.0
    ref = oracle.acceptance(list(tree.tokens), tree_parents(tree), onehot)
    return WalkedAcceptance(tuple(int(r) for r in ref.rows), int(ref.bonus))


def tree_parents(tree: DraftTree) -> list[int]:
    """The oracle's parent list: -1 for the root."""
    return [-1] + [int(x) for x in tree.parents[1:]]


def accept_rung() -> tuple:
    """(stage, what replaced it, base run, swap) for stage_swap's ladder."""
    return ("accept", ACCEPT_REPLACED_BY, None, _walked_acceptance_throughout)


def _walked_acceptance_throughout(q, step: int):
    oracle, vocab = q.oracle, q.engine.cfg.vocab_size

    def install(engine) -> None:
        # set once built: the engine's `pipeline` setter chooses accept_request again (none runs after this)
        def accept_request(tree: DraftTree, predicts: list[int], b: int, trees: list[DraftTree]) -> WalkedAcceptance:
            return walked_acceptance(oracle, tree, predicts[b * tree.q_len:(b + 1) * tree.q_len], vocab)
        engine.accept_request = accept_request
        engine.cross_accept = None
    return install


# -- KV allocation -------------------------------------------------------------------------------------------------

KV_ALLOCATION_REPLACED_BY = ("a KV pool, a strict token-slot allocator and a req_to_token table of its own, sized from "
                             "the settings and the prompts (every row on a fresh slot, the cache rebuilt from the "
                             "token ids after each round)")


def kv_allocation_rung() -> tuple:
    return ("KV allocation", KV_ALLOCATION_REPLACED_BY, derived_with_own_memory, strict_allocation_throughout)


def derived_with_own_memory(p):
    """A fresh engine of p's run (prepare.derive) built with memory_start's memory: the KV allocation rung's run,
    strict_allocation_throughout installed on it after."""
    from harness.check.prepare import derive
    with own_kv_memory(p.settings, p.prompt_ids):
        return derive(p)


# -- the model -----------------------------------------------------------------------------------------------------

def model_rung() -> tuple:
    return ("model", MODEL_REPLACED_BY, None, _oracle_forward_throughout)


class ModelNeverRaised(RuntimeError):
    """The model rung's replaced run reached the step without the model's own code raising: it proves nothing."""


class OracleForward:
    """The engine's model with `forward` answered by the oracle (the module docstring says how); every other
    attribute is the engine's model's. `round`: the trees and their requests' pool indices the verify inputs were
    last asked for (the verify forward that follows is theirs)."""

    def __init__(self, model, oracle, engine) -> None:
        self.own, self.oracle, self.engine = model, oracle, engine
        self.round: tuple[tuple[DraftTree, ...], tuple[int, ...]] = ((), ())
        self.set_aside: list[str] = []   # the model's own raises, as crash sentences

    def __getattr__(self, name):
        return getattr(self.own, name)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, pool, backend,
                hidden_out: list | None = None, logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions  # [T]; returns logits  # [T, vocab] float32 ([R, vocab] with logit_rows)."""
        if hidden_out is not None:
            raise ValueError("the oracle's forward stands in for the logits only, not the residual stream")
        try:
            self.own.forward(input_ids, positions, meta, pool, backend)
        except Exception as e:  # noqa: BLE001  (only the model's own raise is set aside; any other stands)
            crash = attribute(e)
            if crash_stage(crash) != "model":
                raise
            self.set_aside.append(crash.sentence())
        ids, pos = input_ids.cpu().tolist(), positions.cpu().tolist()
        rows = self._verify(ids) if meta.custom_mask is not None else self._extend(ids, pos, meta)
        logits = torch.stack(rows).to(device=input_ids.device, dtype=torch.float32)   # [T, vocab]
        return logits if logit_rows is None else logits[logit_rows]

    def _extend(self, ids: list[int], pos: list[int], meta) -> list[torch.Tensor]:
        """Causal extends from position 0 (a prefill, the greedy continuation, a rebuilt cache): each
        sequence's last row the oracle's logits of the whole sequence; the rows before it zero."""
        vocab = self.engine.cfg.vocab_size
        rows = [torch.zeros(vocab, dtype=torch.float64) for _ in ids]   # each [vocab]
        bounds = meta.qo_indptr.tolist()
        for a, b in zip(bounds, bounds[1:]):
            if b == a:
                continue
            if pos[a:b] != list(range(b - a)) or b - a < 2:
                raise ValueError("the oracle's forward stands in for extends of 2+ tokens from position 0 only")
            rows[b - 1] = self.oracle.tree_logits(ids[a:b - 1], [ids[b - 1]], [-1])[0]
        return rows

    def _verify(self, ids: list[int]) -> list[torch.Tensor]:
        """Each request's rows: its tree's logits from its committed tokens; padding rows zero."""
        trees, pool_indices = self.round
        q_len = trees[0].q_len if trees else 0
        if len(ids) != len(trees) * q_len:
            raise ValueError(f"a verify of {len(ids)} rows; the round's {len(trees)} trees have {q_len} each")
        live = {r.req_pool_idx: r for r in self.engine.requests if not r.finished}
        vocab = self.engine.cfg.vocab_size
        rows = [torch.zeros(vocab, dtype=torch.float64) for _ in ids]   # each [vocab]
        for b, (tree, idx) in enumerate(zip(trees, pool_indices)):
            ref = self.oracle.tree_logits(live[idx].committed_tokens(), list(tree.tokens), tree_parents(tree))
            rows[b * q_len:b * q_len + tree.num_rows] = list(ref)   # [num_rows, vocab] float64
        return rows


def _oracle_forward_throughout(q, step: int):
    oracle = q.oracle

    def install(engine) -> None:
        model = OracleForward(engine.model, oracle, engine)
        build = engine.pipeline.build_verify_batch

        def recorded(trees, seq_lens, req_pool_indices, *rest):
            model.round = (tuple(trees), tuple(int(i) for i in req_pool_indices))
            return build(trees, seq_lens, req_pool_indices, *rest)
        engine.pipeline = replace(engine.pipeline, build_verify_batch=recorded)   # before the model is swapped:
        engine.model = model                                                     # the setter sets model.stages
        engine.graph = None   # the eager forward: a graph replay would replay the engine's captured forward
        rounds = engine.rounds

        def only_where_the_model_raised():
            for result in rounds():
                if result.step == step and not model.set_aside:
                    raise ModelNeverRaised(f"the model's own code never raised up to step {step}")
                yield result
            if not model.set_aside:   # a run judged at its end (a crash after its last step, stage_swap's to_end)
                raise ModelNeverRaised("the model's own code never raised in the whole run")
        engine.rounds = only_where_the_model_raised
    return install
