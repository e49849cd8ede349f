"""The noise-floor verdict for low-precision runs.

A fixed tolerance cannot serve every model: in bf16 a correct engine's
per-node error grows with depth, width and prefix length (issue figures: up
to 7.5e-2 on an 8B shape against the fixed 4e-2), while a leak of one key
into one row can stay below it (2.4e-2 on the tiny preset at a long prefix).
So each node is judged against its own correct low-precision twin (the same
model, dtype and backend without a tree: harness/check/causal_twin.py):

    diverge  iff  e_engine > multiplier * max(e_twin, floor)  or  e_engine > ceiling

with e = max |logits - oracle| / max |oracle| (compare/metrics.py).

multiplier 1.75: on an H200 with 1B- and 8B-shaped bf16 checkpoints
(benchmarks/results/noise-floor-h200-{1b,8b}.json, 6101 fault-free nodes) the
ratio e_engine / e_twin of a correct engine was at most 1.41 (p99 1.22),
while a row that saw one leaked key (or lost one) with a short prompt had at least 6.8;
the issue's own earlier figures were 1.38 and 2.1. 1.75 sits between them,
1.24x above the largest correct ratio. The weakest leak measured (one
duplicated key at a 900-token prefix) reaches 1.94 on the 1B shape and
1.13 to several on the 8B, where 9 of its 15 rows are caught.
fp16 multiplier 2.5: fp16 errors are mostly the output's own rounding, which
the engine and its twin draw independently, so their ratio spreads wider
than bf16's. SGLang's kernel in fp16 on an H200 (tiny preset, 3316
fault-free nodes, benchmarks/results/noise-floor-h200-fp16-tiny.json) reached
1.83 (p99 1.44), which 1.75 judged a false divergence (budget 32, topk 4,
batch 4); the torch backend on CPU (1239 nodes,
noise-floor-float16-torch-cpu.json) reached 1.49, and its one-key leaks were
at least 5.8 (one padding key at a 300-token prefix) and 22 with short
prompts. 2.5 is 1.37x above the largest correct ratio, 2.3x under the
weakest leak.
floor: the twin can land closer to the oracle than its dtype's rounding of
the logits themselves by luck; below about one unit in the last place of the
largest logit (bf16 2^-8 = 3.9e-3, fp16 2^-11 = 4.9e-4) its error says
nothing about the node's scale.
ceiling: an error no correct computation in that dtype reaches whatever the
twin says (a twin broken the same way as the engine cannot excuse it);
bf16 0.25 and fp16 0.05, about 3x and 18x the largest errors measured on
correct runs (8.5e-2 bf16 8B shape, 2.7e-3 fp16), and under the smallest
padded-kv-visible error measured (0.52).


Layer: verdict. Imports nothing of harness."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NoiseFloorRule:
    multiplier: float
    floor: float
    ceiling: float

    def __post_init__(self) -> None:
        if not (self.multiplier >= 1.0 and 0.0 < self.floor < self.ceiling < 1.0):
            raise ValueError("a noise-floor rule needs multiplier >= 1 and 0 < floor < ceiling < 1")

    def bound(self, e_twin: float) -> float:
        """The largest engine error this node may have."""
        return min(self.multiplier * max(e_twin, self.floor), self.ceiling)

    def ratio(self, e_engine: float, e_twin: float) -> float:
        """e_engine / max(e_twin, floor): the node's error in units of its noise."""
        return e_engine / max(e_twin, self.floor)


NOISE_FLOOR = {
    "bfloat16": NoiseFloorRule(multiplier=1.75, floor=2 ** -8, ceiling=0.25),
    "float16": NoiseFloorRule(multiplier=2.5, floor=2 ** -11, ceiling=0.05),
}
VERDICTS = ("auto", "fixed", "noise-floor")


def verdict_rule(dtype: str, verdict: str, tolerance_given: bool,
                 calibrated: tuple[float, float, float] | None = None) -> NoiseFloorRule | None:
    """The noise-floor rule a run is judged by, or None for the fixed table.
    auto: noise-floor for bf16 and fp16 unless a tolerance was given;
    `calibrated` (multiplier, floor, ceiling: `ddcheck calibrate`, a case's
    [tolerances]) replaces the measured defaults above."""
    if verdict == "fixed" or (verdict == "auto" and (tolerance_given or dtype not in NOISE_FLOOR)):
        return None
    if dtype not in NOISE_FLOOR:
        raise ValueError(f"--verdict noise-floor is for bfloat16 and float16 runs; {dtype} is judged by the "
                         "fixed table")
    return NoiseFloorRule(*calibrated) if calibrated else NOISE_FLOOR[dtype]
