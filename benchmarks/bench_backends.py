"""Verify steps per second for each attention backend, eager and through the
graph runner: the same verify batch re-run through Engine.verify (the full
target forward: embeddings, every layer's attention backend, lm_head).

    .venv/bin/python benchmarks/bench_backends.py            # CPU: prints a table, writes results/backends-cpu.json

On CPU, sglang-triton runs under the Triton interpreter (float32) and the
graph runner replays its closure; on CUDA the graph is a torch.cuda.CUDAGraph
and only graph-capturable backends (sglang-triton) run in graph mode.
Timings are medians over `--reps` replays after one warm-up; there are no
timing assertions in tests, the numbers live here."""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.engine.attn import make_backend  # noqa: E402
from harness.engine.attn.sglang_triton import prepare_interpreter, use_interpreter  # noqa: E402

SHAPES = ((16, 1, 1), (16, 4, 4), (32, 4, 4))  # (budget, topk, batch)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_verify(backend: str, budget: int, topk: int, batch: int, cuda_graph: bool, device: str,
                dtype: str, reps: int) -> dict:
    """Median seconds per verify step for one setting (one round of prefill
    and drafting first, to get a real verify batch)."""
    from harness.check.prepare import prepare
    from harness.engine.settings import RunSettings
    s = RunSettings(budget=budget, topk=topk, batch=batch, cuda_graph=cuda_graph, backend=backend,
                    device=device, dtype=dtype, max_new_tokens=64)
    engine = prepare(s).engine
    vb = next(engine.rounds()).batch  # [batch*q_len] rows, already on the device
    engine.verify(vb)  # warm-up (graph capture for this bucket on the first call)
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        engine.verify(vb)
        _sync(device)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return dict(backend=backend, budget=budget, topk=topk, batch=batch, cuda_graph=cuda_graph,
                rows=batch * (budget + 1), sec_per_step=med, steps_per_sec=1.0 / med,
                min_sec=min(times), max_sec=max(times), reps=reps)


def capturable(backend: str, device: str) -> bool:
    """On CUDA only backends that may run inside torch.cuda.CUDAGraph capture get a graph row."""
    return make_backend(backend, device, torch.float32).graph_capturable or not device.startswith("cuda")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--backends", default="torch,sglang-triton")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "backends-cpu.json")
    args = ap.parse_args(argv)
    prepare_interpreter()
    torch.set_num_threads(1)  # as in the tests: the model is tiny, threads only contend
    rows = []
    for backend in args.backends.split(","):
        for budget, topk, batch in SHAPES:
            for graph in (False, True):
                if graph and not capturable(backend, args.device):
                    continue
                r = time_verify(backend, budget, topk, batch, graph, args.device, args.dtype, args.reps)
                rows.append(r)
                print(f"{backend:14s} b{budget:<3d} k{topk} bs{batch} {'graph' if graph else 'eager'}: "
                      f"{r['sec_per_step'] * 1e3:9.2f} ms/step  {r['steps_per_sec']:8.2f} steps/s", flush=True)
    print_table(rows)
    env = dict(device=args.device, dtype=args.dtype, interpreter=use_interpreter(), torch=torch.__version__,
               python=platform.python_version(), machine=platform.machine(), threads=torch.get_num_threads())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(environment=env, results=rows), indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


def print_table(rows: list[dict]) -> None:
    print(f"\n{'backend':14s} {'budget':>6s} {'topk':>4s} {'batch':>5s} {'mode':>5s} {'ms/step':>9s} {'steps/s':>8s}")
    for r in rows:
        print(f"{r['backend']:14s} {r['budget']:6d} {r['topk']:4d} {r['batch']:5d} "
              f"{'graph' if r['cuda_graph'] else 'eager':>5s} {r['sec_per_step'] * 1e3:9.2f} {r['steps_per_sec']:8.2f}")


if __name__ == "__main__":
    sys.exit(main())
