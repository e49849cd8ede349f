"""The layer-streamed oracle against the whole-model one on a 70B-shaped
checkpoint (Llama-3.1-70B's layer: hidden 8192, 64 query and 8 KV heads of
128, intermediate 28672), random bf16 weights written on the device and cut
to --layers layers (and --vocab rows of vocabulary where the full 128256 do
not fit). Each oracle judges the same `ddcheck run` in a child process of
its own: per-step engine and oracle seconds from the summary, the peak of
float64 weights the oracle holds at once, the process's peak resident
memory and (on CUDA) its peak allocated GPU memory.

    .venv/bin/python benchmarks/streamed_oracle.py --device cpu --layers 1 --steps 3 --vocab 4096
    .venv/bin/python benchmarks/streamed_oracle.py --device cuda --layers 6 --steps 6 --vocab 32768
    .venv/bin/python benchmarks/streamed_oracle.py --device cuda --layers 32 --steps 4 --oracles streamed
    .venv/bin/python benchmarks/streamed_oracle.py --device cpu --presets tiny,small,tiny-deepseek-v3,tiny-kimi-k2

Writes benchmarks/results/streamed-oracle-<device>-<tag>.json (default tag 70b-<layers>l) and prints a
table. With --presets (results in streamed-oracle-<device>.json unless --tag), each
preset (its seeded weights, no checkpoint written here) is judged by both oracles at --batch requests,
and each row carries the streamed/dense ratio of oracle seconds per step.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

FIELDS = ("verdict", "oracle", "oracle_reason", "steps", "nodes_checked", "divergent_nodes", "max_rel_err",
          "engine_s_per_step", "oracle_s_per_step", "load_s")
GIB = 1 << 30


def child(args: list[str], out: Path) -> None:
    """One `ddcheck run` in this process, the oracle's float64 weights held at once tracked; figures to `out`."""
    import torch

    import reference.model as model
    held = {"peak": 0}
    hold, init = model.DenseLlama.hold, model.DenseLlama.__init__

    def tracked_hold(self, weights):   # the streamed oracle: one layer, the final norm, a vocabulary slice
        hold(self, weights)
        held["peak"] = max(held["peak"], sum(t.numel() * t.element_size() for t in weights.values()))

    def tracked_init(self, *a, **k):   # the dense oracle: every tensor (a tied head shares the embedding's)
        init(self, *a, **k)
        unique = {t.data_ptr(): t.numel() * t.element_size() for t in self.w.values()}
        held["peak"] = max(held["peak"], sum(unique.values()))
    model.DenseLlama.hold, model.DenseLlama.__init__ = tracked_hold, tracked_init
    from harness.cli import _register, app
    _register()
    started = time.perf_counter()
    try:
        code = app(args, standalone_mode=False)
    except SystemExit as e:
        code = e.code
    figures = {"exit": code, "wall_s": round(time.perf_counter() - started, 2),
               "oracle_weights_peak_gib": held["peak"] / GIB,
               "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB}
    if torch.cuda.is_available():
        figures["cuda_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
    out.write_text(json.dumps(figures))


def run_oracle(oracle: str, a, ckpt: Path | str, work: Path) -> dict:
    records, figures = work / f"{oracle}.jsonl", work / f"{oracle}.json"
    args = ["run", "--model", str(ckpt), "--device", a.device, "--oracle", oracle, "--oracle-device", a.device,
            "--dtype", "bfloat16", "--budget", str(a.budget), "--topk", str(a.topk), "--no-cuda-graph",
            "--batch", str(a.batch), "--max-new-tokens", str(a.steps), "--drafter", "noisy", "--stop-after", "0",
            "--out", str(records)]
    if a.backend:
        args[1:1] = ["--backend", a.backend]   # before --out: the recorded command leaves the records' path out
    proc, killed = subprocess.Popen([sys.executable, __file__, "--child", str(figures), "--", *args], cwd=ROOT), None
    try:
        proc.wait(timeout=a.run_timeout)
    except subprocess.TimeoutExpired:   # a signal first: a run stopped by one may still write its records
        killed = f"stopped after --run-timeout {a.run_timeout} s"
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    command = " ".join(args[:-2]).replace(str(ckpt), "CHECKPOINT") if isinstance(ckpt, Path) else " ".join(args[:-2])
    row = {"oracle_asked": oracle, "command": "ddcheck " + command, "killed": killed,
           **(json.loads(figures.read_text()) if figures.exists() else {})}
    lines = records.read_text().splitlines() if records.exists() else []
    summary = json.loads(lines[-1]) if lines and '"kind": "summary"' in lines[-1] else {}
    row.update({k: summary.get(k) for k in FIELDS})
    row["node_records"] = sum('"kind": "node"' in ln for ln in lines)   # what a killed run judged before it ended
    return row


def write_results(out: Path, header: dict, rows: list[dict]) -> None:
    """The results file as it stands (written after every run: a killed script leaves the runs before)."""
    out.write_text(json.dumps({**header, "command": " ".join(["python", "benchmarks/streamed_oracle.py",
                                                              *sys.argv[1:]]), "runs": rows}, indent=1))


def run_presets(a, out: Path) -> list[dict]:
    """Both oracles on each preset of --presets, --repeats times (the order alternating); each row with
    its preset's streamed/dense ratio of the median oracle seconds per step."""
    rows, header = [], {"presets": a.presets.split(","), "steps": a.steps, "budget": a.budget, "topk": a.topk,
                        "batch": a.batch, "repeats": a.repeats}
    for preset in a.presets.split(","):
        runs = []
        for r in range(a.repeats):
            with tempfile.TemporaryDirectory(prefix="ddcheck-streamed-") as tmp:
                for o in (("dense", "streamed") if r % 2 == 0 else ("streamed", "dense")):
                    runs.append(run_oracle(o, a, preset, Path(tmp)))
        per_step = {o: statistics.median(x["oracle_s_per_step"] for x in runs if x["oracle_asked"] == o
                                         and x["oracle_s_per_step"]) for o in ("dense", "streamed")}
        ratio = per_step["streamed"] / per_step["dense"]
        rows += [{"preset": preset, **x, "median_oracle_s_per_step": per_step[x["oracle_asked"]],
                  "streamed_over_dense": ratio} for x in runs]
        print(f"{preset:18} dense {per_step['dense']:.4f} s/step  streamed {per_step['streamed']:.4f} s/step  "
              f"ratio {ratio:.2f}  verdicts {sorted({x['verdict'] for x in runs})}", flush=True)
        write_results(out, header, rows)
    return rows


def main() -> None:
    if "--child" in sys.argv:
        at = sys.argv.index("--child")
        child(sys.argv[at + 3:], Path(sys.argv[at + 1]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), required=True)
    ap.add_argument("--layers", type=int, default=1, help="decoder layers of the 70B shape kept")
    ap.add_argument("--presets", default=None, help="comma list of presets judged by both oracles instead")
    ap.add_argument("--batch", type=int, default=1, help="requests per step")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each oracle on each preset (the median kept)")
    ap.add_argument("--steps", type=int, default=4, help="--max-new-tokens of each run (the seeded stand-in drafter: "
                    "about one token a step on random weights)")
    ap.add_argument("--vocab", type=int, default=128256, help="vocabulary rows kept (the full 128256 by default)")
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--backend", default=None, help="default: torch on the CPU, the run's default on CUDA")
    ap.add_argument("--oracles", default="dense,streamed", help="comma list of dense, streamed")
    ap.add_argument("--checkpoint", type=Path, default=None, help="reuse or write the checkpoint here")
    ap.add_argument("--tag", default="", help="suffix of the results file")
    ap.add_argument("--run-timeout", type=float, default=None, help="seconds each ddcheck run may take (then killed; "
                    "its row says so and counts the node records it wrote)")
    ap.add_argument("--shape", default="llama-3.1-70b",
                    help="benchmarks/random_checkpoint.py's shape (check: a smoke test)")
    a = ap.parse_args()
    if a.layers < 1 or a.steps < 1 or not 2 <= a.vocab <= 128256:
        ap.error("--layers and --steps must be >= 1, --vocab in [2, 128256]")
    if a.backend is None and a.device == "cpu":
        a.backend = "torch"
    tag = a.tag or ("" if a.presets else f"70b-{a.layers}l")   # the presets' file is streamed-oracle-<device>.json
    out = ROOT / "benchmarks" / "results" / f"streamed-oracle-{a.device}{'-' + tag if tag else ''}.json"
    if a.presets:
        run_presets(a, out)
        print(f"wrote {out.relative_to(ROOT)}")
        return
    from random_checkpoint import write
    with tempfile.TemporaryDirectory(prefix="ddcheck-streamed-") as tmp:
        ckpt = a.checkpoint or Path(tmp) / "ckpt"
        started = time.perf_counter()
        if not (ckpt / "config.json").exists():
            write(a.shape, ckpt, a.device, cut={"num_hidden_layers": a.layers, "vocab_size": a.vocab})
        header = {"shape": a.shape, "layers": a.layers, "vocab": a.vocab, "steps": a.steps, "budget": a.budget,
                  "topk": a.topk, "checkpoint_write_s": round(time.perf_counter() - started, 1)}
        rows = []
        write_results(out, header, rows)
        for o in a.oracles.split(","):
            rows.append(run_oracle(o, a, ckpt, Path(tmp)))
            write_results(out, header, rows)
    print(f"{'oracle':9} {'verdict':8} {'steps':>5} {'engine s/step':>13} {'oracle s/step':>13} "
          f"{'weights GiB':>11} {'RSS GiB':>8} {'GPU GiB':>8} {'max rel err':>11}")
    for r in rows:
        print(f"{str(r['oracle']):9} {str(r['verdict']):8} {r['steps'] or 0:>5} {r['engine_s_per_step'] or 0:>13.3f} "
              f"{r['oracle_s_per_step'] or 0:>13.3f} {r.get('oracle_weights_peak_gib', 0):>11.2f} "
              f"{r.get('peak_rss_gib', 0):>8.2f} "
              f"{r.get('cuda_peak_allocated_gib', 0):>8.2f} {r['max_rel_err'] or 0:>11.2e}")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
