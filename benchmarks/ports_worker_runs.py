"""A worker-lineage port through `ddcheck run`: the port's own stages, its build and
compile only, and a compile without its build, per backend, batch and graph mode.

    python benchmarks/ports_worker_runs.py PATH LABEL [--backends torch,sglang-triton,...] [--device cpu]

PATH is a checkout of the port (e.g. `git archive` of DB-Guo/sglang-ddtree-dev's
python/sglang/srt/speculative at a commit); LABEL names the result file,
benchmarks/results/ports-worker-LABEL.json. Prints a table; commands are recorded
with PATH in place of the checkout's path (no machine paths in the results).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--budget", "16", "--topk", "2", "--max-new-tokens", "6"]


def matrix(backends: list[str]) -> list[list[str]]:
    runs = [["--backend", "torch", "--batch", "1"],                              # every stage the port provides
            ["--backend", "torch", "--batch", "1", "--port-stages", "compile"]]  # its compile on ddcheck's tree
    for be in backends:
        for bs in ("1", "2"):
            for graph in ("--no-cuda-graph", "--cuda-graph"):
                runs.append(["--backend", be, "--batch", bs, graph, "--port-stages", "build,compile"])
    return runs


def one(path: str, extra: list[str], device: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.jsonl"
        cmd = [sys.executable, "-m", "harness", "run", "--impl", f"dflash-worker-tree:{path}", *BASE, *extra,
               "--device", device, "--out", str(out)]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        summary = next((json.loads(x) for x in (out.read_text().splitlines() if out.exists() else [])
                        if json.loads(x)["kind"] == "summary"), None)
    row = {"command": "ddcheck run --impl dflash-worker-tree:PATH " + " ".join(BASE + extra + ["--device", device]),
           "exit": p.returncode,
           "stderr_last": (p.stderr.strip().splitlines() or [""])[-1].replace(path, "PATH").replace(str(out), "OUT")}
    if summary:
        port = summary.get("port") or {}
        row.update(verdict=summary.get("verdict"), nodes_checked=summary.get("nodes_checked"),
                   divergent_nodes=summary.get("divergent_nodes"), audit_errors=summary.get("audit_errors"),
                   fault_class=summary.get("fault_class"), first_finding=summary.get("first_finding"),
                   explanation=(summary.get("explanation") or "")[:240],
                   crash=(summary.get("crash") or {}).get("where", "").replace(path, "PATH") or None,
                   lineage=port.get("lineage"))
        if row["lineage"]:
            row["lineage"]["checkout"] = "PATH"
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("label")
    ap.add_argument("--backends", default="torch,sglang-triton,sglang-serving-dflash")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    rows = []
    dest = ROOT / "benchmarks" / "results" / f"ports-worker-{a.label}.json"
    for extra in matrix(a.backends.split(",")):
        rows.append(one(a.path, extra, a.device))
        r = rows[-1]
        print(f"exit {r['exit']}  {r.get('verdict') or '-':8} {r.get('divergent_nodes')}/{r.get('nodes_checked')}  "
              f"{r.get('fault_class') or r.get('crash') or r['stderr_last'][:90]}  | {' '.join(extra)}", flush=True)
        dest.write_text(json.dumps({"label": a.label, "runs": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
