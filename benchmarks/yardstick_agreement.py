"""The noise-floor verdict's cheaper yardsticks judged against the ones they replace (issue 22 point 3).

Two changes cut the CPU check's time: the causal twin is computed only for the nodes whose verdict it can
change (NoiseFloorRule.needs_twin), and the oracle's rounded yardstick sums its matmuls in float32
(reference/model.py). The first is exact by construction; the second moves a rounded value only where a
float32 sum and a float64 one round to different stored values. This runs the same settings both ways on one
loading of a trained model and compares node by node.

* every: every node's twin, the rounded yardstick summed in float64 (the design before);
* now:   the code as it is.

Fault-free runs (topk 1 and 4, batch 1 and 4) and one-key leaks (harness/faults/one_key.py). Per run: both
verdicts and divergent-node sets (they must agree), the rounded error's largest and 99th-percentile relative
change, the drift of each, the twins computed, and each mode's oracle seconds per step.

    PYTHONPATH=. .venv/bin/python benchmarks/yardstick_agreement.py [--model smollm2-135m] [--max-new-tokens 12]
        [--out benchmarks/results/yardstick-agreement-cpu.json]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from oracle_speed import every_twin, fresh  # noqa: E402
from harness.check.differential import check  # noqa: E402
from harness.check.prepare import build, load  # noqa: E402
from harness.check.records import RecordWriter  # noqa: E402
from harness.engine.settings import RunSettings  # noqa: E402
from harness.faults.one_key import ONE_KEY_LEAKS  # noqa: E402

RUNS = [(None, dict(topk=1, batch=1)), (None, dict(topk=4, batch=1)), (None, dict(topk=1, batch=4)),
        (None, dict(topk=4, batch=4)), ("one-sibling-visible", dict(topk=4, batch=1)),
        ("one-ancestor-hidden", dict(topk=1, batch=1)), ("last-row-sees-one-padding", dict(topk=1, batch=4))]


def judged(s: RunSettings, loaded, leak: str | None, mode: str) -> tuple[object, dict]:
    """(summary, {(step, request, node): node record}) of one run in `mode`."""
    fresh(loaded.oracle)
    p = build(s, loaded)
    if leak:
        p.engine.pipeline = replace(p.engine.pipeline, build_mask=ONE_KEY_LEAKS[leak])
    w = RecordWriter(None)
    if mode == "every":
        with every_twin():
            summary = check(replace(p, every_twin=True), w, localize=False)
    else:
        summary = check(p, w, localize=False)
    nodes = {(r["step"], r["request"], r["node"]): r for r in map(json.loads, w.lines)
             if r.get("kind") == "node" and not r["is_padding"]}
    return summary, nodes


def compare(leak, kw, every, now) -> dict:
    (se, ne), (sn, nn) = every, now
    keys = sorted(set(ne) & set(nn))
    moved = sorted(abs(nn[k]["rounded_err"] / ne[k]["rounded_err"] - 1.0) for k in keys if ne[k]["rounded_err"])
    shift = sorted(math.log(nn[k]["rounded_err"] / ne[k]["rounded_err"]) for k in keys
                   if ne[k]["rounded_err"] and nn[k]["rounded_err"])   # a systematic move: median away from 0
    floor = se.noise_rule["floor"]
    tail = lambda nodes: quantile(sorted(r["rel_err"] / max(r["rounded_err"], floor)   # noqa: E731
                                         for r in nodes.values()), 0.99)
    bound_ok = all(nn[k]["noise_ratio"] >= ne[k]["noise_ratio"] * (1 - 0.05) for k in keys
                   if nn[k]["twin_err"] is None)   # a skipped twin leaves an upper bound (rounded moves <= 5%)
    diverged = lambda nodes: sorted(k for k, r in nodes.items() if r["verdict"] == "diverge")  # noqa: E731
    return dict(leak=leak, **kw, nodes=len(keys), same_nodes=set(ne) == set(nn),
                verdict_every="PASS" if se.passed else "FAIL", verdict_now="PASS" if sn.passed else "FAIL",
                divergent_every=len(diverged(ne)), divergent_now=len(diverged(nn)),
                same_divergent=diverged(ne) == diverged(nn),
                same_node_verdicts=all(ne[k]["verdict"] == nn[k]["verdict"] for k in keys),
                rounded_change_max=moved[-1] if moved else None,
                rounded_change_p99=quantile(moved, 0.99),
                rounded_log_shift_median=quantile(shift, 0.5),
                rounded_ratio_p99_every=tail(ne), rounded_ratio_p99_now=tail(nn),
                drift_every=se.noise_drift, drift_now=sn.noise_drift, twin_nodes_now=sn.twin_nodes,
                skipped_ratio_is_upper_bound=bound_ok,
                max_ratio_every=se.max_noise_ratio, max_ratio_now=sn.max_noise_ratio,
                oracle_s_per_step_every=se.oracle_s_per_step, oracle_s_per_step_now=sn.oracle_s_per_step,
                engine_s_per_step=sn.engine_s_per_step)


def quantile(xs: list[float], q: float) -> float | None:
    """The q-quantile of sorted xs (nearest rank below), None for none."""
    return xs[int(q * (len(xs) - 1))] if xs else None


def table(rows: list[dict]) -> str:
    head = ("| run | nodes | verdict every / now | divergent every / now | same node verdicts | rounded change "
            "max (p99) | drift every / now | twins now | oracle s/step every / now |")
    lines = [head, "|" + " --- |" * 9]
    for r in rows:
        run = f"{r['leak'] or 'fault-free'} topk {r['topk']} batch {r['batch']}"
        ch = "-" if r["rounded_change_max"] is None else f"{r['rounded_change_max']:.2e} ({r['rounded_change_p99']:.1e})"
        oe, on = r["oracle_s_per_step_every"], r["oracle_s_per_step_now"]
        lines.append(f"| {run} | {r['nodes']} | {r['verdict_every']} / {r['verdict_now']} | {r['divergent_every']} / "
                     f"{r['divergent_now']} | {r['same_node_verdicts']} | {ch} | {r['drift_every']:.3f} / "
                     f"{r['drift_now']:.3f} | {r['twin_nodes_now'] or 0} | "
                     f"{'-' if oe is None else f'{oe:.3f}'} / {'-' if on is None else f'{on:.3f}'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/yardstick-agreement-cpu.json"))
    a = ap.parse_args()
    torch.set_num_threads(1)   # the engine's threads as the CLI sets them
    base = RunSettings(model=a.model, dtype="bfloat16", backend="torch", budget=a.budget,
                       max_new_tokens=a.max_new_tokens, stop_after=0)
    loaded = load(base)
    rows: list[dict] = []
    for leak, kw in RUNS:
        s = replace(base, **kw)
        rows.append(compare(leak, kw, judged(s, loaded, leak, "every"), judged(s, loaded, leak, "now")))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(dict(model=a.model, budget=a.budget, max_new_tokens=a.max_new_tokens,
                                         command=" ".join(sys.argv), rows=rows), indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
