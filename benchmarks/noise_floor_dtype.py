"""The noise-floor ratio of one dtype on a preset: fault-free ratios e_engine / e_twin
over a few settings, and the one-key leaks' smallest ratio on the rows they touch.
What the multiplier of a dtype (harness/verdict/noise_floor.py) is chosen from.

    python benchmarks/noise_floor_dtype.py --dtype float16 --backend torch --device cpu --out DIR
    python benchmarks/noise_floor_dtype.py --summarize RUN.jsonl [RUN.jsonl ...] --out DIR   # records of device runs
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

FREE = [dict(batch=4), dict(batch=4, topk=4), dict(budget=32, topk=4, batch=2), dict(batch=2, prompt_lens=(200, 300))]
LEAKS = [("last-row-sees-one-padding", {}), ("one-sibling-visible", dict(topk=4)), ("one-ancestor-hidden", {}),
         ("last-row-sees-one-padding", dict(prompt_lens=(300,)))]


def quantiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    n = len(xs)
    return {"n": n, "p50": xs[n // 2], "p99": xs[int(n * 0.99)], "p999": xs[int(n * 0.999)], "max": xs[-1]}


def node_rows(lines) -> list[dict]:
    recs = [json.loads(x) for x in lines]
    return [r for r in recs if r.get("kind") == "node" and not r["is_padding"] and r.get("noise_ratio") is not None]


def measure(dtype: str, backend: str, device: str) -> dict:
    from noise_floor_study import judge, leak_rows
    from harness.check.prepare import prepare
    from harness.engine.settings import RunSettings
    base = dict(backend=backend, dtype=dtype, device=device, stop_after=0)
    out, ratios = {"free": [], "leaks": []}, []
    for kw in FREE:
        row, recs = judge(prepare(RunSettings(max_new_tokens=16, **base, **kw)))
        nodes = node_rows(json.dumps(r) for r in recs)
        ratios += [r["noise_ratio"] for r in nodes]
        out["free"].append({"setting": row["setting"], "passed": row["passed"], "max_ratio": row["max_noise_ratio"],
                            "max_rel_err": row["max_rel_err"]})
        print(f"free {kw}: passed {row['passed']} max ratio {row['max_noise_ratio']:.3f}", flush=True)
    out["free_ratio"] = quantiles(ratios)
    for leak, kw in LEAKS:
        row, recs = judge(prepare(RunSettings(max_new_tokens=8, **base, **kw)), leak=leak)
        hit = leak_rows(leak, recs)
        low = min(r["noise_ratio"] for r in hit)
        out["leaks"].append({"leak": leak, "setting": row["setting"], "rows": len(hit), "min_ratio": low})
        print(f"leak {leak} {kw}: {len(hit)} rows, min ratio {low:.2f}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--summarize", nargs="*", type=Path, help="node records (.jsonl or .jsonl.gz) to summarize")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if a.summarize:
        runs = []
        for path in a.summarize:
            with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as f:
                nodes = node_rows(f)
            runs.append({"setting": nodes[0]["setting"], "nodes": len(nodes),
                         "max_ratio": max(r["noise_ratio"] for r in nodes),
                         "max_rel_err": max(r["rel_err"] for r in nodes)})
            print(f"{path.name}: {len(nodes)} nodes, max ratio {runs[-1]['max_ratio']:.3f}")
        result = {"runs": runs, "free_ratio": quantiles([r["noise_ratio"] for p in a.summarize
                                                         for r in node_rows(gzip.open(p, "rt") if p.suffix == ".gz"
                                                                            else open(p))])}
        name = "noise-floor-summary.json"
    else:
        result = {"dtype": a.dtype, "backend": a.backend, "device": a.device, **measure(a.dtype, a.backend, a.device)}
        name = f"noise-floor-{a.dtype}-{a.backend}-{a.device}.json"
    print(json.dumps(result["free_ratio"]))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / name).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
