"""The default gate (cases/gate.toml) on the process pool and on Ray with 1,
2 and 4 local workers: wall time of each, and whether the verdicts, the
records, the JUnit and the HTML report are the pool's (what two runs must
agree on: same_run_to_run, junit_run_to_run, page_run_to_run). Prints a
table; writes benchmarks/results/ray-gate-cpu.json.

    python benchmarks/ray_gate.py [--workers 1,2,4] [--pool-jobs N] [--pool-twice] [--case cases/gate.toml]
                                  [--matrix LABEL] [--device cpu]

--matrix general runs only the case's matrix of that label (its prompts, no
other matrix, no faults): the 48 settings of the default gate's general matrix.

Needs Ray (pip install 'ddcheck[ray]'). Each run is `python -m harness gate`
in a child process, so each Ray run starts and stops its own local cluster.
The records carry the checkout's commit, so the checkout must not change
while this runs (a commit, a checkout, an edit): its fingerprint (commit and
a hash of the uncommitted changes) is taken before and after each run, and a
change stops the comparison, flags the JSON and exits 1. Run it from a clone
that nothing else touches."""
from __future__ import annotations

import argparse
import hashlib
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
from harness.report.html import page_run_to_run
from harness.workflows.gate import junit_run_to_run

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> bytes:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, check=True).stdout


def checkout() -> dict:
    """The checkout the gate runs: HEAD's commit and a hash of what differs from it (tracked changes and
    untracked files git does not ignore); None outside a git checkout."""
    try:
        head = _git("rev-parse", "HEAD").decode().strip()
        h = hashlib.sha256(_git("diff", "HEAD", "--binary"))
        for name in sorted(_git("ls-files", "--others", "--exclude-standard", "-z").split(b"\0")):
            if name and (ROOT / name.decode()).is_file():
                h.update(name + b"\0" + (ROOT / name.decode()).read_bytes())
        return {"commit": head, "changes": h.hexdigest()[:16]}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "changes": None}


def gate(case: str, device: str, work: Path, name: str, flags: list[str]) -> dict:
    out, junit, js, page = (work / f"{name}.{ext}" for ext in ("jsonl", "xml", "json", "html"))
    cmd = [sys.executable, "-m", "harness", "gate", case, "--device", device, "--out", str(out),
           "--junit", str(junit), "--json", str(js), "--html", str(page), *flags]
    before = checkout()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = checkout()
    if proc.returncode not in (0, 1):
        raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    verdicts = [(v["name"], v["passed"], v["skipped"]) for c in json.loads(js.read_text())["cases"]
                for v in c["verdicts"]]
    records = [same_run_to_run(json.loads(ln)) for ln in out.read_text().splitlines()]
    return {"name": name, "command": " ".join(["ddcheck", *cmd[3:]]).replace(str(work), "$WORK"),
            "exit": proc.returncode, "wall_s": round(wall, 1), "verdicts": verdicts, "records": records,
            "junit": junit_run_to_run(junit.read_text()), "html": page_run_to_run(page.read_text()),
            "last_line": proc.stdout.strip().splitlines()[-1].replace(str(work), "$WORK"), "checkout": before,
            "checkout_changed": before != after and after}


def one_matrix(case: Path, label: str, into: Path) -> Path:
    """The case file cut to its prompts and the [[matrix]] tables labelled `label` (no faults)."""
    head, *tables = re.split(r"(?m)^(?=\[\[)", case.read_text())
    keep = [t for t in tables if t.startswith("[[prompts]]")
            or (t.startswith("[[matrix]]") and re.search(rf'(?m)^label\s*=\s*"{re.escape(label)}"', t))]
    if not any(t.startswith("[[matrix]]") for t in keep):
        raise SystemExit(f"{case}: no [[matrix]] labelled {label!r}")
    out = into / f"{case.stem}-{label}.toml"
    out.write_text(head + "".join(keep))
    return out


def first_record_diff(pool: dict, run: dict) -> dict | None:
    """The first record that differs from the pool's: its line, kind and the keys that differ."""
    for i, (x, y) in enumerate(zip(pool["records"], run["records"])):
        if x != y:
            keys = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
            return {"line": i, "kind": x.get("kind"), "keys": keys}
    n, m = len(pool["records"]), len(run["records"])
    return None if n == m else {"line": min(n, m), "kind": None, "keys": ["(record count)"]}


def row(pool: dict, r: dict) -> dict:
    return {"executor": r["name"], "wall_s": r["wall_s"], "exit": r["exit"], "settings": len(r["verdicts"]),
            "failing": sum(not p for _, p, _ in r["verdicts"]),
            **{f"same_{k}": r[k] == pool[k] for k in ("verdicts", "records", "junit", "html")},
            "first_record_diff": first_record_diff(pool, r), "command": r["command"], "last_line": r["last_line"],
            "checkout": r["checkout"], "checkout_changed": r["checkout_changed"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="1,2,4", help="Ray local workers to try, comma list")
    ap.add_argument("--pool-jobs", type=int, default=os.cpu_count() or 1, help="the pool's --jobs")
    ap.add_argument("--pool-twice", action="store_true", help="run the pool a second time: two runs of one executor")
    ap.add_argument("--case", default="cases/gate.toml")
    ap.add_argument("--matrix", help="only the case's matrix of this label (e.g. general), no faults")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/ray-gate-cpu.json")
    a = ap.parse_args()
    pools = [("pool-1", ["--jobs", str(a.pool_jobs)]), ("pool-2", ["--jobs", str(a.pool_jobs)])]
    plan = [pools[0] if a.pool_twice else ("pool", pools[0][1])]
    plan += [(f"ray-{n}", ["--executor", "ray", "--workers", str(n)]) for n in map(int, a.workers.split(","))]
    plan += pools[1:] * a.pool_twice   # last: the executors first where time is short
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        case = str(one_matrix(ROOT / a.case, a.matrix, Path(tmp))) if a.matrix else a.case
        for name, flags in plan:
            runs.append(gate(case, a.device, Path(tmp), name, flags))
            changed = write(a, runs, complete=len(runs) == len(plan))   # the runs so far survive a stop
            if changed:
                print(f"{name}: the checkout changed while the gates ran ({runs[0]['checkout']} -> "
                      f"{runs[-1]['checkout_changed'] or runs[-1]['checkout']}); the records are not comparable, "
                      "stopped", file=sys.stderr)
                break
    print(f"{'executor':10} {'wall s':>7} {'exit':>4} {'settings':>8} {'failing':>7}  same verdicts/records/junit/html")
    for r in (row(runs[0], r) for r in runs):
        print(f"{r['executor']:10} {r['wall_s']:7.1f} {r['exit']:4d} {r['settings']:8d} {r['failing']:7d}  "
              f"{r['same_verdicts']}/{r['same_records']}/{r['same_junit']}/{r['same_html']}")
    print(f"wrote {a.out}")
    if changed:
        raise SystemExit(1)


def write(a: argparse.Namespace, runs: list[dict], complete: bool) -> list[str]:
    """The JSON of the runs so far; the runs during which the checkout changed."""
    import ray
    rows = [row(runs[0], r) for r in runs]
    changed = [r["executor"] for r in rows if r["checkout_changed"] or r["checkout"] != rows[0]["checkout"]]
    doc = {"case": a.case, "matrix": a.matrix, "device": a.device, "cpus": os.cpu_count(), "machine": platform.machine(),
           "python": platform.python_version(), "ray": ray.__version__, "checkout": runs[0]["checkout"],
           "checkout_changed_in": changed, "complete": complete and not changed, "load_avg": os.getloadavg(),
           "runs": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=2) + "\n")
    return changed


if __name__ == "__main__":
    main()
