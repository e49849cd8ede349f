"""Out-of-sample check of the trained-model verdict: prompts written after the
rule was fit (benchmarks/prompts-holdout/, none of them in the study's
benchmarks/prompts/) run through the issue's command, each prompt in its own
process, and the summary records tabled.

  python3 benchmarks/verdict_holdout.py --device cuda --out DIR [--jobs 8]
      [--model smollm2-135m] [--settings bf16-eager,bf16-graph,fp16-graph]

Prints a table (setting, prompt, exit, verdict, max noise ratio against its
bound, excess p) and writes DIR/verdict-holdout-<device>.json. A fault-free
run that exits 1 is a false alarm; `--fault padded-kv-visible` runs (one per
setting, first prompt) must exit 1.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETTINGS = {
    "bf16-eager": ["--dtype", "bfloat16", "--no-cuda-graph"],
    "bf16-graph": ["--dtype", "bfloat16", "--cuda-graph"],
    "fp16-eager": ["--dtype", "float16", "--no-cuda-graph"],
    "fp16-graph": ["--dtype", "float16", "--cuda-graph"],
}


def one_run(model: str, device: str, setting: str, prompt: Path, fault: str | None, out: Path) -> dict:
    tag = f"{setting}-{prompt.stem}" + (f"-{fault}" if fault else "")
    records = out / f"{tag}.jsonl"
    cmd = [sys.executable, "-m", "harness", "run", "--model", model, "--budget", "16", "--topk", "1",
           *SETTINGS[setting], "--device", device, "--prompt-file", str(prompt), "--out", str(records)]
    if fault:
        cmd += ["--fault", fault]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    row = {"setting": setting, "prompt": prompt.stem, "fault": fault, "exit": proc.returncode}
    summary = next((json.loads(line) for line in reversed(records.read_text().splitlines())
                    if '"kind": "summary"' in line), None) if records.exists() else None
    if summary is None:
        row["error"] = (proc.stderr or proc.stdout)[-400:]
        return row
    rule = summary.get("noise_rule") or {}
    row.update(verdict=summary["verdict"], nodes=summary.get("nodes_checked"),
               divergent=summary.get("divergent_nodes"), max_noise_ratio=summary.get("max_noise_ratio"),
               multiplier=rule.get("multiplier"), excess=summary.get("noise_excess"),
               drift=summary.get("noise_drift"), backend=summary["settings"].get("backend"))
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--settings", default="bf16-eager,bf16-graph,fp16-graph")
    ap.add_argument("--prompts", type=Path, default=HERE / "prompts-holdout")
    args = ap.parse_args()
    settings = args.settings.split(",")
    if unknown := [s for s in settings if s not in SETTINGS]:
        ap.error(f"unknown settings {unknown}; known: {', '.join(SETTINGS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = sorted(args.prompts.glob("*.txt"))
    jobs = [(s, p, None) for s in settings for p in prompts] + [(s, prompts[0], "padded-kv-visible") for s in settings]
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda j: one_run(args.model, args.device, *j, args.out), jobs))
    for r in rows:
        ex = r.get("excess") or {}
        print(f"{r['setting']:11} {r['prompt']:16} {r['fault'] or '-':18} exit {r['exit']} "
              f"{r.get('verdict', 'ERROR'):8} ratio {r.get('max_noise_ratio') or 0:.2f} / {r.get('multiplier') or 0:.2f} "
              f"excess {ex.get('above', '-')}/{ex.get('nodes', '-')} p {ex.get('p', '-')}" + (f" {r['error']}" if 'error' in r else ""))
    free = [r for r in rows if r["fault"] is None]
    alarms = sum(r["exit"] != 0 for r in free)
    caught = sum(r["exit"] == 1 for r in rows if r["fault"])
    print(f"fault-free: {alarms} of {len(free)} runs exit non-zero; padded-kv-visible caught {caught} of {len(rows) - len(free)}")
    path = args.out / f"verdict-holdout-{args.device}.json"
    path.write_text(json.dumps({"model": args.model, "device": args.device, "rows": rows,
                                "false_alarms": alarms, "fault_free_runs": len(free), "faults_caught": caught}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
