"""Tensor-parallel runs of the engine under test (issue 22 point 1): --tp 2 and --tp 4, fault-free and
with each TP-only fault and padded-kv-visible, through the differential check; one row per run.

    .venv/bin/python benchmarks/tp_matrix.py                       # CPU (gloo): results/tp-cpu.json
    .venv/bin/python benchmarks/tp_matrix.py --device cuda --out benchmarks/results/tp-nccl.json   # NCCL, >= 4 GPUs

Wall seconds include spawning the ranks (the first run of a process also starts the forkserver); the
per-step engine time is the check's own figure (spawning lands in step 0's). No assertions: the table
says whether each fault was caught and named by its catalog class."""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.check.differential import check  # noqa: E402
from harness.check.prepare import prepare  # noqa: E402
from harness.check.records import RecordWriter  # noqa: E402
from harness.engine.settings import RunSettings  # noqa: E402
from harness.faults.registry import catalog, why_cannot_show  # noqa: E402

FAULTS = (None, "padded-kv-visible", "tp-stale-mask", "tp-shifted-kv-indices", "tp-kv-heads-sharded")


def one_run(s: RunSettings) -> dict:
    t0 = time.perf_counter()
    summary = check(prepare(s), RecordWriter(None))
    expected = catalog()[s.fault].expected_class if s.fault else None
    return {"tp": s.tp, "fault": s.fault, "model": s.model, "device": s.device, "dtype": s.dtype,
            "verdict": summary.verdict, "fault_class": summary.fault_class, "expected_class": expected,
            "ok": (summary.passed if s.fault is None else (not summary.passed and summary.fault_class == expected)),
            "steps": summary.steps, "engine_s_per_step": summary.engine_s_per_step,
            "oracle_s_per_step": summary.oracle_s_per_step, "wall_s": round(time.perf_counter() - t0, 2),
            "command": s.command()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--tp", default="1,2,4", help="comma list of rank counts (1: the one-process baseline)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tp-cpu.json")
    a = ap.parse_args()
    rows = []
    for tp in map(int, a.tp.split(",")):
        for fault in FAULTS:
            s = RunSettings(tp=tp, budget=16, topk=1, backend=a.backend, device=a.device, dtype=a.dtype,
                            model=a.model, fault=fault)
            if fault and why_cannot_show(fault, s, 1 << 30):
                continue   # tp-kv-heads-sharded needs more ranks than the model's KV heads
            rows.append(one_run(s))
            r = rows[-1]
            print(f"tp {r['tp']}  {str(r['fault'] or 'fault-free'):24s} {r['verdict']:8s} "
                  f"{str(r['fault_class'] or '-'):18s} ok={r['ok']}  steps {r['steps']}  wall {r['wall_s']:.1f} s  "
                  f"engine {r['engine_s_per_step'] or 0:.3f} s/step", flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"machine": platform.platform(), "python": platform.python_version(),
                                 "runs": rows}, indent=1) + "\n")
    print(f"{sum(r['ok'] for r in rows)}/{len(rows)} ok; wrote {a.out}")


if __name__ == "__main__":
    main()
