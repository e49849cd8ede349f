"""The noise-floor verdict for low-precision runs (bf16, fp16).

A fixed tolerance cannot serve every model: in bf16 a correct engine's
per-node error grows with depth, width and prefix length (up to 8.5e-2 on an
8B shape against the fixed 4e-2), while a leak of one key into one row can
stay below it. So a low-precision run is judged against low-precision
computations of the same nodes that are known to be correct, by two tests.

Every quantity is a node's relative error against the float64 oracle,
e = max |logits - oracle| / max |oracle| (compare/metrics.py), of:
  e          the engine under test;
  e_twin     its causal twin: the engine's own model code and kernel over a
             plain causal extend of prefix + the node's path, no tree
             (harness/check/causal_twin.py);
  e_rounded  the oracle's own low-precision computation of the node: the
             reference model with every stored tensor rounded to the run's
             dtype (reference/model.py, DenseOracle.rounded_tree_logits).
             It shares no code with the engine.
e_rounded is computed for every node; e_twin only where it can change one
of the tests below (NoiseFloorRule.needs_twin: a missing twin leaves the
bound at its lowest and the ratio at its highest, so a node those clear is
decided without it).

1. Per node (a leak into one row: one key seen or lost):

       diverge  iff  e > min(m(N) * max(e_twin, e_rounded, floor), ceiling)

   Two independent yardsticks, the larger taken: one lucky yardstick no
   longer decides. On SmolLM2-135M (a trained model) the single twin made
   3 of 8 CPU bf16 runs and every H200 bf16 run false-alarm, with the
   engine's largest error within 0.7 to 1.3x the twins' largest.
   m(N) is set from the tail with the run's node count N in mind: a run
   judges N nodes, so at a per-run false-alarm budget ALARMS_PER_RUN each
   node may exceed the multiplier with probability ALARMS_PER_RUN / N.
   log(e / max(e_twin, e_rounded, floor)) of correct nodes is modelled by
   NoiseTail (mu, sigma) per dtype, fitted on the fault-free study
   (benchmarks/verdict_study.py, figures below), and
       m(N) = exp(mu + sigma * z),  z = Phi^-1(1 - ALARMS_PER_RUN / N).
   N is the run's planned node count (planned_nodes: every step emitting
   one token, every row real), an upper bound known before the first step.

2. Per run (a bug of the model's arithmetic: RoPE angles rounded, a
   softmax scale off; the engine and its twin share it, so test 1 is blind
   to it):

       drift = exp(median over the run's nodes of log(e / max(e_rounded, floor)))
       diverge  iff  drift > drift_limit

   The oracle's rounded computation rounds at the same places a correct
   low-precision engine stores, so a correct engine's errors sit around
   its errors node after node; a wrong model moves every node.

3. Per run (a leak too small for test 1 that repeats: one padding column
   seen by the last real row of every step moves each such row by 0.8 to
   2.4 noise units, inside the per-node tail, but on every step):

       k = the run's nodes whose ratio exceeds excess_ratio (the ratio 1% of
           correct nodes exceed: EXCESS_TAIL), n = the nodes judged
       diverge  iff  P(Binomial(n, EXCESS_TAIL) >= k) < EXCESS_ALPHA

   Nodes of one tree share ancestors, so their exceedances are not quite
   independent; EXCESS_ALPHA is set far below the per-run budget for that
   reason, and its false-alarm rate is measured, not assumed (figures below).

What this does not reach (SmolLM2, bf16, benchmarks/results/verdict-fit.json):
the last real row seeing one padding column sits at e / scale 1.0 to 5.6,
largely inside the fault-free tail: test 1 catches 5 to 8 of its 32 rows;
test 3 catches each of its runs at short prefixes (4 of 4, both backends) but
none at a 900-token prefix (0 of 4; test 1 there: 2 of 9 rows). One sibling
seen is caught on 28 of 29 rows, one ancestor lost on every row; in fp16 all
four leaks on every row.

floor: below about one unit in the last place of the largest logit (bf16
2^-8 = 3.9e-3, fp16 2^-11 = 4.9e-4) a yardstick's error says nothing about
the node's scale. ceiling: an error no correct computation in that dtype
reaches whatever the yardsticks say (bf16 0.25, fp16 0.05: 3x and 18x the
largest errors of correct runs measured, under the smallest
padded-kv-visible error measured, 0.52).


Layer: verdict. Imports nothing of harness."""
from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

ALARMS_PER_RUN = 1e-3   # the false-alarm budget of one correct run, whatever its node count
EXCESS_TAIL = 0.01      # test 3 counts nodes above the ratio this share of correct nodes exceeds
EXCESS_ALPHA = 1e-5     # test 3's binomial level (nominal; nodes of a tree are correlated, see above)


@dataclass(frozen=True)
class NoiseTail:
    """log(e / noise scale) of correct nodes: mean mu, spread sigma of a
    normal that bounds the measured upper tail (see the module's figures)."""

    mu: float
    sigma: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.mu) and self.sigma > 0.0):
            raise ValueError("a noise tail needs a finite mu and sigma > 0")

    def multiplier(self, nodes: int, alarms_per_run: float = ALARMS_PER_RUN) -> float:
        """The per-node multiplier at which a correct run of `nodes` nodes
        false-alarms with probability alarms_per_run (union bound over its nodes)."""
        if nodes < 1 or not 0.0 < alarms_per_run < 1.0:
            raise ValueError("a multiplier needs nodes >= 1 and a per-run budget in (0, 1)")
        z = NormalDist().inv_cdf(1.0 - alarms_per_run / nodes)
        return max(1.0, math.exp(self.mu + self.sigma * z))


@dataclass(frozen=True)
class NoiseFloorRule:
    multiplier: float     # per node: e above multiplier x the noise scale diverges
    floor: float
    ceiling: float
    drift_limit: float    # per run: the median e / e_rounded above this diverges
    excess_ratio: float | None = None   # per run: ratios above this are counted (test 3); None: no test 3

    def __post_init__(self) -> None:
        if not (self.multiplier >= 1.0 and 0.0 < self.floor < self.ceiling < 1.0 and self.drift_limit >= 1.0):
            raise ValueError("a noise-floor rule needs multiplier >= 1, 0 < floor < ceiling < 1 and "
                             "drift_limit >= 1")
        if self.excess_ratio is not None and not self.excess_ratio > 0.0:
            raise ValueError("a noise-floor rule's excess_ratio must be > 0")

    def scale(self, e_twin: float, e_rounded: float) -> float:
        """The node's noise: the larger of its two correct low-precision errors, at least the floor."""
        return max(e_twin, e_rounded, self.floor)

    def bound(self, e_twin: float, e_rounded: float) -> float:
        """The largest engine error this node may have."""
        return min(self.multiplier * self.scale(e_twin, e_rounded), self.ceiling)

    def ratio(self, e_engine: float, e_twin: float, e_rounded: float) -> float:
        """e_engine / noise scale: the node's error in units of its noise."""
        return e_engine / self.scale(e_twin, e_rounded)

    def needs_twin(self, e_engine: float, e_rounded: float) -> bool:
        """Whether the node's twin error can change what this rule decides of it, its rounded error known.

        The twin only raises the noise scale (scale takes the larger yardstick): without it the bound is at
        its lowest and the ratio at its highest. So a node inside bound(0, e_rounded), or past the ceiling,
        gets test 1's verdict either way; one whose ratio without the twin is at most excess_ratio is not
        counted by test 3 either way; test 2 reads no twin. Only the other nodes need their twin computed
        (differential.py: the twin is the engine's computation again, one causal extend per path)."""
        if not math.isfinite(e_engine):   # a non-finite row diverges, and its ratio is inf, with any twin
            return False
        test1 = self.bound(0.0, e_rounded) < e_engine <= self.ceiling
        test3 = self.excess_ratio is not None and self.ratio(e_engine, 0.0, e_rounded) > self.excess_ratio
        return test1 or test3

    def drift(self, errors: list[tuple[float, float]]) -> float | None:
        """exp(median log(e / max(e_rounded, floor))) over (e, e_rounded) pairs; None for none."""
        logs = sorted(math.log(max(e, 1e-30) / max(r, self.floor)) for e, r in errors)
        if not logs:
            return None
        mid = len(logs) // 2
        return math.exp(logs[mid] if len(logs) % 2 else 0.5 * (logs[mid - 1] + logs[mid]))

    def excess(self, ratios: list[float]) -> tuple[int, int, float] | None:
        """Test 3 over a run's node ratios: (k above excess_ratio, n, the binomial
        upper tail P(K >= k) at EXCESS_TAIL); None without test 3 or nodes."""
        if self.excess_ratio is None or not ratios:
            return None
        n, k = len(ratios), sum(r > self.excess_ratio for r in ratios)
        return k, n, binomial_upper_tail(n, k, EXCESS_TAIL)


def binomial_upper_tail(n: int, k: int, p: float) -> float:
    """P(K >= k) for K ~ Binomial(n, p), summed in log space (n up to many thousands)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    lp, lq = math.log(p), math.log1p(-p)
    terms = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq
             for i in range(k, n + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


@dataclass(frozen=True)
class DtypeNoise:
    """What the study measured for one dtype: the per-node tail, and the rule's fixed parts."""

    tail: NoiseTail
    floor: float
    ceiling: float
    drift_limit: float
    excess_ratio: float     # the ratio EXCESS_TAIL of correct nodes exceed

    def rule(self, nodes: int) -> NoiseFloorRule:
        return NoiseFloorRule(self.tail.multiplier(nodes), self.floor, self.ceiling, self.drift_limit,
                              self.excess_ratio)


# Fitted on SmolLM2-135M-Instruct (benchmarks/verdict_fit.py over benchmarks/results/verdict-study-h100-*.json
# and verdict-study-h200-*.json: 24 text prompts, torch and sglang-triton, topk {1,4}, batch {1,4}, eager
# and CUDA graphs, 8 new tokens; results/verdict-fit.json). log(e / max(e_twin, e_rounded, floor)) over
# 12199 bf16 nodes of 152 runs: mean -0.097, tail sigma 0.320 (max ratio 2.67); over 9572 fp16 nodes of
# 152 runs: mean -0.087, sigma 0.301 (max 2.95). SGLang's Triton kernel is the wider of the two (bf16 sigma
# 0.319 against the torch backend's 0.206), and sets the tail. excess_ratio: the fault-free 99th
# percentile of the ratio (bf16 1.71, fp16 1.76). Replayed on the same runs: 0 of 152 + 152 false alarms
# by test 1 (largest ratio 0.74x / 0.87x its multiplier), 0 by test 3 (smallest p 2.9e-4 / 5.4e-2),
# drift 0.87 to 1.38 (1.5 sits above that).
NOISE = {
    "bfloat16": DtypeNoise(NoiseTail(mu=-0.097, sigma=0.320), floor=2 ** -8, ceiling=0.25, drift_limit=1.5,
                           excess_ratio=1.71),
    "float16": DtypeNoise(NoiseTail(mu=-0.087, sigma=0.301), floor=2 ** -11, ceiling=0.05, drift_limit=1.5,
                          excess_ratio=1.76),
}
NOISE_FLOOR = NOISE   # the dtypes the noise floor judges
VERDICTS = ("auto", "fixed", "noise-floor")
DEFAULT_DRIFT = {d: n.drift_limit for d, n in NOISE.items()}


def planned_nodes(s) -> int:
    """The most nodes a run of settings `s` can judge: every verify step
    emitting one token, every row of every request real."""
    return s.max_new_tokens * s.batch * s.q_len


def verdict_rule(dtype: str, verdict: str, tolerance_given: bool, calibrated: tuple | None = None,
                 nodes: int = 1) -> NoiseFloorRule | None:
    """The noise-floor rule a run of `nodes` planned nodes is judged by, or
    None for the fixed table. auto: noise-floor for bf16 and fp16 unless a
    tolerance was given; `calibrated` (multiplier, floor, ceiling[, drift
    limit]: `ddcheck calibrate`, a case's [tolerances], --noise-rule) fixes
    the multiplier instead of deriving it from the node count."""
    if verdict == "fixed" or (verdict == "auto" and (tolerance_given or dtype not in NOISE)):
        return None
    if dtype not in NOISE:
        raise ValueError(f"--verdict noise-floor is for bfloat16 and float16 runs; {dtype} is judged by the "
                         "fixed table")
    if calibrated:
        m, f, c, *d = calibrated   # test 3 keeps the dtype's measured tail ratio
        return NoiseFloorRule(m, f, c, d[0] if d else NOISE[dtype].drift_limit, NOISE[dtype].excess_ratio)
    return NOISE[dtype].rule(nodes)
