"""Does a calibrated noise rule still see the weakest bugs? `ddcheck calibrate`
runs the one-key leaks (harness/faults/one_key.py: one sibling visible, one
ancestor hidden, the last real row seeing one padding column) on the case's
own low-precision settings under the rule it is about to write, and reports,
per dtype and leak, whether the run failed and by which test.

Why: a calibrated multiplier is 1.25x the largest fault-free ratio measured
on the user's model. On SmolLM2-135M in bf16 the last-row-sees-one-padding
leak sits at ratios 0.8 to 2.4 (benchmarks/results/verdict-study-h200-leaks
.json), inside that model's fault-free tail: no multiplier both passes the
correct runs and fails that leak per node, and only the run-level excess test
can catch it. A rule that lets a leak pass is therefore reported, never
silently written: the CLI writes it with the uncaught leaks named in the case
file, or with --require-leaks-caught writes nothing and exits 1.

A leak that changes no mask entry on a setting (no padding rows, no siblings
at topk 1, no depth-2 rows) is "not exercised" there, not "caught". The
fourth kind of the study (the padding column at a 900-token prefix) needs a
long prompt: it is exercised only when the case's prompts are long.

Layer: workflows. Imports report, the check and below; never cli."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace

import torch

from harness.engine.settings import RunSettings


@dataclass(frozen=True)
class LeakProof:
    """One leak run on one calibrated setting."""
    dtype: str
    leak: str
    setting: str                 # the setting's label
    edited: int                  # mask entries the leak changed over the run (0: not exercised)
    caught: bool                 # the run failed under the calibrated rule
    by: str | None               # the test that failed it (the summary's first divergence kind)
    max_ratio: float | None      # the largest node noise ratio of the run
    multiplier: float | None     # the calibrated multiplier it was judged with

    def __post_init__(self):
        if self.edited < 0 or (self.caught and self.edited == 0):
            raise ValueError(f"{self.leak}: a leak that edits nothing cannot be caught ({self.edited} entries)")

    @property
    def exercised(self) -> bool:
        return self.edited > 0


def _counting(leak: str, counter: list[int]):
    """The leak's mask stage, counting the entries it changes against the clean one."""
    from harness.engine.ddtree.mask import flat_custom_mask
    from harness.faults.one_key import ONE_KEY_LEAKS
    leaky = ONE_KEY_LEAKS[leak]

    def build(trees, prefix_lens):
        mask, indptr = leaky(trees, prefix_lens)
        clean, _ = flat_custom_mask(trees, prefix_lens)
        counter[0] += int((mask.to(torch.bool) != clean.to(torch.bool)).sum())
        return mask, indptr
    return build


def prove_leaks(settings: list[RunSettings], rules: dict[str, tuple[float, ...]], per_leak: int = 2,
                on_run=None) -> list[LeakProof]:
    """Run each one-key leak on up to `per_leak` settings of each dtype in
    `rules` (dtype -> calibrated (multiplier, floor, ceiling, drift limit)),
    judged by that rule; settings that exercise the leak are preferred."""
    from harness.check.differential import check
    from harness.check.prepare import LoadCache
    from harness.check.records import RecordWriter
    from harness.faults.one_key import ONE_KEY_LEAKS
    from harness.workflows.cases import prompts_for
    loads, proofs = LoadCache(), []
    for dtype, rule in rules.items():
        candidates = [replace(s, noise_rule=rule, verdict="auto", stop_after=0) for s in settings if s.dtype == dtype]
        for leak in ONE_KEY_LEAKS:
            done = 0
            for s in sorted(candidates, key=lambda s: -s.topk if leak == "one-sibling-visible" else 0):
                if done == per_leak:
                    break
                p = loads.prepare(s, prompts_for(s))
                counter = [0]
                p.engine.pipeline = replace(p.engine.pipeline, build_mask=_counting(leak, counter))
                w = RecordWriter(None)
                summary = check(p, w, localize=False)
                proof = LeakProof(dtype, leak, f"{s.backend} b{s.budget} k{s.topk} bs{s.batch}", counter[0],
                                  counter[0] > 0 and not summary.passed,
                                  None if summary.first is None else summary.first.what,
                                  summary.max_noise_ratio, rule[0])
                proofs.append(proof)
                done += proof.exercised
                if on_run:
                    on_run(proof)
    return proofs


def uncaught(proofs: list[LeakProof]) -> list[LeakProof]:
    """Exercised leak runs the rule let pass."""
    return [p for p in proofs if p.exercised and not p.caught]


def case_comment(proofs: list[LeakProof]) -> list[str]:
    """Lines for the case file under [tolerances]: what the rule was proven on."""
    lines = []
    for p in proofs:
        if not p.exercised:
            continue
        state = f"caught ({p.by})" if p.caught else "NOT CAUGHT"
        ratio = "-" if p.max_ratio is None else f"{p.max_ratio:.2f}"
        lines.append(f"# leak {p.leak} on {p.dtype} ({p.setting}): {state}, max ratio {ratio} "
                     f"vs multiplier {p.multiplier:.3g}")
    return lines


def to_json(proofs: list[LeakProof]) -> str:
    return json.dumps([p.__dict__ for p in proofs], indent=1)
