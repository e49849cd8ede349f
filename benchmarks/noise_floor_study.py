"""Real model scale on one GPU: random checkpoints shaped like Llama-3.2-1B
and Llama-3.1-8B (benchmarks/random_checkpoint.py), bf16, SGLang's kernel.

For each shape, one load (the engine's loader and the float64 oracle's own),
then every setting derived from it (harness.check.prepare.derive: same weights,
same oracle):
  * end to end: --budget 16 --topk 1 (load + run), time per step, peak memory;
  * fault-free: batch 4 with graph off and on, topk 4, and 640/900-token
    prompts: per-node error, twin error and their ratio;
  * the four one-key leaks (harness/faults/one_key.py): the ratio on the row
    that got the leaked (or lost) key, and whether each verdict caught it;
  * padded-kv-visible, localized.

    python3 benchmarks/noise_floor_study.py --shape llama-3.1-8b --device cuda --out "$OUT"
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

FIXED_BF16 = 4e-2
FREE = [dict(batch=4), dict(batch=4, cuda_graph=True), dict(batch=4, topk=4, cuda_graph=True),
        dict(batch=2, prompt_lens=(640, 900)), dict(batch=2, topk=4, prompt_lens=(640, 900), cuda_graph=True)]
LEAKS = [("last-row-sees-one-padding", dict()), ("one-sibling-visible", dict(topk=4)),
         ("one-ancestor-hidden", dict()), ("last-row-sees-one-padding", dict(prompt_lens=(900,)))]


def edited_rows(leak: str, rows: list[dict]) -> list[int]:
    """The verify rows of one (step, request) whose mask the leak edited (as harness/faults/one_key.py does)."""
    real = [r for r in rows if not r["is_padding"]]
    n, padded = len(real), len(rows) > len(real)
    par = {r["node"]: r["parent"] for r in real}
    dep = {r["node"]: r["depth"] for r in real}
    if leak == "last-row-sees-one-padding":
        return [n - 1] if padded else []
    if leak == "one-sibling-visible":
        pairs = [(i, j) for i in range(1, n) for j in range(1, i) if par[i] == par[j]]
        return [pairs[-1][0]] if pairs else []
    deep = [i for i in range(n) if dep[i] >= 2]
    return [deep[-1]] if deep else []


def judge(p, leak=None, localize=False) -> tuple[dict, list[dict]]:
    from harness.check.differential import check
    from harness.faults.one_key import ONE_KEY_LEAKS
    from harness.check.records import RecordWriter
    if leak:
        p.engine.pipeline = replace(p.engine.pipeline, build_mask=ONE_KEY_LEAKS[leak])
    w = RecordWriter(None)
    t0 = time.perf_counter()
    s = check(replace(p, every_twin=True), w, localize=localize)   # every node's twin
    wall = time.perf_counter() - t0
    recs = [json.loads(x) for x in w.lines]
    row = dict(setting=s.setting, passed=s.passed, steps=s.steps, nodes=s.nodes_checked,
               divergent_nodes=s.divergent_nodes, max_rel_err=s.max_rel_err, max_twin_err=s.max_twin_err,
               max_noise_ratio=s.max_noise_ratio, prefix=[s.prefix_len_min, s.prefix_len_max], key_tiles=s.key_tiles,
               engine_s_per_step=s.engine_s_per_step, oracle_s_per_step=s.oracle_s_per_step,
               oracle_device=s.oracle_device, wall_s=wall, fault_class=s.fault_class,
               explanation=s.explanation, first=None if s.first is None else s.first.what,
               fixed_would_flag=sum(r["kind"] == "node" and (r["rel_err"] or 0) > FIXED_BF16 for r in recs))
    return row, recs


def leak_rows(leak: str, recs: list[dict]) -> list[dict]:
    groups: dict = {}
    for r in recs:
        if r["kind"] == "node":
            groups.setdefault((r["step"], r["request"]), []).append(r)
    out = []
    for rows in groups.values():
        by_node = {r["node"]: r for r in rows}
        out += [by_node[i] for i in edited_rows(leak, rows)]
    return out


def study(ckpt: Path, device: str, max_new_tokens: int, fault_free: list, leaks: list, dtype="bfloat16",
          save=lambda partial: None) -> dict:
    """`save` gets the result so far after every setting (a run cut off by a time limit keeps what it measured)."""
    from harness.check.prepare import derive, prepare
    from harness.engine.settings import RunSettings
    torch.cuda.reset_peak_memory_stats() if device.startswith("cuda") else None
    base_s = RunSettings(model=str(ckpt), device=device, dtype=dtype, backend="sglang-triton", budget=16, topk=1,
                         max_new_tokens=max_new_tokens)
    t0 = time.perf_counter()
    base = prepare(base_s)
    load_s = time.perf_counter() - t0
    e2e, _ = judge(base)
    out = {"load_s": load_s, "end_to_end": {**e2e, "end_to_end_s": load_s + e2e["wall_s"]}}
    print(f"load {load_s:.1f}s, run {e2e['wall_s']:.1f}s, passed {e2e['passed']}, ratio {e2e['max_noise_ratio']}",
          file=sys.stderr, flush=True)
    out["fault_free"] = []
    ratios_ok = []
    for kw in fault_free:
        row, recs = judge(derive(base, replace(base_s, **kw)))
        ratios_ok += [r["noise_ratio"] for r in recs if r["kind"] == "node" and r.get("noise_ratio") is not None]
        out["fault_free"].append(row)
        save(out)
        print(f"free {kw}: passed {row['passed']} max_err {row['max_rel_err']:.3g} ratio {row['max_noise_ratio']}",
              file=sys.stderr, flush=True)
    out["fault_free_ratio"] = _dist(ratios_ok)
    out["leaks"] = []
    for leak, kw in leaks:
        row, recs = judge(derive(base, replace(base_s, stop_after=0, **kw)), leak=leak)
        hit = leak_rows(leak, recs)
        row.update(leak=leak, edited_rows=len(hit),
                   caught_noise_floor=sum(r["verdict"] == "diverge" for r in hit),
                   caught_fixed=sum((r["rel_err"] or 0) > FIXED_BF16 for r in hit),
                   min_ratio=min((r["noise_ratio"] for r in hit if r.get("noise_ratio") is not None), default=None),
                   max_err=max((r["rel_err"] for r in hit), default=None))
        out["leaks"].append(row)
        save(out)
        print(f"leak {leak} {kw}: rows {len(hit)} caught {row['caught_noise_floor']} (fixed {row['caught_fixed']}) "
              f"min ratio {row['min_ratio']}", file=sys.stderr, flush=True)
    row, _ = judge(derive(base, replace(base_s, fault="padded-kv-visible")), localize=True)
    out["padded_kv_visible"] = row
    print(f"padded-kv-visible: passed {row['passed']} class {row['fault_class']}", file=sys.stderr, flush=True)
    out["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30 if device.startswith("cuda") else None
    out["peak_host_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    return out


def _dist(xs: list[float]) -> dict:
    if not xs:
        return {}
    t = torch.tensor(xs, dtype=torch.float64)
    return {"n": len(xs), **{f"p{q}": float(torch.quantile(t, q / 100)) for q in (50, 99)}, "max": float(t.max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--checkpoint", type=Path, help="use this directory instead of writing one")
    ap.add_argument("--float32-check", action="store_true", help="also one IEEE float32 run (its max error)")
    ap.add_argument("--free", default=None, help="indices of the fault-free settings to run (default all): 1,3")
    ap.add_argument("--leaks", default=None, help="indices of the leaks to run (default all): 3")
    a = ap.parse_args()
    if a.device == "cpu":
        from harness.engine.attn.sglang_triton import prepare_interpreter
        prepare_interpreter()
    from random_checkpoint import write
    t0 = time.perf_counter()
    ckpt = a.checkpoint or write(a.shape, Path(tempfile.mkdtemp(prefix="ddcheck-ckpt-")), a.device)
    result = {"shape": a.shape, "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "write_checkpoint_s": time.perf_counter() - t0,
              "command": " ".join(sys.argv)}
    pick = lambda xs, sel: xs if sel is None else [xs[int(i)] for i in sel.split(",")]  # noqa: E731
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / f"noise-floor-{a.shape}.json"

    def save(partial: dict) -> None:
        # no machine's paths in the record: the checkpoint and output folders by the names the README uses
        text = json.dumps({**result, **partial}, indent=1, default=str)
        path.write_text(text.replace(str(ckpt), "$CHECKPOINT").replace(str(a.out), "$OUT"))
    result.update(study(ckpt, a.device, a.max_new_tokens, pick(FREE, a.free), pick(LEAKS, a.leaks), save=save))
    if a.float32_check:
        from harness.check.prepare import prepare
        from harness.engine.settings import RunSettings
        row, _ = judge(prepare(RunSettings(model=str(ckpt), device=a.device, dtype="float32",
                                           backend="sglang-triton", max_new_tokens=8)))
        result["float32_ieee"] = row
        print(f"float32: passed {row['passed']} max_err {row['max_rel_err']:.3g}", file=sys.stderr, flush=True)
    save({})
    print(json.dumps({k: result[k] for k in ("shape", "load_s", "fault_free_ratio")}, default=str))


if __name__ == "__main__":
    main()
