"""The engine's tree and acceptance against the oracle's own (reference/tree.py,
reference/accept.py, reached through the Oracle protocol): a tree a node
short, or a walk that stops early, loses speed without changing the output,
so the per-node and stream checks cannot see it.

* tree (record kind `tree`): only when the pipeline declares its tree builder
  to be DDTree best-first (`Pipeline.tree_builder == "ddtree-best-first"`)
  and the step carries its draft log-probs: the engine's draft nodes, as
  token paths, against the oracle's best-first build from the same drafts
  with the run's budget and topk. Row order is not judged (the per-node
  check catches a misordered layout). A difference that only swaps prefixes
  whose scores equal the oracle's cut score (1e-9) is a near tie; so is one
  that keeps another of the tokens tied at a depth's top-k threshold (equal
  draft log-probs: which of them a top-k drops is unspecified), once those
  tokens are swapped back.
* acceptance (record kind `accept-ref`, always on): the engine's accepted rows
  and bonus against the oracle's greedy walk over the engine's tree with the
  oracle's float64 logits. Where they part, the oracle's top-1 minus top-2 gap
  at that row within 2 x tolerance x max |ref| of the row is a near tie.


Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass

import torch

DDTREE = "ddtree-best-first"
SCORE_TIE = 1e-9


@dataclass(frozen=True)
class Verdict:
    """One tree or acceptance comparison that did not simply match."""

    record: dict     # the `tree` / `accept-ref` record
    diverged: bool   # False: a near tie
    sentence: str    # for the summary's explanation


def _path_score(path: tuple[int, ...], draft_logprobs: torch.Tensor, topk: int) -> float | None:
    """Summed draft log-prob of a token path, None if a token is outside its depth's top-k."""
    total = 0.0
    for depth, tok in enumerate(path):
        if depth >= draft_logprobs.shape[0]:
            return None
        lp = draft_logprobs[depth].double()  # [vocab]
        if int((lp > lp[tok]).sum()) >= topk:
            return None
        total += float(lp[tok])
    return total


def _engine_paths(tree) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []
    for row in range(tree.num_rows):
        parent = tree.parents[row]
        out.append(() if parent is None else out[parent] + (int(tree.tokens[row]),))
    return out


def _threshold_swaps(draft_logprobs: torch.Tensor, topk: int, want, got) -> list[dict[int, int]]:
    """Per depth, the engine's tokens -> the oracle's where the two trees kept different tokens of a depth's
    top-k that tie with that depth's k-th largest draft log-prob (within SCORE_TIE): a top-k that must drop
    one of equal candidates may drop either (torch.topk's order among equal values is unspecified; the
    oracle's rule keeps the lower id). Tokens kept by one tree only for another reason (a tie at the cut
    score takes another path there) are left as they are, for the cut-score test: a depth may hold both
    (drafts of a bf16 model tie often; issue 22's 8B run). Swapped tokens carry equal log-probs, so every
    path's score is kept."""
    swaps = []
    for depth in range(int(draft_logprobs.shape[0])):
        eng = {p[depth] for p in got if len(p) > depth}
        ref = {p[depth] for p in want if len(p) > depth}
        lp = draft_logprobs[depth].double()  # [vocab]
        kth = float(torch.topk(lp, min(topk, lp.numel())).values[-1])
        tied = [sorted(t for t in odd if abs(float(lp[t]) - kth) <= SCORE_TIE) for odd in (eng - ref, ref - eng)]
        swaps.append(dict(zip(*tied)))
    return swaps


def check_tree(rs, oracle, budget: int, topk: int, setting: str) -> Verdict | None:
    ref = oracle.draft_tree(int(rs.tree.tokens[0]), rs.draft_logprobs, budget, topk)
    want, got = ref.paths()[1:], _engine_paths(rs.tree)[1:]
    missing = [p for p in want if p not in set(got)]
    extra = [p for p in got if p not in set(want)]
    if not missing and not extra and len(want) == len(got):
        return None
    swaps = _threshold_swaps(rs.draft_logprobs, topk, want, got)
    swapped = [tuple(swaps[d].get(t, t) for d, t in enumerate(p)) for p in got]
    left = [p for p in want if p not in set(swapped)] + [p for p in swapped if p not in set(want)]
    cut = min(ref.scores[1:], default=0.0)
    scores = [_path_score(p, rs.draft_logprobs, topk) for p in left]
    tie = len(want) == len(got) and all(s is not None and abs(s - cut) <= SCORE_TIE for s in scores)
    sentence = (f"step {rs.step}, request {rs.rid}: the engine's tree has {len(got)} draft nodes, DDTree's "
                f"best-first build from the same drafts (budget {budget}, topk {topk}) has {len(want)}; "
                f"missing {_show(missing[:3])}, extra {_show(extra[:3])}")
    record = {"kind": "tree", "setting": setting, "step": rs.step, "request": rs.rid,
              "engine_nodes": len(got), "reference_nodes": len(want),
              "missing": [list(p) for p in missing], "extra": [list(p) for p in extra],
              "cut_score": cut, "verdict": "near-tie" if tie else "diverge",
              "threshold_ties": [[d + 1, e, r] for d, sw in enumerate(swaps) for e, r in sw.items()]}
    return Verdict(record, not tie, sentence)


def _show(paths: list[tuple[int, ...]]) -> str:
    return "none" if not paths else ", ".join(f"depth {len(p)} path {list(p)}" for p in paths)


def check_acceptance(rs, ref_logits: torch.Tensor, oracle, tol: float, setting: str,
                     eos_id: int | None = None) -> Verdict | None:
    """ref_logits  # [num_rows, vocab] float64, the oracle's logits of the engine's tree.
    eos_id: the oracle's walk ends at an accepted row of that token, which becomes the bonus."""
    parents = [-1] + [int(x) for x in rs.tree.parents[1:]]
    ref = oracle.acceptance(list(rs.tree.tokens), parents, ref_logits)
    got, want, want_bonus = list(rs.acceptance.rows), list(ref.rows), ref.bonus
    stop = next((j for j in range(1, len(want)) if rs.tree.tokens[want[j]] == eos_id), None)
    if eos_id is not None and stop is not None:
        want, want_bonus = want[:stop], eos_id
    if got == want and rs.acceptance.bonus == want_bonus:
        return None
    common = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    row = want[common - 1]  # the last row both walks reached: where they decided differently
    gap = ref.gaps[common - 1]
    band = 2 * tol * max(float(ref_logits[row].abs().max()), 1.0)
    tie = gap <= band
    how = ("goes on past the end-of-sequence token" if stop is not None and len(got) > len(want)
           and want == got[:len(want)] else
           "stops early" if len(got) < len(want) and got == want[:len(got)] else
           "walks too far" if len(got) > len(want) and want == got[:len(want)] else
           "takes another bonus" if got == want else "takes another branch")
    sentence = (f"step {rs.step}, request {rs.rid}: the engine's walk {how} at row {row}: it accepts rows {got} "
                f"(bonus {rs.acceptance.bonus}), the oracle's greedy walk over the same tree accepts {want} "
                f"(bonus {want_bonus}); the oracle's top-2 gap there is {gap:.3g}")
    record = {"kind": "accept-ref", "setting": setting, "step": rs.step, "request": rs.rid,
              "engine_rows": got, "reference_rows": want, "engine_bonus": rs.acceptance.bonus,
              "reference_bonus": want_bonus, "row": row, "ref_gap": gap, "tie_band": band,
              "verdict": "near-tie" if tie else "diverge"}
    return Verdict(record, not tie, sentence)
