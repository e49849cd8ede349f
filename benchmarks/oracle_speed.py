"""The float64 oracle's time per verify step next to the engine's, before and
after the oracle judged a step in one pass (issue 22 point 3).

    PYTHONPATH=. .venv/bin/python benchmarks/oracle_speed.py [--model smollm2-135m] [--dtype bfloat16]
        [--settings 16:1:1,32:4:4] [--max-new-tokens 16] [--device cpu] [--out benchmarks/results/oracle-speed-cpu.json]
        [--drafter noisy] [--cuda-graph] [--prompt-lens 640,900]   (benchmarks/oracle_speed_gpu.sh: the 8B shape)
        [--modes before,every-twin,twin-per-request,after] [--repeat 3] [--oracle-threads 1]

Each setting (budget:topk:batch) runs the whole differential check once per
mode (--repeat times, interleaved; the table gives each mode's median ratio)
on one loading of the model, the oracle's state emptied before each run:

* before: the oracle as it was, re-created by switching the new paths off:
  no prepare_step (each request judged on its own call), one forward per
  leaf path behind the prefix cache (reference/oracle.py _tree_logits),
  the rounded yardstick's weights widened from bf16 at every use, and the
  stream check's greedy recomputing every position;
* every-twin: the causal twin of every node (Prepared.every_twin), as before
  it was computed only for the nodes whose verdict it can change;
* twin-per-request: the twins computed where needed, one forward per
  request as before a step's twins became one forward for every request
  (CausalTwin.step_logits);
* passes-in-turn: the float64 pass and the rounded yardstick's one after
  the other on the oracle's threads, as before they ran side by side, one
  thread each (reference/oracle.py side_by_side);
* commit-recomputed: the tokens a step commits computed again in front of
  the next step's tree, as before the next prefix took the judged tree's
  node K/V along the accepted path (reference/prefix_cache.py JudgedTree);
* twin-leads-apart: the twin's committed tokens extend its kept prefixes in
  a forward of their own (merge_up_to 0) instead of leading every path
  sequence of the step's forward;
* twins-after-table: the twins' forward and the step table one after the
  other, as before they ran side by side (harness/check/twin_step.py);
* after: the code as it is.

--oracle-threads fixes the float64 oracle's threads (the check's own choice,
oracle_thread_count: the cores other processes leave idle, is the default;
1 puts both sides on one core each: a ratio of CPU time).

The figures are the run summary's own (engine and oracle seconds per step,
the stream check's seconds), so they carry whatever else the check does
per step (the causal twin, the comparison). Next to them, where the oracle's
step goes (parts_s_per_step, steps after the first, timed around the calls:
parts_timed): the float64 pass, the rounded yardstick's pass, the twins
and the step table. Verdicts must agree. The JSON is rewritten after every
run, so a run killed midway leaves its rows.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path

import torch

import reference.model as ref_model
import reference.oracle as oracle_module
from harness.check import differential, twin_step
from harness.check.differential import check
from harness.check.prepare import build, load
from harness.check.records import RecordWriter
from harness.check.step_clock import machine_cores
from harness.engine.settings import RunSettings
from reference.judged import GreedyMemo, StepAnswers
from reference.oracle import _tree_logits
from reference.prefix_cache import PrefixCache


MODES = ("before", "every-twin", "twin-per-request", "passes-in-turn", "commit-recomputed", "twin-leads-apart",
         "twins-after-table", "after")


def fresh(oracle) -> None:
    """The oracle's caches emptied: each run starts from the same state."""
    oracle.prefixes, oracle.low_precision = PrefixCache(), {}
    oracle.step_answers, oracle.judged_walks = StepAnswers(), GreedyMemo()


@contextmanager
def before(oracle):
    """The oracle's old paths (see the module doc), undone on exit."""
    room = ref_model._room_for
    oracle.prepare_step = None
    oracle._judge = lambda model, prefixes, prefix, tokens, parents: _tree_logits(model, prefixes, prefix, tokens,
                                                                                   parents)
    oracle.judged_walks = GreedyMemo(capacity=0)
    ref_model._room_for = lambda nbytes, device: False
    try:
        yield
    finally:
        ref_model._room_for = room
        del oracle.prepare_step, oracle._judge


@contextmanager
def per_request(twin):
    """The twin's forwards one request at a time (each ask its own step_logits call), undone on exit."""
    step_logits = twin.step_logits
    twin.step_logits = lambda asks: [step_logits([ask])[0] for ask in asks]
    try:
        yield
    finally:
        del twin.step_logits


@contextmanager
def passes_in_turn():
    """The float64 pass and the rounded yardstick's one after the other on every thread, as before they ran
    side by side (reference/oracle.py side_by_side), undone on exit."""
    side = oracle_module.side_by_side
    oracle_module.side_by_side = lambda passes, device: [run() for run in passes]
    try:
        yield
    finally:
        oracle_module.side_by_side = side


@contextmanager
def commit_recomputed():
    """No judged tree kept for the next step's prefix (PrefixCache.put_tree a no-op), undone on exit."""
    put_tree = PrefixCache.put_tree
    PrefixCache.put_tree = lambda self, tree: None
    try:
        yield
    finally:
        PrefixCache.put_tree = put_tree


@contextmanager
def twin_leads_apart(twin):
    """The twin's committed tokens in a forward of their own (CausalTwin.merge_up_to 0), undone on exit."""
    merge = twin.merge_up_to
    twin.merge_up_to = 0
    try:
        yield
    finally:
        twin.merge_up_to = merge


@contextmanager
def twins_after_table():
    """The twins, then the table, one after the other (twin_step.alongside in turn), undone on exit."""
    along = twin_step.alongside
    twin_step.alongside = lambda background, foreground, device: (lambda later: (foreground(), later))(background())
    try:
        yield
    finally:
        twin_step.alongside = along


@contextmanager
def parts_timed(twin, parts: dict[str, float]):
    """Seconds of the oracle step's parts added to `parts`: the float64 pass (exact), the rounded yardstick's
    pass (rounded), both passes' wall time (passes: less than their sum where they ran side by side), the causal
    twins (twin), the step table (table), the table and the twins' wall time (checked: less than their sum where
    they ran side by side). Only the wrapped calls are timed: a
    GPU's queued work is counted where the call waits for it (each returns host-visible results or is
    followed by one that does)."""
    def timed(fn, key_of):
        def run(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            key = key_of(*a)
            parts[key] = parts.get(key, 0.0) + time.perf_counter() - t
            return out
        return run
    judge, table_fn, side = oracle_module.judge_packed, twin_step.step_table, oracle_module.side_by_side
    checked = differential.table_with_twins
    oracle_module.judge_packed = timed(judge, lambda model, *a: "exact" if model.store is ref_model.exact else "rounded")
    oracle_module.side_by_side = timed(side, lambda *a: "passes")
    twin_step.step_table = timed(table_fn, lambda *a: "table")
    differential.table_with_twins = timed(checked, lambda *a: "checked")
    own = None if twin is None else twin.__dict__.get("step_logits")   # a mode's own, kept under the timer
    if twin is not None:
        twin.step_logits = timed(twin.step_logits, lambda *a: "twin")
    try:
        yield
    finally:
        oracle_module.judge_packed, twin_step.step_table, oracle_module.side_by_side = judge, table_fn, side
        differential.table_with_twins = checked
        if twin is not None and own is None:
            del twin.step_logits
        elif twin is not None:
            twin.step_logits = own


def one_run(s: RunSettings, loaded, mode: str) -> dict:
    fresh(loaded.oracle)
    p = build(s, loaded)
    parts: dict[str, float] = {}
    t0 = time.perf_counter()

    def after_step(step: int, emitted: int) -> None:   # step 0 is the warm-up: the parts are of the steps after it
        if step == 0:
            parts.clear()
    modes = {"before": lambda: before(loaded.oracle), "twin-per-request": lambda: per_request(p.twin),
             "passes-in-turn": passes_in_turn, "commit-recomputed": commit_recomputed,
             "twin-leads-apart": lambda: twin_leads_apart(p.twin), "twins-after-table": twins_after_table}
    with modes.get(mode, nullcontext)(), parts_timed(p.twin, parts):
        summary = check(replace(p, every_twin=mode in ("before", "every-twin")), RecordWriter(None),
                        on_step=after_step, localize=False)
    wall = time.perf_counter() - t0
    e, o = summary.engine_s_per_step, summary.oracle_s_per_step
    later = max(summary.steps - 1, 1)
    return dict(budget=s.budget, topk=s.topk, batch=s.batch, mode=mode, steps=summary.steps,
                nodes=summary.nodes_checked, engine_s_per_step=e, oracle_s_per_step=o,
                parts_s_per_step={k: v / later for k, v in sorted(parts.items())},
                ratio=(o / e) if e else None, streams_s=summary.streams_s, wall_s=wall,
                twin_nodes=summary.twin_nodes, max_noise_ratio=summary.max_noise_ratio,
                verdict="PASS" if summary.passed else "FAIL", max_rel_err=summary.max_rel_err,
                first=None if summary.first is None else summary.first.what)


def parse_settings(text: str) -> list[tuple[int, int, int]]:
    try:
        out = [tuple(int(x) for x in part.split(":")) for part in text.split(",")]
    except ValueError:
        out = []
    if not out or any(len(t) != 3 for t in out):
        print("--settings takes budget:topk:batch[,budget:topk:batch...]", file=sys.stderr)
        sys.exit(2)
    return out


def table(rows: list[dict]) -> str:
    head = ("| budget | topk | batch | mode | steps | engine s/step | oracle s/step | oracle/engine | streams s "
            "| verdict | exact / rounded (both passes' wall) / twin / table (their wall) s/step |")
    lines = [head, "|" + " --- |" * 11]
    def f(x, spec: str, unit: str = "") -> str:   # a figure the summary did not give (a run of one step): -
        return "-" if x is None else f"{x:{spec}}{unit}"

    for r in rows:
        lines.append(f"| {r['budget']} | {r['topk']} | {r['batch']} | {r['mode']} | {r['steps']} | "
                     f"{f(r['engine_s_per_step'], '.3f')} | {f(r['oracle_s_per_step'], '.3f')} | "
                     f"{f(r['ratio'], '.1f', 'x')} | {f(r['streams_s'], '.1f')} | {r['verdict']} | "
                     + "{} / {} ({}) / {} / {} ({})".format(*(f(r["parts_s_per_step"].get(k), ".3f")
                                                              for k in ("exact", "rounded", "passes", "twin", "table",
                                                                        "checked")))
                     + " |")
    return "\n".join(lines)


def medians(rows: list[dict]) -> str:
    """Per setting and mode: the median of its runs' oracle/engine ratios, and their range."""
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        if r["ratio"] is not None:
            groups.setdefault((r["budget"], r["topk"], r["batch"], r["mode"]), []).append(r["ratio"])
    lines = ["| budget | topk | batch | mode | runs | median oracle/engine | range |", "|" + " --- |" * 7]
    for (b, k, n, mode), xs in groups.items():
        lines.append(f"| {b} | {k} | {n} | {mode} | {len(xs)} | {statistics.median(xs):.2f}x | "
                     f"{min(xs):.2f}-{max(xs):.2f}x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--settings", default="16:1:1,32:4:4")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--modes", default="before,after",
                    help="comma list of before, every-twin, twin-per-request, after")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each mode per setting, interleaved")
    ap.add_argument("--oracle-threads", type=int, default=None,
                    help="the float64 oracle's threads (default: the check's choice, the cores left idle)")
    ap.add_argument("--drafter", default="auto", help="noisy for a random checkpoint (the seeded stand-in)")
    ap.add_argument("--cuda-graph", action="store_true")
    ap.add_argument("--prompt-lens", default="", help="comma list of prompt lengths (--prompt-len), e.g. 640,900")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/oracle-speed-cpu.json"))
    a = ap.parse_args()
    settings, modes = parse_settings(a.settings), a.modes.split(",")
    torch.set_num_threads(1)   # the engine's threads as the CLI sets them (the check gives a checkpoint's oracle
    #                            every core)
    if not set(modes) <= set(MODES) or a.repeat < 1 or (a.oracle_threads or 1) < 1:
        print(f"--modes takes {', '.join(MODES)}; --repeat and --oracle-threads at least 1",
              file=sys.stderr)
        sys.exit(2)
    if a.oracle_threads:
        differential.oracle_thread_count = lambda model, device: a.oracle_threads
    lens = tuple(int(x) for x in a.prompt_lens.split(",") if x.strip()) or None
    base = RunSettings(model=a.model, dtype=a.dtype, backend=a.backend, device=a.device, oracle_device=a.device,
                       max_new_tokens=a.max_new_tokens, drafter=a.drafter, cuda_graph=a.cuda_graph, prompt_lens=lens)
    loaded = load(base)
    rows: list[dict] = []
    meta = dict(model=a.model, dtype=a.dtype, backend=a.backend, device=a.device, max_new_tokens=a.max_new_tokens,
                cuda_graph=a.cuda_graph, prompt_lens=lens, drafter=a.drafter,
                gpu=torch.cuda.get_device_name() if a.device.startswith("cuda") else None,
                command=" ".join(sys.argv), note="modes interleaved on one loading; summary figures",
                oracle_threads=a.oracle_threads or "idle cores (oracle_thread_count)", engine_threads=1,
                cpus=machine_cores())
    for budget, topk, batch in settings:
        s = replace(base, budget=budget, topk=topk, batch=batch)
        for _ in range(a.repeat):
            for mode in modes:
                rows.append(dict(one_run(s, loaded, mode), load_avg=os.getloadavg()[0]))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
                a.out.parent.mkdir(parents=True, exist_ok=True)
                a.out.write_text(json.dumps(dict(meta, rows=rows), indent=1) + "\n")
    print(table(rows))
    print(medians(rows))


if __name__ == "__main__":
    main()
