"""The default gate (cases/gate.toml) on the process pool and on Ray with 1,
2 and 4 local workers: wall time of each, and whether the verdicts, the
records (run ids and timings aside) and the JUnit (times aside) are the
pool's. Prints a table; writes benchmarks/results/ray-gate-cpu.json.

    python benchmarks/ray_gate.py [--workers 1,2,4] [--pool-jobs N] [--case cases/gate.toml] [--device cpu]

Needs Ray (pip install 'ddcheck[ray]'). Each run is `python -m harness gate`
in a child process, so each Ray run starts and stops its own local cluster."""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.check.records import same_run_to_run

ROOT = Path(__file__).resolve().parents[1]


def gate(case: str, device: str, work: Path, name: str, flags: list[str]) -> dict:
    out, junit, js = work / f"{name}.jsonl", work / f"{name}.xml", work / f"{name}.json"
    cmd = [sys.executable, "-m", "harness", "gate", case, "--device", device, "--out", str(out),
           "--junit", str(junit), "--json", str(js), *flags]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode not in (0, 1):
        raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    verdicts = [(v["name"], v["passed"], v["skipped"]) for c in json.loads(js.read_text())["cases"]
                for v in c["verdicts"]]
    records = [same_run_to_run(json.loads(ln)) for ln in out.read_text().splitlines()]
    return {"name": name, "command": " ".join(["ddcheck", *cmd[3:]]).replace(str(work), "$WORK"), "exit": proc.returncode,
            "wall_s": round(wall, 1), "verdicts": verdicts, "records": records,
            "junit": re.sub(r' (time|timestamp)="[^"]*"', "", junit.read_text()),
            "last_line": proc.stdout.strip().splitlines()[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="1,2,4", help="Ray local workers to try, comma list")
    ap.add_argument("--pool-jobs", type=int, default=os.cpu_count() or 1, help="the pool's --jobs")
    ap.add_argument("--case", default="cases/gate.toml")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/ray-gate-cpu.json")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pool = gate(a.case, a.device, work, "pool", ["--jobs", str(a.pool_jobs)])
        runs = [pool] + [gate(a.case, a.device, work, f"ray-{n}", ["--executor", "ray", "--workers", str(n)])
                         for n in map(int, a.workers.split(","))]
    for r in runs[1:]:   # what differs from the pool, first record only (keys), for the table's reader
        diff = next(((i, sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k)))
                     for i, (x, y) in enumerate(zip(pool["records"], r["records"])) if x != y), None)
        r["first_record_diff"] = diff and {"line": diff[0], "kind": pool["records"][diff[0]].get("kind"),
                                           "keys": diff[1]}
    rows = [{"executor": r["name"], "wall_s": r["wall_s"], "exit": r["exit"], "settings": len(r["verdicts"]),
             "failing": sum(not p for _, p, _ in r["verdicts"]),
             "same_verdicts": r["verdicts"] == pool["verdicts"], "same_records": r["records"] == pool["records"],
             "same_junit": r["junit"] == pool["junit"], "command": r["command"], "last_line": r["last_line"],
             "first_record_diff": r.get("first_record_diff")}
            for r in runs]
    print(f"{'executor':10} {'wall s':>7} {'exit':>4} {'settings':>8} {'failing':>7}  same verdicts/records/junit")
    for r in rows:
        print(f"{r['executor']:10} {r['wall_s']:7.1f} {r['exit']:4d} {r['settings']:8d} {r['failing']:7d}  "
              f"{r['same_verdicts']}/{r['same_records']}/{r['same_junit']}")
    import ray
    doc = {"case": a.case, "device": a.device, "cpus": os.cpu_count(), "machine": platform.machine(),
           "python": platform.python_version(), "ray": ray.__version__,
           "load_avg_at_end": os.getloadavg(), "runs": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
