"""Where the check's time goes at a worst setting (issue 22 point 3), and what the step table and the kept-prefix
twin save: one table and one JSON file.

    .venv/bin/python benchmarks/check_speed.py                      # smollm2-135m bf16, budget 32, topk 4, batch 4
    .venv/bin/python benchmarks/check_speed.py --baseline DIR       # also the whole check of an older checkout
    .venv/bin/python benchmarks/check_speed.py --device cuda --model CKPT --prompt-len 640,900 --cuda-graph \\
        --backend sglang-triton --out results/check-speed-gpu.json  # the GPU script's call (check_speed_gpu.sh)

Components, in this process, over the same verify steps and in the check's order:
  twin     the causal twin as the check runs it (each request's committed prefix kept between steps, judged rows'
           logits only) against the twin before it (the whole prefix prefilled every step, every row's logits
           computed and copied to the host), same model, backend and kernel;
  compare  compare/step_table.py (on the engine's device, one host copy per step) against the per-node path it
           replaced (compare_rows per request and per quantity on the oracle's device, a host read per padding row);
  oracle   the float64 oracle's rows (and the rounded computation's under the noise floor), for scale.
Whole check: `ddcheck run` of the setting (per-step engine and oracle seconds after the warm-up, the warm-up
apart, their ratio), and with --baseline DIR the same command on that checkout (its own summary's figures,
which before the warm-up split included step 0). No assertions: the figures go to the table and the JSON."""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from harness.check.causal_twin import CausalTwin  # noqa: E402
from harness.check.compare.metrics import compare_rows, rel_l2  # noqa: E402
from harness.check.compare.step_table import RequestRows, step_table  # noqa: E402
from harness.check.prepare import prepare  # noqa: E402
from harness.check.step_clock import oracle_thread_count, oracle_threads  # noqa: E402
from harness.cli.common import threads_from_env  # noqa: E402
from harness.check.prompts import parse_prompt_lens  # noqa: E402
from harness.engine.settings import RunSettings  # noqa: E402
from harness.workflows.cases import prompts_for  # noqa: E402


class PrefillTwin(CausalTwin):
    """The twin before issue 22: the whole prefix prefilled every step, every row's logits, copied to the host."""

    def _kept(self, prefix, room):
        self.prefixes = []   # no prefix kept: a forward of the whole prefix each call
        return super()._kept(prefix, room)

    def _forward(self, ids, positions, meta, pool, rows):
        tokens, pos = torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device)
        return self.model.forward(tokens, pos, meta, pool, self.backend).float().cpu()[rows.cpu()]


def per_node(r: RequestRows) -> list:
    """The comparison before the step table (differential.py's per-node path)."""
    real = r.ref.shape[0]
    out = [compare_rows(r.engine[:real], r.ref[:real])]
    if r.twin is not None:
        out += [compare_rows(r.twin[:real], r.ref[:real]), compare_rows(r.rounded[:real], r.ref[:real])]
        scale = r.ref[:real].abs().amax(-1).clamp_min(1e-30)
        out.append(((r.engine[:real].double() - r.twin[:real].double().to(r.engine.device)).abs().amax(-1)
                    / scale.to(r.engine.device)).tolist())
        out += [rel_l2(x[:real], r.ref[:real]) for x in (r.engine, r.twin, r.rounded)]
    out.append([bool(torch.isfinite(r.engine[row]).all()) for row in range(real, r.engine.shape[0])])
    return out


def sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(fn, into: dict, key: str):
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    into[key] = into.get(key, 0.0) + time.perf_counter() - t0
    return out


def judge_step(p, s: RunSettings, result, kept: CausalTwin, fresh: CausalTwin) -> tuple[dict, list[RequestRows]]:
    """The oracle's rows, both twins and the rounded rows of every request of one step, each timed."""
    step_t: dict[str, float] = {"twin_diff": 0.0}
    rows = []
    for rs in result.requests:
        parents = [-1] + [int(x) for x in rs.tree.parents[1:]]
        ref = timed(lambda: p.oracle.tree_logits(list(rs.prefix), list(rs.tree.tokens), parents), step_t, "oracle")
        twin = timed(lambda: kept.tree_logits(rs.prefix, rs.tree), step_t, "twin_kept")
        old = timed(lambda: fresh.tree_logits(rs.prefix, rs.tree), step_t, "twin_prefill")
        step_t["twin_diff"] = max(step_t["twin_diff"], float((twin.cpu() - old).abs().max()))
        rounded = timed(lambda: p.oracle.rounded_tree_logits(list(rs.prefix), list(rs.tree.tokens), parents,
                                                             s.dtype, p.rounded_probabilities), step_t, "oracle")
        rows.append(RequestRows(rs.logits.clone(), ref, twin, rounded))
    return step_t, rows


def components(s: RunSettings, steps: int, on_step=lambda partial: None) -> dict:
    """Seconds per verify step (after step 0) of each component, both ways, over the same steps."""
    p = prepare(s, prompts_for(s))
    kept = CausalTwin(p.engine.model, p.engine.kernel, s.device, p.engine.max_context + p.engine.q_len,
                      threads=torch.get_num_threads())   # the engine's threads, as prepare.py twin_for
    fresh = PrefillTwin(p.engine.model, p.engine.kernel, s.device, p.engine.max_context + p.engine.q_len,
                        threads=torch.get_num_threads())
    t: dict[str, float] = {}
    done, twin_err = 0, 0.0
    # as the check does: a preset's oracle on the CLI's threads, a checkpoint's on the cores others leave idle
    threads = oracle_thread_count(s.model, s.device)
    for result in p.engine.rounds():
        with oracle_threads(threads):
            step_t, rows = judge_step(p, s, result, kept, fresh)
            timed(lambda: step_table(rows, s.device), step_t, "compare_table")
            timed(lambda: [per_node(r) for r in rows], step_t, "compare_per_node")
        twin_err = max(twin_err, step_t.pop("twin_diff"))
        if done:   # step 0 is the warm-up
            for k, v in step_t.items():
                t[k] = t.get(k, 0.0) + v
        else:
            warmup = {k: round(v, 4) for k, v in step_t.items()}
        done += 1
        print(f"step {done - 1}: " + ", ".join(f"{k} {v:.3f} s" for k, v in step_t.items()), file=sys.stderr,
              flush=True)
        out = {k: round(v / max(done - 1, 1), 4) for k, v in t.items()}
        out.update(steps_after_warmup=done - 1, twin_max_abs_diff=twin_err, warmup_step0_s=warmup)
        on_step(out)
        if done > steps:
            break
    return out


def whole_check(s: RunSettings, checkout: Path, label: str, timeout_s: float | None, own: bool) -> dict:
    """`ddcheck run` of the setting with `checkout`'s code: the summary's figures and the wall seconds. With
    timeout_s, this checkout's run takes --timeout (its records so far and a `stopped` summary); any run gets
    SIGTERM a minute after it, and SIGKILL a minute after that."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "r.jsonl"
        cmd = [sys.executable, "-m", "harness", "run", *s.command().split()[2:], "--out", str(out)]
        if timeout_s and own:
            cmd += ["--timeout", str(timeout_s)]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=checkout, env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(checkout), os.environ.get("PYTHONPATH")]))},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _, err = proc.communicate(timeout=timeout_s + 60 if timeout_s else None)
        except subprocess.TimeoutExpired:
            proc.terminate()   # the watchdog forwards it (a run of an older checkout may leave nothing)
            try:
                _, err = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
        r = subprocess.CompletedProcess(cmd, proc.returncode, "", err)
        wall = time.perf_counter() - t0
        lines = out.read_text().splitlines() if out.exists() else []
    records = [json.loads(x) for x in lines]
    summary = next((x for x in reversed(records) if x.get("kind") == "summary"), {})
    keys = ("verdict", "stopped", "steps", "nodes_checked", "divergent_nodes", "engine_s_per_step", "oracle_s_per_step",
            "engine_warmup_s", "oracle_warmup_s", "oracle_time_ratio", "max_noise_ratio")
    row = {"code": label, "exit": r.returncode, "wall_s": round(wall, 2), **{k: summary.get(k) for k in keys}}
    row.update(why(summary, records))
    row["node_verdicts"] = [x["verdict"] for x in records if x.get("kind") == "node"]
    if r.returncode not in (0, 1, 124):
        row["stderr_tail"] = r.stderr[-2000:]
    return row


WHY_KEYS = ("failed_checks", "first", "stream_mismatches", "accept_mismatches", "tree_mismatches",
            "accept_ref_mismatches", "reference_near_ties", "nonfinite_padding_rows", "load_mismatches", "audit_errors",
            "provenance_findings", "rank_findings", "near_ties", "noise_rule", "noise_drift", "drift_exceeded",
            "noise_excess", "excess_exceeded", "max_node_bound", "max_ref_scale", "fault_class", "explanation",
            "first_finding", "crash", "error", "notes")


def why(summary: dict, records: list[dict], keep: int = 8) -> dict:
    """What explains the run's verdict: the summary's fields that say why, and the first `keep` records of each
    run-level check (stream, tree, accept-ref, accept) that did not match, as the run wrote them."""
    out = {k: summary.get(k) for k in WHY_KEYS}
    for kind in ("stream", "tree", "accept-ref", "accept"):
        bad = [x for x in records if x.get("kind") == kind and x.get("verdict") not in ("match", "pass", "agree")]
        if bad:
            out[f"{kind}_records"] = bad[:keep]
    return out


def settings(a) -> RunSettings:
    return RunSettings(model=a.model, dtype=a.dtype, budget=a.budget, topk=a.topk, batch=a.batch,
                       max_new_tokens=a.max_new_tokens, backend=a.backend, device=a.device,
                       cuda_graph=a.cuda_graph, prompt_lens=parse_prompt_lens(a.prompt_len) if a.prompt_len else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cuda-graph", action="store_true")
    ap.add_argument("--prompt-len", default=None, help="e.g. 640,900")
    ap.add_argument("--steps", type=int, default=3, help="verify steps after step 0 timed by component")
    ap.add_argument("--baseline", type=Path, help="a checkout of older code: its whole check too")
    ap.add_argument("--skip-components", action="store_true")
    ap.add_argument("--skip-whole", action="store_true")
    ap.add_argument("--run-timeout", type=float, help="seconds: this checkout's run gets --timeout, any run SIGTERM "
                    "a minute after")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "check-speed-cpu.json")
    a = ap.parse_args()
    torch.set_num_threads(threads_from_env(os.environ))   # as the CLI runs the engine (DDCHECK_THREADS)
    s = settings(a)
    result = {"setting": s.command(), "machine": platform.machine(), "cores": os.cpu_count(),
              "device_name": torch.cuda.get_device_name() if s.device.startswith("cuda") else platform.processor()}
    a.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:   # after each part: a run cut short keeps what it measured
        a.out.write_text(json.dumps(result, indent=1) + "\n")
    if not a.skip_components:
        def partial(c: dict) -> None:
            result["components_s_per_step"] = c
            save()
        components(s, a.steps, partial)
    if not a.skip_whole:
        result["whole_check"] = [whole_check(s, ROOT, "this checkout", a.run_timeout, own=True)]
        verdicts = result["whole_check"][0].pop("node_verdicts")
        save()
        if a.baseline:
            result["whole_check"].append(whole_check(s, a.baseline.resolve(), f"baseline {a.baseline.name}",
                                                     a.run_timeout, own=False))
            result["same_node_verdicts"] = result["whole_check"][1].pop("node_verdicts") == verdicts
            save()
    print_table(result)


def print_table(result: dict) -> None:
    print(result["setting"])
    c = result.get("components_s_per_step")
    if c:
        print(f"{'component (s per step after step 0)':40} {'before':>9} {'now':>9} {'speed-up':>9}")
        for name, before, now in (("twin", "twin_prefill", "twin_kept"), ("compare", "compare_per_node",
                                                                        "compare_table")):
            print(f"{name:40} {c[before]:9.3f} {c[now]:9.3f} {c[before] / max(c[now], 1e-9):8.2f}x")
        print(f"{'oracle (float64 rows, rounded rows)':40} {c['oracle']:9.3f}")
        print(f"twin: largest |kept - prefilled| logit {c['twin_max_abs_diff']:.3g}")
    if not result.get("whole_check"):
        return
    print(f"{'whole check':22} {'exit':>4} {'wall s':>8} {'steps':>5} {'engine s':>9} {'oracle s':>9} "
          f"{'ratio':>6} {'warm-up e/o s':>14} verdict")
    for r in result.get("whole_check", []):
        ratio = r["oracle_time_ratio"] or ((r["oracle_s_per_step"] or 0) / max(r["engine_s_per_step"] or 1e-9, 1e-9))
        warm = f"{r['engine_warmup_s']:.1f}/{r['oracle_warmup_s']:.1f}" if r.get("engine_warmup_s") is not None else "-"
        print(f"{r['code'][:22]:22} {r['exit']:>4} {r['wall_s']:8.1f} {r['steps'] or 0:>5} "
              f"{r['engine_s_per_step'] or 0:9.3f} {r['oracle_s_per_step'] or 0:9.3f} {ratio:6.2f} {warm:>14} "
              f"{r['verdict']}{verdict_reason(r)}")
    if "same_node_verdicts" in result:
        print(f"same node verdicts as the baseline: {result['same_node_verdicts']}")


def verdict_reason(r: dict) -> str:
    """The checks behind a verdict other than pass, as the summary named them (older summaries: their counts)."""
    if r["verdict"] == "pass":
        return ""
    failed = r.get("failed_checks")
    if failed is None:   # a summary written before failed_checks
        counts = [k for k in WHY_KEYS[2:12] if k != "reference_near_ties"]   # near ties fail nothing
        failed = [f"{k.replace('_', ' ')} {r[k]}" for k in counts if isinstance(r.get(k), int) and r[k]]
        failed += [k.replace("_", " ") for k in ("drift_exceeded", "excess_exceeded") if r.get(k)]
    first = r.get("first") or {}
    where = f"; first: {first.get('what')}" + (f" ({first['detail']})" if first.get("detail") else "") if first else ""
    return f" ({'; '.join(failed) or 'no check named'}{where})"


if __name__ == "__main__":
    main()
