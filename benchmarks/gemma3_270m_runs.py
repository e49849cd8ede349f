"""The trained Gemma 3 270M (`--model gemma3-270m`, sliding window 512 on 15
of its 18 layers) through `ddcheck run` on the CPU: float32 and bfloat16,
fault-free and with `--fault padded-kv-visible`, on the default text prompt
(prefix 6 to 27 tokens: the window never binds) and on a 745-token prose
prompt (benchmarks/prompts/long-harbour.txt: every sliding layer's window
starts inside the prefix, one key later for each depth of the tree, so it
crosses the tree's rows), where `--fault swa-window-ignored` is run too.

    .venv/bin/python benchmarks/gemma3_270m_runs.py [--slice short|long|all] [--fault NAME|none] [--out-dir DIR]

Writes benchmarks/results/gemma3-270m-<slice>.json: per run its command,
exit code, wall time and the summary's figures; prints a table. Needs the
gemma3-270m package (`make setup`); each run takes minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = ["run", "--model", "gemma3-270m", "--budget", "16", "--topk", "1", "--no-cuda-graph", "--backend", "torch"]
SLICES = {"short": [], "long": ["--prompt-file", "benchmarks/prompts/long-harbour.txt", "--max-new-tokens", "16"]}
RUNS = [("float32", None, 0), ("bfloat16", None, 0), ("float32", "padded-kv-visible", 1),
        ("bfloat16", "padded-kv-visible", 1)]
# past the window, a verify that never fills the sliding layers' window metadata (SGLang #22679) must show
SLICE_RUNS = {"short": RUNS, "long": RUNS + [("float32", "swa-window-ignored", 1)]}
FIELDS = ("verdict", "verdict_rule", "steps", "nodes_checked", "divergent_nodes", "max_rel_err", "max_twin_err",
          "max_noise_ratio", "noise_drift", "stream_mismatches", "prefix_len_min", "prefix_len_max",
          "mean_accepted_length", "engine_s_per_step", "oracle_s_per_step")


def run_one(extra: list[str], dtype: str, fault: str | None) -> dict:
    args = BASE + extra + ["--dtype", dtype] + (["--fault", fault] if fault else [])
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "run.jsonl"
        cmd = [sys.executable, "-m", "harness", *args, "--out", str(out)]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - start
        summary = {}
        if out.exists():
            for line in out.read_text().splitlines():
                rec = json.loads(line)
                if rec.get("kind") == "summary":
                    summary = rec
    row = {"command": "ddcheck " + shlex.join(args), "dtype": dtype, "fault": fault, "exit_code": proc.returncode,
           "wall_s": round(wall, 1), **{k: summary.get(k) for k in FIELDS}}
    first = summary.get("first")
    row["first_divergence"] = first if isinstance(first, (dict, type(None))) else str(first)
    if proc.returncode not in (0, 1):
        row["stderr_tail"] = proc.stderr[-400:]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slice", choices=[*SLICES, "all"], default="all")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--fault", default=None, help="only the runs with this fault ('none': the fault-free ones); "
                    "their rows replace the same commands' rows in an existing JSON")
    a = ap.parse_args()
    for name in SLICES if a.slice == "all" else [a.slice]:
        out = a.out_dir / f"gemma3-270m-{name}.json"
        kept = json.loads(out.read_text())["runs"] if a.fault is not None and out.exists() else []
        rows = []
        for dtype, fault, want in SLICE_RUNS[name]:
            if a.fault is not None and (fault or "none") != a.fault:
                continue
            row = run_one(SLICES[name], dtype, fault)
            row["expected_exit_code"] = want
            rows.append(row)
            print(f"{name:5} {dtype:8} {fault or '-':18} exit {row['exit_code']} (want {want}) "
                  f"err {row['max_rel_err']} ratio {row['max_noise_ratio']} prefix {row['prefix_len_min']}.."
                  f"{row['prefix_len_max']} {row['wall_s']} s", flush=True)
            new = {r["command"] for r in rows}   # written after each run: a run cut short keeps the ones before
            doc = {"model": "gemma3-270m", "slice": name, "device": "cpu (2 cores, shared)", "window": 512,
                   "runs": [r for r in kept if r["command"] not in new] + rows}
            a.out_dir.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(doc, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
