"""The GPU figures of SGLang's kernel as the system under test, in one process:

1. the fault-free matrix (budget {4,8,16,32} x topk {1,2,4} x graph {on,off}
   x batch {1,4}) with --backend sglang-triton, on CUDA with real CUDA graphs
   (torch.cuda.CUDAGraph in harness/engine/graph.py), verdicts per setting;
2. the distribution of per-node relative error against the float64 oracle
   (max |engine - ref| / max |ref| over the vocabulary, one value per real
   node) over that matrix: percentiles, max, a log10 histogram; the same for a
   float32 baseline on a few settings;
3. padded-kv-visible caught, with its error next to the fault-free maximum;
4. time per verify step, eager against graph (benchmarks/bench_backends.py).

    python3 benchmarks/gpu_figures.py --device cuda --dtype bfloat16 --out "$OUT"

writes gpu-figures.json into --out (committed as benchmarks/results/gpu-h200.json)
and prints a table. `--quick` runs a tiny version (CPU check of the script)."""
from __future__ import annotations

import argparse
import importlib.metadata as md
import itertools
import json
import math
import platform
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from harness.engine.attn.sglang_triton import prepare_interpreter, use_interpreter  # noqa: E402

MATRIX = list(itertools.product((4, 8, 16, 32), (1, 2, 4), (False, True), (1, 4)))
QUICK_MATRIX = [(16, 1, False, 1), (8, 2, True, 4)]
BASELINE = [(16, 1, False, 1), (16, 4, True, 4), (32, 2, False, 4), (8, 2, True, 1)]
FAULT_SETTINGS = [(16, 1, False, 1), (16, 1, True, 4), (32, 1, True, 1)]
PERCENTILES = (50, 90, 99, 99.9, 100)


def run_setting(budget, topk, graph, batch, *, device, dtype, max_new_tokens, fault=None) -> tuple[dict, list[float]]:
    from harness.check.differential import check
    from harness.check.prepare import prepare
    from harness.check.records import RecordWriter
    from harness.engine.settings import RunSettings
    s = RunSettings(budget=budget, topk=topk, cuda_graph=graph, batch=batch, backend="sglang-triton",
                    device=device, dtype=dtype, max_new_tokens=max_new_tokens, fault=fault)
    writer = RecordWriter(None)
    t0 = time.perf_counter()
    summary = check(prepare(s), writer, localize=False)
    wall = time.perf_counter() - t0
    records = [json.loads(line) for line in writer.lines]
    errs = [r["rel_err"] for r in records if r["kind"] == "node" and r["rel_err"] is not None]
    f = summary.first
    row = dict(budget=budget, topk=topk, cuda_graph=graph, batch=batch, dtype=dtype, fault=fault,
               passed=summary.passed, steps=summary.steps, nodes=summary.nodes_checked,
               divergent_nodes=summary.divergent_nodes, near_ties=summary.near_ties,
               stream_mismatches=summary.stream_mismatches, accept_mismatches=summary.accept_mismatches,
               max_rel_err=summary.max_rel_err, notes=summary.notes, wall_s=round(wall, 2),
               first=None if f is None else dict(step=f.step, request=f.request, node=f.node, depth=f.depth,
                                                   rel_err=f.rel_err, what=f.what),
               command=s.command())
    return row, errs


def distribution(errs: list[float]) -> dict:
    if not errs:
        return {}
    a = np.asarray(errs, dtype=np.float64)
    edges = list(range(-9, 1))  # log10 bins [1e-9, 1e0]
    hist = np.histogram(np.log10(np.maximum(a, 1e-12)), bins=[-math.inf] + edges + [math.inf])[0]
    return dict(count=int(a.size), mean=float(a.mean()),
                percentiles={f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES},
                log10_histogram=dict(edges=edges, counts=hist.tolist()))


def section(name: str, out: dict, fn) -> None:
    """Run one part; a failure is recorded, the other parts still run."""
    t0 = time.perf_counter()
    try:
        out[name] = fn()
    except Exception:  # noqa: BLE001
        out[name] = dict(error=traceback.format_exc(limit=8))
        print(out[name]["error"], file=sys.stderr, flush=True)
    out.setdefault("section_wall_s", {})[name] = round(time.perf_counter() - t0, 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="two settings, few reps: check the script end to end")
    args = ap.parse_args(argv)
    prepare_interpreter()
    torch.set_num_threads(1)
    dev, dt, mnt = args.device, args.dtype, args.max_new_tokens
    out_path = args.out / "gpu-figures.json"
    out: dict = dict(command="python3 benchmarks/gpu_figures.py " + " ".join(argv or sys.argv[1:]),
                     environment=environment(dev))

    def save() -> None:
        args.out.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(out, indent=1) + "\n")

    matrix = QUICK_MATRIX if args.quick else MATRIX
    all_errs: list[float] = []
    graph_errs: list[float] = []

    def fault_free():
        rows = []
        for m in matrix:
            row, errs = run_setting(*m, device=dev, dtype=dt, max_new_tokens=mnt)
            all_errs.extend(errs)
            if m[2]:
                graph_errs.extend(errs)
            row["rel_err_p99"] = float(np.percentile(errs, 99)) if errs else None
            rows.append(row)
            print(f"{dt} b{m[0]} k{m[1]} {'graph' if m[2] else 'eager'} bs{m[3]}: passed {row['passed']} "
                  f"nodes {row['nodes']} max {row['max_rel_err']:.2e} ({row['wall_s']} s)", flush=True)
        return dict(settings=rows, all_passed=all(r["passed"] for r in rows),
                    per_node_rel_err=distribution(all_errs),
                    per_node_rel_err_graph=distribution(graph_errs))
    section("fault_free_matrix", out, fault_free)
    save()

    def baseline():
        errs, rows = [], []
        for m in (QUICK_MATRIX[:1] if args.quick else BASELINE):
            row, e = run_setting(*m, device=dev, dtype="float32", max_new_tokens=mnt)
            errs.extend(e)
            rows.append(row)
        return dict(settings=rows, per_node_rel_err=distribution(errs))
    section("float32_baseline", out, baseline)
    save()

    def faults():
        rows = []
        for m in (FAULT_SETTINGS[:1] if args.quick else FAULT_SETTINGS):
            row, errs = run_setting(*m, device=dev, dtype=dt, max_new_tokens=mnt, fault="padded-kv-visible")
            row["caught"] = not row["passed"]
            rows.append(row)
            print(f"padded-kv-visible b{m[0]} k{m[1]} {'graph' if m[2] else 'eager'} bs{m[3]}: caught "
                  f"{row['caught']} first {row['first']}", flush=True)
        return dict(settings=rows, all_caught=all(r["caught"] for r in rows))
    section("fault_padded_kv_visible", out, faults)
    save()

    def timing():
        from bench_backends import SHAPES, time_verify
        rows = []
        for budget, topk, batch in (SHAPES[:1] if args.quick else SHAPES):
            for graph in (False, True):
                rows.append(time_verify("sglang-triton", budget, topk, batch, graph, dev, dt,
                                        2 if args.quick else args.reps))
        return rows
    section("verify_step_time", out, timing)
    out["tolerance"] = tolerance_summary(out, dt)
    save()
    print_table(out)
    print(f"wrote {out_path}")
    return 0


def tolerance_summary(out: dict, dtype: str) -> dict:
    from harness.verdict.tolerance import rel_tolerance
    ff = out.get("fault_free_matrix", {}).get("per_node_rel_err", {})
    faults = out.get("fault_padded_kv_visible", {}).get("settings", [])
    fault_errs = [r["first"]["rel_err"] for r in faults if r.get("first") and r["first"].get("rel_err")]
    noise = ff.get("percentiles", {}).get("p100")
    return dict(dtype=dtype, current_rel_tol=rel_tolerance(dtype), fault_free_max=noise,
                fault_first_rel_err_min=min(fault_errs) if fault_errs else None,
                headroom_over_noise=(rel_tolerance(dtype) / noise) if noise else None)


def environment(device: str) -> dict:
    def version(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None
    env = dict(python=platform.python_version(), torch=torch.__version__, triton=version("triton"),
               sglang=version("sglang"), device=device, interpreter=use_interpreter())
    if device.startswith("cuda"):
        env.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda)
    return env


def print_table(out: dict) -> None:
    ff = out.get("fault_free_matrix", {})
    d = ff.get("per_node_rel_err", {})
    if d:
        p = d["percentiles"]
        print(f"\nper-node rel. error, fault-free matrix ({d['count']} nodes): "
              + "  ".join(f"{k} {v:.2e}" for k, v in p.items()))
        print(f"settings passed: {sum(r['passed'] for r in ff['settings'])}/{len(ff['settings'])}")
    b = out.get("float32_baseline", {}).get("per_node_rel_err", {})
    if b:
        print(f"float32 baseline ({b['count']} nodes): p50 {b['percentiles']['p50']:.2e} max {b['percentiles']['p100']:.2e}")
    for r in out.get("fault_padded_kv_visible", {}).get("settings", []):
        print(f"padded-kv-visible b{r['budget']} k{r['topk']} {'graph' if r['cuda_graph'] else 'eager'} "
              f"bs{r['batch']}: caught {r['caught']}, first {r['first']}")
    t = out.get("verify_step_time")
    if isinstance(t, list):
        print(f"\n{'budget':>6s} {'topk':>4s} {'batch':>5s} {'mode':>5s} {'ms/step':>9s}")
        for r in t:
            print(f"{r['budget']:6d} {r['topk']:4d} {r['batch']:5d} {'graph' if r['cuda_graph'] else 'eager':>5s} "
                  f"{r['sec_per_step'] * 1e3:9.3f}")
    print("tolerance:", out.get("tolerance"))


if __name__ == "__main__":
    sys.exit(main())
