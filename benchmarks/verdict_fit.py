"""Fit and score the low-precision verdict from verdict-study JSON files.

Reads the per-node errors that benchmarks/verdict_study.py kept (every
fault-free node's rel_err / twin_err / rounded_err and their whole-vector
twins rel_l2 / twin_l2 / rounded_l2; every leaked row's same values) and,
for each dtype and each candidate statistic,

  * fits the tail of log(e / noise scale) over the fault-free nodes
    (mu, and the smallest sigma whose normal bounds the measured quantiles
    0.9, 0.99, 0.999 and the maximum: harness/verdict/noise_floor.py's
    NoiseTail),
  * replays every fault-free run under the rule that fit gives (the run's
    planned node count sets the multiplier at ALARMS_PER_RUN), counting runs
    that false-alarm, per backend / graph / topk / batch,
  * sets the run-level excess test's ratio (the one EXCESS_TAIL of the
    fault-free nodes exceed) and replays it: the smallest fault-free p-value,
    and which leak runs it catches (test 3 of noise_floor.py),
  * and counts the leaked rows each leak kind gets caught on by test 1.

Statistics (the noise scale is always at least the dtype's floor):
  max-both    e = largest-entry error; scale max(e_twin, e_rounded)   (the rule before this fit)
  max-twin    e = largest-entry error; scale e_twin
  max-rounded e = largest-entry error; scale e_rounded
  l2-both     e = whole-vector error;  scale max(l2_twin, l2_rounded)
  l2-rounded  e = whole-vector error;  scale l2_rounded

    python3 benchmarks/verdict_fit.py benchmarks/results/verdict-study-h200b-*.json --out benchmarks/results/verdict-fit-h200.json
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import defaultdict
from pathlib import Path
from statistics import NormalDist, mean, pstdev

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.verdict.noise_floor import (ALARMS_PER_RUN, EXCESS_ALPHA, EXCESS_TAIL, NOISE, NoiseTail,  # noqa: E402
                                         binomial_upper_tail)

STATS = {  # name: (engine key, yardstick keys)
    "max-both": ("rel_err", ("twin_err", "rounded_err")),
    "max-twin": ("rel_err", ("twin_err",)),
    "max-rounded": ("rel_err", ("rounded_err",)),
    "l2-both": ("rel_l2", ("twin_l2", "rounded_l2")),
    "l2-rounded": ("rel_l2", ("rounded_l2",)),
}
QUANTILES = (0.9, 0.99, 0.999)


def dtype_of(row) -> str:
    return re.search(r"--dtype (\S+)", row["setting"]).group(1)


def log_ratios(values: dict, stat: str, floor: float) -> list[float]:
    """log(e / max(yardsticks, floor)) per node of one run's values (a dict of lists)."""
    key, yards = STATS[stat]
    if key not in values or any(y not in values for y in yards):
        return []
    return [math.log(max(values[key][i], 1e-30) / max(floor, *(values[y][i] for y in yards)))
            for i in range(len(values[key]))]


def fit_tail(logs: list[float]) -> NoiseTail:
    """mu = mean; sigma = the smallest spread whose normal lies above the measured
    upper quantiles and the maximum (the maximum taken at quantile 1 - 1/n)."""
    logs = sorted(logs)
    mu, sd = mean(logs), pstdev(logs)
    n = len(logs)
    marks = [(q, logs[min(n - 1, int(q * n))]) for q in QUANTILES if q < 1 - 1 / n]
    marks.append((1 - 1 / (2 * n), logs[-1]))
    sigma = max([sd] + [(v - mu) / NormalDist().inv_cdf(q) for q, v in marks])
    return NoiseTail(mu=mu, sigma=max(sigma, 1e-6))


def excess_p(logs: list[float], excess_ratio: float) -> float:
    k = sum(math.exp(x) > excess_ratio for x in logs)
    return binomial_upper_tail(len(logs), k, EXCESS_TAIL)


def replay(rows, stat: str, tail: NoiseTail, floor: float, excess_ratio: float):
    """Each fault-free run judged by the tail's rule (test 1) and the excess test (test 3):
    ({setting group: [runs, test-1 alarms, test-3 alarms]}, worst run ratio / multiplier, smallest excess p)."""
    groups = defaultdict(lambda: [0, 0, 0])
    worst, least_p = 0.0, 1.0
    for r in rows:
        logs = log_ratios(r["node_values"], stat, floor)
        if not logs:
            continue
        m = tail.multiplier(max(r["planned_nodes"], 1))
        top, pv = math.exp(max(logs)), excess_p(logs, excess_ratio)
        worst, least_p = max(worst, top / m), min(least_p, pv)
        g = groups[(r.get("backend"), bool(r.get("cuda_graph")), r.get("topk"), r.get("batch"))]
        g[0] += 1
        g[1] += top > m
        g[2] += pv < EXCESS_ALPHA
    return groups, worst, least_p


def leaks_caught(rows, stat: str, tail: NoiseTail, floor: float, excess_ratio: float):
    """{leak: [leaked rows, rows test 1 catches, weakest row ratio / multiplier, runs, runs test 3 catches,
    largest excess p]}"""
    out = {}
    for r in rows:
        logs = log_ratios(r.get("leak_values") or {}, stat, floor)
        if not logs:
            continue
        m = tail.multiplier(max(r["planned_nodes"], 1))
        pv = excess_p(log_ratios(r["node_values"], stat, floor), excess_ratio)
        name = f"{r['leak']}{' long' if r.get('long') else ''} {r['backend']}"
        c = out.setdefault(name, [0, 0, math.inf, 0, 0, 0.0])
        c[0] += len(logs)
        c[1] += sum(math.exp(x) > m for x in logs)
        c[2] = min(c[2], min(math.exp(x) / m for x in logs))
        c[3] += 1
        c[4] += pv < EXCESS_ALPHA
        c[5] = max(c[5], pv)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--stats", default=",".join(STATS))
    a = ap.parse_args()
    free, leak = defaultdict(list), defaultdict(list)
    for f in a.files:
        d = json.loads(f.read_text())
        for r in d.get("fault_free", []):
            free[dtype_of(r)].append(r)
        for r in d.get("leaks", []):
            leak[dtype_of(r)].append(r)
    result = {"files": [f.name for f in a.files], "alarms_per_run": ALARMS_PER_RUN, "fits": []}
    for dtype, rows in sorted(free.items()):
        floor = NOISE[dtype].floor
        print(f"\n{dtype}: {len(rows)} fault-free runs, {sum(len(r['node_values']['rel_err']) for r in rows)} nodes")
        print(f"{'statistic':<12} {'mu':>7} {'sigma':>6} {'max':>6} {'q99':>6} {'runs':>5} {'alarm1':>6} "
              f"{'worst/m':>7} {'alarm3':>6} {'min p3':>8}  leaks: rows caught by test 1, runs by test 3")
        for stat in a.stats.split(","):
            logs = [x for r in rows for x in log_ratios(r["node_values"], stat, floor)]
            if not logs:
                continue
            tail = fit_tail(logs)
            q99 = math.exp(sorted(logs)[min(len(logs) - 1, int((1 - EXCESS_TAIL) * len(logs)))])
            groups, worst, least_p = replay(rows, stat, tail, floor, q99)
            caught = leaks_caught(leak.get(dtype, []), stat, tail, floor, q99)
            runs, a1, a3 = (sum(g[i] for g in groups.values()) for i in range(3))
            lk = ", ".join(f"{k}: {c[1]}/{c[0]}, {c[4]}/{c[3]}" for k, c in sorted(caught.items()))
            print(f"{stat:<12} {tail.mu:7.3f} {tail.sigma:6.3f} {math.exp(max(logs)):6.2f} {q99:6.3f} {runs:5d} "
                  f"{a1:6d} {worst:7.2f} {a3:6d} {least_p:8.1e}  {lk}")
            result["fits"].append(dict(
                dtype=dtype, statistic=stat, nodes=len(logs), mu=tail.mu, sigma=tail.sigma,
                max_ratio=math.exp(max(logs)), excess_ratio=q99, runs=runs, false_alarm_runs_test1=a1,
                false_alarm_runs_test3=a3, worst_ratio_over_multiplier=worst, least_excess_p=least_p,
                per_setting=[dict(backend=k[0], cuda_graph=k[1], topk=k[2], batch=k[3], runs=v[0], alarms_test1=v[1],
                                  alarms_test3=v[2]) for k, v in sorted(groups.items(), key=str)],
                leaks={k: dict(rows=c[0], rows_caught_test1=c[1], weakest_ratio_over_multiplier=c[2], runs=c[3],
                               runs_caught_test3=c[4], largest_excess_p=c[5]) for k, c in caught.items()}))
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
