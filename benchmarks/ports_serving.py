"""Public ports re-judged through SGLang's serving path: each port's own stages, its
mask (and, where SGLang takes the port's verify input type, its verify input object)
handed to SGLang's TritonAttnBackend by a serving backend, at batch 1 and 2, topk 1
and 2, graphs off and on.

    python benchmarks/ports_serving.py --port LABEL FAMILY:PATH BACKEND [--port ...] [--device cpu]
        [--out benchmarks/results/ports-serving-cpu.json] [--append]

PATH is a checkout (or the port's file) at the commit LABEL names, made outside this
repository (e.g. `git worktree add` of a fetched mirror); BACKEND is sglang-serving
(EAGLE's verify input) or sglang-serving-dflash (DFlash's; a DFlashVerifyInput of the
port's own goes to SGLang as is). Prints a table; commands are recorded with PATH in
place of the checkout's path (no machine paths in the results). One run at a time.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--budget", "16", "--max-new-tokens", "4", "--dtype", "float32"]
SETTINGS = [(bs, topk, graph) for bs in ("1", "2") for topk in ("1", "2") for graph in ("--no-cuda-graph", "--cuda-graph")]


def one(impl: str, path: str, backend: str, bs: str, topk: str, graph: str, device: str) -> dict:
    extra = ["--backend", backend, "--batch", bs, "--topk", topk, graph, "--device", device]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.jsonl"
        cmd = [sys.executable, "-m", "harness", "run", "--impl", impl, *BASE, *extra, "--out", str(out)]
        t0 = time.monotonic()
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        wall = time.monotonic() - t0
        lines = out.read_text().splitlines() if out.exists() else []
        summary = next((json.loads(x) for x in lines if json.loads(x)["kind"] == "summary"), None)
    row = {"command": "ddcheck run --impl " + impl.replace(path, "PATH") + " " + " ".join(BASE + extra),
           "batch": int(bs), "topk": int(topk), "graph": graph == "--cuda-graph", "exit": p.returncode,
           "wall_s": round(wall, 1),
           "stderr_last": (p.stderr.strip().splitlines() or [""])[-1].replace(path, "PATH")}
    if summary:
        port = summary.get("port") or {}
        row.update(verdict=summary.get("verdict"), nodes_checked=summary.get("nodes_checked"),
                   divergent_nodes=summary.get("divergent_nodes"), audit_errors=summary.get("audit_errors"),
                   fault_class=summary.get("fault_class"),
                   first_finding=(summary.get("first_finding") or "")[:200] or None,
                   served_verify_input=port.get("served_verify_input"))
    return row


def cell(r: dict) -> str:
    if r.get("verdict") is None:
        return f"exit {r['exit']}"
    what = "pass" if r["exit"] == 0 else f"exit {r['exit']} {r.get('fault_class') or ''}".strip()
    return f"{what} ({r.get('divergent_nodes')}/{r.get('nodes_checked')})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", nargs=3, action="append", metavar=("LABEL", "FAMILY:PATH", "BACKEND"), required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ports-serving-cpu.json"))
    ap.add_argument("--append", action="store_true", help="add to the ports already in --out")
    args = ap.parse_args()
    out = Path(args.out)
    results = json.loads(out.read_text())["ports"] if args.append and out.exists() else []
    for label, impl, backend in args.port:
        path = impl.split(":", 1)[1]
        rows = [one(impl, path, backend, *s, args.device) for s in SETTINGS]
        results.append({"port": label, "family": impl.split(":", 1)[0], "backend": backend, "runs": rows})
        print(f"{label:34s} {backend:22s} " + " | ".join(
            f"b{r['batch']} k{r['topk']} {'graph' if r['graph'] else 'eager'}: {cell(r)}" for r in rows), flush=True)
        # written after each port: a long study keeps what it measured
        Path(args.out).write_text(json.dumps({"settings": BASE, "device": args.device, "ports": results},
                                             indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
