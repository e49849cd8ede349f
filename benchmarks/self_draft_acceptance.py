"""Accepted tokens per verify step on a trained model: the seeded stand-in
drafter (`noisy`) against the self-draft (`self`: the target's first k layers
+ final norm + head) at several k, over the four text prompts.

    .venv/bin/python benchmarks/self_draft_acceptance.py [--model smollm2-135m] [--max-new-tokens 16]

Runs the engine only (float32, torch backend, CPU, batch 4): acceptance is a
property of the drafts and the target's greedy choices, not of the oracle.
Prints a table; writes benchmarks/results/self-draft-acceptance-cpu.json.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from harness.check.compare.acceptance_stats import AcceptanceTally   # the summary's own statistic
from harness.check.prepare import prepare
from harness.engine.settings import RunSettings


def measure(s: RunSettings) -> dict:
    """Mean tokens committed per (step, request) and the acceptance at each depth, from the engine's rounds."""
    tally = AcceptanceTally()
    for res in prepare(s).engine.rounds():
        for rs in res.requests:
            tally.add(rs.tree, rs.acceptance)
    return {"drafter": s.drafter, "draft_layers": s.draft_layers, "topk": s.topk,
            "mean_accepted_length": tally.mean_length, "steps": len(tally.lengths),
            "acceptance_by_depth": tally.by_depth}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--layers", default="8,15,23,26,28")
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = RunSettings(model=args.model, backend="torch", budget=16, batch=4, max_new_tokens=args.max_new_tokens)
    rows = []
    for topk in (1, 4):
        rows.append(measure(RunSettings(**{**base.to_dict(), "topk": topk, "drafter": "noisy"})))
        for k in map(int, args.layers.split(",")):
            rows.append(measure(RunSettings(**{**base.to_dict(), "topk": topk, "drafter": "self", "draft_layers": k})))
    print("| drafter | k | topk | tokens per step | steps | acceptance by depth |\n| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        depths = " ".join(f"{a:.2f}" for a in r["acceptance_by_depth"])
        print(f"| {r['drafter']} | {r['draft_layers'] or '-'} | {r['topk']} | {r['mean_accepted_length']:.2f} | "
              f"{r['steps']} | {depths} |")
    out = Path("benchmarks/results/self-draft-acceptance-cpu.json")
    out.write_text(json.dumps({"model": args.model, "settings": "float32, torch backend, CPU, budget 16, batch 4 "
                               f"(the four text prompts), {args.max_new_tokens} new tokens", "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
