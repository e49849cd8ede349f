"""The causal twin computed only where it can change a verdict, judged against the twin of every node (issue 22
point 3).

The noise-floor verdict compares each node with two yardsticks, the causal twin (the engine's computation again)
and the oracle's own bf16-stored computation. The twin is now computed only for the nodes whose verdict it can
change (NoiseFloorRule.needs_twin); that is exact by construction, and this measures it on a trained model, node
by node, each setting run both ways on one loading:

* every: every node's twin (Prepared.every_twin, as calibration and the verdict studies run);
* now:   the code as it is.

Fault-free runs (topk 1 and 4, batch 1 and 4; the seed's prompts and prompts of the lengths --lens) and one-key
leaks (harness/faults/one_key.py; --leak-lens). Per run: both verdicts and what failed them, the divergent nodes
and every node's verdict (they must agree), the largest difference of a rounded error between the two (the same
oracle computation: 0), the drift of each, the twins computed, and each mode's oracle seconds per step.
results/yardstick-agreement-float32-sums-cpu.json is this study with the rounded yardstick's matmuls summed in
float32 as well (tried and taken back: benchmarks/README.md).

    PYTHONPATH=. .venv/bin/python benchmarks/yardstick_agreement.py [--model smollm2-135m] [--max-new-tokens 12]
        [--out benchmarks/results/yardstick-agreement-cpu.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from oracle_speed import fresh  # noqa: E402
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
    summary = check(replace(p, every_twin=mode == "every"), w, localize=False)
    nodes = {(r["step"], r["request"], r["node"]): r for r in map(json.loads, w.lines)
             if r.get("kind") == "node" and not r["is_padding"]}
    return summary, nodes


def compare(leak, kw: dict, every, now) -> dict:
    (se, ne), (sn, nn) = every, now
    keys = sorted(set(ne) & set(nn))
    moved = max((abs(nn[k]["rounded_err"] - ne[k]["rounded_err"]) for k in keys), default=None)
    # a twin of some nodes is computed in another batch than every node's: the same causal computation, rounded
    # by the kernel over other splits (the relative difference of the twin's error where both have it)
    twin = max((abs(nn[k]["twin_err"] / ne[k]["twin_err"] - 1.0) for k in keys
                if nn[k]["twin_err"] is not None and ne[k]["twin_err"]), default=None)
    diverged = lambda nodes: sorted(k for k, r in nodes.items() if r["verdict"] == "diverge")  # noqa: E731
    return dict(leak=leak, **kw, nodes=len(keys), same_nodes=set(ne) == set(nn),
                verdict_every="PASS" if se.passed else "FAIL", verdict_now="PASS" if sn.passed else "FAIL",
                divergent_every=len(diverged(ne)), divergent_now=len(diverged(nn)),
                same_divergent=diverged(ne) == diverged(nn),
                same_node_verdicts=all(ne[k]["verdict"] == nn[k]["verdict"] for k in keys),
                rounded_change_max=moved, twin_change_max=twin,
                drift_every=se.noise_drift, drift_now=sn.noise_drift, twin_nodes_now=sn.twin_nodes,
                first_every=se.first.what if se.first else None, first_now=sn.first.what if sn.first else None,
                max_ratio_every=se.max_noise_ratio, max_ratio_now=sn.max_noise_ratio,
                oracle_s_per_step_every=se.oracle_s_per_step, oracle_s_per_step_now=sn.oracle_s_per_step,
                engine_s_per_step=sn.engine_s_per_step)


def table(rows: list[dict]) -> str:
    head = ("| run | nodes | verdict every / now | divergent every / now | same node verdicts | rounded, twin "
            "change max | drift every / now | twins now | oracle s/step every / now |")
    lines = [head, "|" + " --- |" * 9]
    for r in rows:
        run = f"{r['leak'] or 'fault-free'} topk {r['topk']} batch {r['batch']} prompts {r['prompt_lens'] or 'seed'}"
        ch = "/".join("-" if r[k] is None else f"{r[k]:.1e}" for k in ("rounded_change_max", "twin_change_max"))
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
    ap.add_argument("--lens", default="default,96", help="prompt lengths of the fault-free runs (default: the seed's)")
    ap.add_argument("--leak-lens", default="default,48,96,160", help="prompt lengths of the leak runs")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/yardstick-agreement-cpu.json"))
    a = ap.parse_args()
    torch.set_num_threads(1)   # the engine's threads as the CLI sets them
    base = RunSettings(model=a.model, dtype="bfloat16", backend="torch", budget=a.budget,
                       max_new_tokens=a.max_new_tokens, stop_after=0)
    loaded = load(base)
    rows: list[dict] = []
    runs = [(leak, dict(kw, prompt_lens=None if n == "default" else (int(n),))) for leak, kw in RUNS
            for n in (a.leak_lens if leak else a.lens).split(",")]
    for leak, kw in runs:
        s = replace(base, **kw)
        rows.append(compare(leak, kw, judged(s, loaded, leak, "every"), judged(s, loaded, leak, "now")))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(dict(model=a.model, budget=a.budget, max_new_tokens=a.max_new_tokens,
                                         command=" ".join(sys.argv), rows=rows), indent=1) + "\n")
    print(table(rows))
    agree = sum(r["verdict_every"] == r["verdict_now"] for r in rows)
    print(f"run verdicts agree: {agree} of {len(rows)}; divergent nodes every {sum(r['divergent_every'] for r in rows)}"
          f", now {sum(r['divergent_now'] for r in rows)}")


if __name__ == "__main__":
    main()
