"""Mutation score (not CI: minutes). Applies each patch of
tests/mutations/ to a temporary copy of the working tree, runs its small
setting set through the CLI (`python -m harness run ...`), stops at the first
setting that fails, and scores:

  caught     the run diverged (exit 1) and the first divergence is not a crash
  explained  caught, and the summary's stage and quantity are the mutation's

Prints a table and writes benchmarks/results/mutation-score.json.

    PYTHONPATH=$PWD python benchmarks/mutation_score.py [--only NAME,NAME] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import tomllib
from pathlib import Path

from mutation_common import ROOT, copy_tree, run_cli

CORPUS = ROOT / "tests" / "mutations"
COMMON = ["--max-new-tokens", "10", "--stop-after", "1"]
SETTINGS = {   # small on purpose: a few budgets/topk, torch, plus SGLang's kernel and acceptor where relevant
    "torch": [["--budget", "8", "--topk", "2", "--backend", "torch", "--batch", "2"],
              ["--budget", "16", "--topk", "1", "--backend", "torch"]],
    "graph": [["--budget", "8", "--topk", "2", "--backend", "torch", "--batch", "3", "--cuda-graph"]],
    "sglang": [["--budget", "8", "--topk", "2", "--backend", "sglang-triton"]],
    "sglang-accept": [["--budget", "8", "--topk", "2", "--backend", "torch", "--accept", "sglang", "--batch", "2"]],
}


# the corpus names stages by the pipeline's fields; the localizer in the domain's words (harness/check/localize/explain.py)
STAGE_WORDS = {"build_tree": "tree build", "build_verify_batch": "verify inputs", "build_mask": "mask",
               "attention": "attention", "accept": "accept", "commit": "commit", "graph": "graph",
               "load": "load", "model": "model", "schema": "shared schema",
               "allocation": "KV allocation"}
QUANTITY_WORDS = {"kv_cache": "cached K/V", "custom_mask": "mask", "visibility": "mask", "accepted_rows": "accept",
                  "free_slots": "freed slot"}


def names_it(m: dict, stage: str | None, quantity: str | None) -> bool:
    """The localizer's stage is the mutation's, and its quantity names the mutation's."""
    if stage != STAGE_WORDS.get(m["stage"], m["stage"]) or not quantity:
        return False
    return any(w in quantity for w in (m["quantity"], QUANTITY_WORDS.get(m["quantity"], m["quantity"])))


def load_corpus() -> list[dict]:
    return tomllib.loads((CORPUS / "mutations.toml").read_text())["mutation"]


def run_setting(tree: Path, args: list[str]) -> tuple[int, dict | None, float]:
    r = run_cli(tree, [*args, *COMMON], tree / "records.jsonl")
    return r.exit, r.summary, r.seconds


def score(m: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="ddcheck-mutant-") as d:
        tree = Path(d)
        copy_tree(tree)
        applied = subprocess.run(["git", "apply", str(CORPUS / m["patch"])], cwd=tree, capture_output=True, text=True)
        row = {"name": m["name"], "file": m["file"], "expected_stage": m["stage"], "expected_quantity": m["quantity"],
               "equivalent": m.get("equivalent"), "crash_named": False,
               "applied": applied.returncode == 0, "caught": False, "explained": False, "crash": False,
               "exit": None, "setting": None, "stage": None, "quantity": None, "fault_class": None, "seconds": 0.0}
        if applied.returncode:
            return row
        for key in m["settings"]:
            for args in SETTINGS[key]:
                rc, summary, secs = run_setting(tree, args)
                row["seconds"] += secs
                row.update(exit=rc, setting=" ".join(args))
                if rc == 0:
                    continue
                s = summary or {}
                first = s.get("first") or {}
                row["crash"] = rc != 1 or first.get("what") == "crash"
                row["caught"] = rc == 1 and first.get("what") != "crash"
                row.update(stage=s.get("stage"), quantity=s.get("quantity"), fault_class=s.get("fault_class"),
                           explanation=s.get("explanation"))
                row["explained"] = row["caught"] and names_it(m, row["stage"], row["quantity"])
                # an engine crash is no divergence; its explanation may still name the wrong input it was handed
                row["crash_named"] = row["crash"] and names_it(m, row["stage"], row["quantity"])
                return row
        return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated mutation names")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "mutation-score.json"))
    a = ap.parse_args()
    corpus = load_corpus()
    if a.only:
        corpus = [m for m in corpus if m["name"] in a.only.split(",")]
    rows = []
    print(f"{'mutation':36} {'expected':32} {'named':32} caught expl. secs")
    for m in corpus:
        r = score(m)
        rows.append(r)
        named = (("crash: " if r["crash"] else "") + f"{r['stage']}/{r['quantity']}" if r["stage"]
                 else ("crash" if r["crash"] else ("- (equivalent)" if r["equivalent"] else "-")))
        print(f"{r['name']:36} {m['stage'] + '/' + m['quantity']:32} {named:32} {'yes' if r['caught'] else 'NO':6} "
              f"{'yes' if r['explained'] else 'no':5} {r['seconds']:.0f}", flush=True)
    judged = [r for r in rows if not r["equivalent"]]   # an equivalent mutant changes no output: nothing to catch
    n, equivalent = len(judged), len(rows) - len(judged)
    caught, explained = sum(r["caught"] for r in judged), sum(r["explained"] for r in judged)
    crash_named = sum(r["crash_named"] for r in judged)
    alarms = [r["name"] for r in rows if r["equivalent"] and r["exit"] not in (0, None)]
    print(f"\n{n} mutations (+{equivalent} equivalent): caught {caught}/{n} ({caught / max(n, 1):.0%}) as a "
          f"divergence, explained {explained}/{n} ({explained / max(n, 1):.0%}) by the right stage and quantity; "
          f"{crash_named} engine crashes name the right stage and quantity"
          + (f"; equivalent mutants that failed: {alarms}" if alarms else ""))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"mutations": n, "equivalent": equivalent, "caught": caught,
                                       "explained": explained, "crash_named": crash_named,
                                       "settings": SETTINGS, "common": COMMON, "rows": rows}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
