"""Issue 21's "Done when" cases (not CI: minutes per case). Each case is a
patch of tests/mutations/ with a `done_when` key ("a".."i"); it is applied
to a temporary copy of the working tree, then run

  targeted  its own settings through `python -m harness run` (the first that
            fails is kept): exit, whether it diverged or crashed, the stage
            and quantity the summary names;
  gate      the default gate (cases/gate.toml) through `python -m harness
            gate`: its exit, how many settings failed, and which stages
            the failing settings name (from the gate's records).

Prints a table and writes benchmarks/results/done-when-21-cpu.json.

    PYTHONPATH=$PWD python benchmarks/done_when_21.py [--only a,b] [--no-gate] [--jobs 2] [--out FILE]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mutation_common import ROOT, copy_tree, read_records, run_cli
from mutation_score import COMMON, SETTINGS, STAGE_WORDS, load_corpus

CORPUS = ROOT / "tests" / "mutations"
# settings the done-when cases need beyond mutation_score's: batches that cross requests, bfloat16 judged by
# the noise floor (the run-level drift test included), a long prompt for RoPE's angles, a batch past 2
EXTRA_SETTINGS = {
    "sglang-batch": [["--budget", "8", "--topk", "2", "--backend", "sglang-triton", "--batch", "2"]],
    "bf16": [["--budget", "8", "--topk", "2", "--backend", "torch", "--batch", "2", "--dtype", "bfloat16"]],
    "bf16-long": [["--budget", "8", "--topk", "1", "--backend", "torch", "--dtype", "bfloat16",
                   "--prompt-len", "600"]],   # the default gate's bf16-long setting
    "torch-batch4": [["--budget", "8", "--topk", "2", "--backend", "torch", "--batch", "4"]],
}


def cases(only: set[str]) -> list[dict]:
    return [m for m in load_corpus() if m.get("done_when") and (not only or m["done_when"] in only)]


def settings_of(m: dict) -> list[list[str]]:
    return [args for key in m["settings"] for args in {**SETTINGS, **EXTRA_SETTINGS}[key]]


def run_targeted(tree: Path, m: dict) -> dict:
    """The first of the case's settings that does not pass (or the last one run)."""
    row = {"exit": None, "setting": None, "diverged": False, "crash": False, "stage": None, "quantity": None,
           "explanation": None, "seconds": 0.0}
    for args in settings_of(m):
        r = run_cli(tree, [*args, *COMMON], tree / "records.jsonl", timeout_s=900)
        s = r.summary or {}
        first = s.get("first") or {}
        row["seconds"] += r.seconds
        row.update(exit=r.exit, setting=" ".join(args), stage=s.get("stage"), quantity=s.get("quantity"),
                   explanation=s.get("explanation"), crash=r.exit != 1 and r.exit != 0 or first.get("what") == "crash",
                   replacements=[{k: x.get(k) for k in ("stage", "error_before", "error_after", "correct")}
                                 for x in s.get("replacements") or []],
                   stderr=r.stderr_tail if r.exit not in (0, 1) else "")
        row["diverged"] = r.exit == 1 and first.get("what") != "crash"
        row["proven_crash"] = first.get("what") == "proven-crash"   # a divergence whose evidence is a crash
        if r.exit != 0:
            break
    return row


def run_gate(tree: Path, jobs: int) -> dict:
    """The default gate over the mutated tree: exit, failing settings, the stages their summaries name."""
    out, js = tree / "gate.jsonl", tree / "gate.json"
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "harness", "gate", "--jobs", str(jobs), "--out", str(out),
                        "--json", str(js)], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                       capture_output=True, text=True, timeout=3600)
    doc = json.loads(js.read_text()) if js.exists() else {}
    failing = [v for c in doc.get("cases", []) for v in c["verdicts"] if not v["passed"] and v["kind"] == "setting"]
    stages = collections.Counter()
    crashes = 0
    for rec in read_records(out):
        if rec.get("kind") == "summary" and rec.get("verdict") not in (None, "pass", "match"):
            first = rec.get("first") or {}
            crashes += first.get("what") == "crash" or rec.get("verdict") == "crash"
            stages[f"{rec.get('stage')}/{rec.get('quantity')}"] += 1
    return {"exit": p.returncode, "seconds": round(time.perf_counter() - t0, 1), "failing_settings": len(failing),
            "settings": doc.get("settings"), "crash_settings": crashes, "stages": dict(stages.most_common()),
            "last_line": (p.stdout.strip().splitlines() or [""])[-1][:300],
            "stderr": "\n".join(p.stderr.strip().splitlines()[-4:]) if p.returncode not in (0, 1) else ""}


def judge(m: dict) -> tuple[bool, bool]:
    """(caught: diverged, or for a case whose quantity is "crash" (the engine's process dies, a shape error
    inside the graph runner) a failing verdict that names the crash's stage; named: the summary's stage is
    the case's)"""
    t = m["targeted"]
    named = (t["stage"] or "").startswith(STAGE_WORDS.get(m["stage"], m["stage"]))   # the drift says "model forward"
    crash_named = m["quantity"] == "crash" and t["crash"] and t["exit"] == 1 and named
    return t["diverged"] or crash_named, named


def run_case(m: dict, gate: bool, jobs: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="ddcheck-done-when-") as d:
        tree = Path(d)
        copy_tree(tree)
        applied = subprocess.run(["git", "apply", str(CORPUS / m["patch"])], cwd=tree, capture_output=True,
                                 text=True)
        row = {"case": m["done_when"], "name": m["name"], "expected_stage": m["stage"],
               "expected_quantity": m["quantity"], "applied": applied.returncode == 0}
        if not row["applied"]:
            return row
        row["targeted"] = run_targeted(tree, row | m)
        row["caught"], row["stage_named"] = judge({**m, **row})
        if gate:
            row["gate"] = run_gate(tree, jobs)
        return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated case letters (a..i)")
    ap.add_argument("--no-gate", action="store_true", help="targeted settings only")
    ap.add_argument("--jobs", type=int, default=2, help="the gate's worker processes")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "done-when-21-cpu.json"))
    a = ap.parse_args()
    rows = []
    print(f"{'case':4} {'mutation':36} {'expected':26} {'targeted: named':34} caught stage gate")
    for m in cases(set(filter(None, a.only.split(",")))):
        r = run_case(m, not a.no_gate, a.jobs)
        rows.append(r)
        t = r.get("targeted") or {}
        named = ("crash: " if t.get("crash") else "") + f"{t.get('stage')}/{t.get('quantity')}"
        g = r.get("gate")
        gate = "-" if g is None else f"exit {g['exit']}, {g['failing_settings']} failing, {g['seconds']:.0f} s"
        print(f"{r['case']:4} {r['name']:36} {m['stage'] + '/' + m['quantity']:26} {named:34} "
              f"{'yes' if r.get('caught') else 'NO':6} {'yes' if r.get('stage_named') else 'no':5} {gate}",
              flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"common": COMMON, "extra_settings": EXTRA_SETTINGS, "rows": rows}, indent=1))
    print(f"{sum(bool(r.get('caught')) for r in rows)}/{len(rows)} caught as divergences, "
          f"{sum(bool(r.get('stage_named')) for r in rows)}/{len(rows)} with the right stage; wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
