"""The low-precision verdict on a trained model (issue: trained models, point 3).

One checkpoint (SmolLM2-135M-Instruct as a Hugging Face folder), real text
prompts (benchmarks/prompts/*.txt through the folder's tokenizer.json), and
for each dtype in {bf16, fp16} one load (engine + float64 oracle), then every
setting derived from it (harness.check.prepare.derive):

  * fault-free: backend {torch, sglang-triton} x topk {1, 4} x batch {1, 4}
    over every prompt (batch 1: one run per prompt; batch 4: the prompts
    four at a time), budget 16;
  * the four one-key leaks (harness/faults/one_key.py): the last real row
    sees one padding column, one node sees one sibling, a row misses one
    ancestor (short prompts), and one padding column at a long prefix (the
    prompts joined to about 900 tokens);
  * padded-kv-visible, eager and under CUDA graphs (--cuda-graph on CUDA).

Every judged node's four errors are kept (rel_err, twin_err, rounded_err,
twin_dist: harness/check/records.py) so the rule's figures can be recomputed
from the JSON; the table prints false alarms per setting under the rule the
runs were judged by, the largest fault-free ratio against its multiplier,
and each leak's caught rows.

    python3 benchmarks/verdict_study.py --model DIR --device cuda --out "$OUT" --dtypes bfloat16
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from noise_floor_study import leak_rows  # noqa: E402

BACKENDS = ("torch", "sglang-triton")
LEAKS = [("last-row-sees-one-padding", dict(topk=1)), ("one-sibling-visible", dict(topk=4)),
         ("one-ancestor-hidden", dict(topk=1)), ("last-row-sees-one-padding", dict(topk=1, long=True))]
NODE_KEYS = ("rel_err", "twin_err", "rounded_err", "twin_dist", "rel_l2", "twin_l2", "rounded_l2", "depth")


def text_prompts(model: Path, folder: Path, only: list[str] | None = None):
    from harness.check.prompts import read_prompt_file
    files = sorted(folder.glob("*.txt"))
    return [read_prompt_file(f, str(model))[0] for f in files if only is None or f.stem in only]


def long_prompt(prompts, length: int):
    """The prompts' tokens joined until `length`: one real-text prompt at a long prefix."""
    from harness.engine.settings import PromptSpec
    ids: list[int] = []
    while len(ids) < length:
        for p in prompts:
            ids += list(p.tokens)
    return PromptSpec(f"joined{length}", length, prompts[0].accuracy, tuple(ids[:length]))


def judge(p, leak=None):
    from harness.check.differential import check
    from harness.faults.one_key import ONE_KEY_LEAKS
    from harness.check.records import RecordWriter
    if leak:
        p.engine.pipeline = replace(p.engine.pipeline, build_mask=ONE_KEY_LEAKS[leak])
    w = RecordWriter(None)
    s = check(replace(p, every_twin=True), w, localize=False)   # every node's four errors
    recs = [json.loads(x) for x in w.lines]
    nodes = [r for r in recs if r["kind"] == "node" and not r["is_padding"]]
    row = dict(setting=s.setting, passed=s.passed, nodes=s.nodes_checked, divergent_nodes=s.divergent_nodes,
               first=None if s.first is None else s.first.what, max_rel_err=s.max_rel_err,
               max_noise_ratio=s.max_noise_ratio, noise_drift=s.noise_drift, rule=s.noise_rule,
               planned_nodes=s.planned_nodes, stream_mismatches=s.stream_mismatches,
               mean_accepted_length=s.mean_accepted_length,
               node_values={k: [r[k] for r in nodes] for k in NODE_KEYS})
    return row, recs


def fault_free(base, base_s, prompts, backends, topks, batches, new_tokens, save, out, graphs=(False,)):
    from harness.check.prepare import derive
    for backend, graph in ((b, g) for b in backends for g in graphs):
        for topk in topks:
            for batch in batches:
                groups = [prompts[i:i + batch] for i in range(0, len(prompts) - batch + 1, batch)]
                for group in groups:
                    s = replace(base_s, backend=backend, topk=topk, batch=batch, max_new_tokens=new_tokens,
                                stop_after=0, cuda_graph=graph)
                    t0 = time.perf_counter()
                    row, _ = judge(derive(base, s, prompts=tuple(group)))
                    row.update(backend=backend, topk=topk, batch=batch, cuda_graph=graph, prompts=[g.name for g in group],
                               wall_s=time.perf_counter() - t0)
                    out.append(row)
                    print(f"free {base_s.dtype} {backend}{' graph' if graph else ''} k{topk} b{batch} {row['prompts'][0]}: passed {row['passed']} "
                          f"ratio {row['max_noise_ratio']:.2f} drift {row['noise_drift']:.2f} "
                          f"({row['wall_s']:.1f}s)", file=sys.stderr, flush=True)
                    save()


def leaks(base, base_s, prompts, backends, new_tokens, save, out):
    from harness.check.prepare import derive
    for backend in backends:
        for leak, kw in LEAKS:
            group = (long_prompt(prompts, 900),) if kw.get("long") else tuple(prompts[:4])
            s = replace(base_s, backend=backend, topk=kw["topk"], batch=len(group), max_new_tokens=new_tokens,
                        stop_after=0)
            row, recs = judge(derive(base, s, prompts=group), leak=leak)
            hit = leak_rows(leak, recs)
            row.update(leak=leak, long=bool(kw.get("long")), backend=backend, edited_rows=len(hit),
                       caught=sum(r["verdict"] == "diverge" for r in hit),
                       leak_values={k: [r[k] for r in hit] for k in NODE_KEYS})
            out.append(row)
            print(f"leak {base_s.dtype} {backend} {leak}{' long' if kw.get('long') else ''}: rows {len(hit)} "
                  f"caught {row['caught']}", file=sys.stderr, flush=True)
            save()


def padded_kv(base, base_s, prompts, graphs, new_tokens, save, out):
    from harness.check.prepare import derive
    for graph in graphs:
        for fault in (None, "padded-kv-visible"):
            s = replace(base_s, backend="sglang-triton", topk=1, batch=4, cuda_graph=graph, fault=fault,
                        max_new_tokens=new_tokens)
            row, _ = judge(derive(base, s, prompts=tuple(prompts[:4])))
            row.update(fault=fault, cuda_graph=graph)
            row.pop("node_values")
            out.append(row)
            print(f"{base_s.dtype} graph {graph} {fault}: passed {row['passed']} first {row['first']}",
                  file=sys.stderr, flush=True)
            save()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--prompts", type=Path, default=ROOT / "benchmarks" / "prompts")
    ap.add_argument("--only-prompts", default=None, help="comma-separated prompt names (default: every file)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--topks", default="1,4")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--parts", default="free,leaks,padded", help="which parts to run")
    ap.add_argument("--graphs", default="off", help="fault-free runs under CUDA graphs: off, on or both")
    ap.add_argument("--tag", default="h200")
    a = ap.parse_args()
    import torch
    from harness.check.prepare import prepare
    from harness.engine.settings import RunSettings
    if a.device == "cpu":
        from harness.engine.attn.sglang_triton import prepare_interpreter
        prepare_interpreter()
    prompts = text_prompts(a.model, a.prompts, a.only_prompts.split(",") if a.only_prompts else None)
    parts = a.parts.split(",")
    a.out.mkdir(parents=True, exist_ok=True)
    result = {"model": a.model.name, "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "command": " ".join(sys.argv).replace(str(a.out), "$OUT"),
              "prompts": [p.name for p in prompts], "fault_free": [], "leaks": [], "padded_kv": []}
    path = a.out / f"verdict-study-{a.tag}.json"

    def save() -> None:
        text = json.dumps(result, default=str)
        path.write_text(text.replace(str(a.model.resolve()), "$MODEL").replace(str(a.out), "$OUT"))
    for dtype in a.dtypes.split(","):
        base_s = RunSettings(model=str(a.model), device=a.device, dtype=dtype, backend=a.backends.split(",")[0], budget=16,
                             topk=1, max_new_tokens=a.max_new_tokens)
        t0 = time.perf_counter()
        base = prepare(base_s, prompts=tuple(prompts[:1]))
        result.setdefault("load_s", {})[dtype] = time.perf_counter() - t0
        backends = a.backends.split(",")
        if "free" in parts:
            fault_free(base, base_s, prompts, backends, [int(x) for x in a.topks.split(",")],
                       [int(x) for x in a.batches.split(",")], a.max_new_tokens, save, result["fault_free"],
                       {"off": (False,), "on": (True,), "both": (False, True)}[a.graphs])
        if "leaks" in parts:
            leaks(base, base_s, prompts, backends, a.max_new_tokens, save, result["leaks"])
        if "padded" in parts:
            graphs = (False, True) if a.device.startswith("cuda") else (False,)
            padded_kv(base, base_s, prompts, graphs, a.max_new_tokens, save, result["padded_kv"])
        del base
    save()
    print(path)


if __name__ == "__main__":
    main()
