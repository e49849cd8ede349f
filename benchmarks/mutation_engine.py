"""Mutants from a real mutation engine, judged by ddcheck (issue 21, point 1;
not CI: tens of minutes). cosmic-ray 8.x (the `[mutate]` extra, best in a
venv of its own) lists every mutation of the modules in
benchmarks/mutation_truth.toml; a stratified sample of them is applied, one
per private copy of the working tree (`cosmic-ray apply`), and judged by
ddcheck itself on a fixed quick matrix (never by the unit tests):

  caught      a setting diverged (exit 1, the first divergence no bare crash): a wrong value, or a proven
              crash (the engine crashed at a step that one stage's replacement makes run and match the oracle;
              tallied apart as caught_by_proven_crash)
  crash-only  the engine under test crashed (or refused its input, or died by a signal), nothing diverged
  no-judge    ddcheck could not judge (exit 3); an internal error of ddcheck is flagged on its own
  timeout     a setting ran past the per-run cap
  survived    every setting passed, and the engine's outputs differ from the unmutated tree's
  equivalent  every setting passed with the engine's outputs identical to the unmutated tree's
  incompetent the mutated module does not compile (never run; like equivalent, not behaviour-changing)

A caught mutant's explanation is scored against the truth table (its module's
or function's stage): right, unknown (no stage named) or wrong. Writes a JSON
with the command, the matrix, every mutant and the tallies per module and per
mutation operator; rewritten after each mutant, so a cut-short run keeps what
it judged.

    PYTHONPATH=$PWD python benchmarks/mutation_engine.py --sample 120 --time-budget-s 2700 \\
        --cosmic-ray /path/to/venv/bin/cosmic-ray --out benchmarks/results/mutation-engine-cpu.json
    ... --sample 0 --jobs 32     # every mutant, on a bigger machine

On a machine without cosmic-ray: list and sample here, carry the diffs there (benchmarks/mutation_export.py
applies them in plain Python to each private copy; the tree there must be the same revision):

    ... --sample 400 --seed 1 --export mutants.json                     # here, with cosmic-ray
    PYTHONPATH=$PWD python benchmarks/mutation_engine.py --from mutants.json --jobs 14 \\
        [--shard 0/2] --out benchmarks/results/mutation-engine-big.json   # there, without it
    ... --merge shard0.json shard1.json --out merged.json                 # shards into one results file
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Callable

from mutation_common import GiB, ROOT, CliRun, copy_tree, run_cli
from mutation_export import (ExportedMutant, parse_shard, pick, read_export, sha256, shard, unified_diff,
                             write_export)
from mutation_judging import (INTERNAL_ERROR, Mutant, SettingRun, Truth, annotation_spans, caught_by, compiles,
                              in_annotation, markdown, mutant_outcome, operator_family, score_explanation,
                              setting_outcome, stillborn, stratified_sample, tally, totals)

TRUTH = ROOT / "benchmarks" / "mutation_truth.toml"
LOCALIZER_FAILED = "(an internal error)"   # harness/check/crash.py's words for ddcheck's own side
COMMON = ["--model", "tiny", "--max-new-tokens", "10", "--stop-after", "1", "--dtype", "float32"]
# the quick matrix: topk 1 and 4, batch 1 and 3, page size 1 and 16, graph off and on, both acceptors,
# the torch backend and both of SGLang's extend kernels; cheapest first (a run stops at the first caught)
MATRIX = (
    ["--budget", "8", "--topk", "1", "--batch", "1", "--page-size", "1", "--no-cuda-graph", "--accept", "walk",
     "--backend", "torch"],
    ["--budget", "8", "--topk", "4", "--batch", "3", "--page-size", "16", "--cuda-graph", "--accept", "sglang",
     "--backend", "sglang-triton"],
    ["--budget", "8", "--topk", "4", "--batch", "3", "--page-size", "1", "--cuda-graph", "--accept", "walk",
     "--backend", "torch"],
    ["--budget", "16", "--topk", "1", "--batch", "1", "--page-size", "16", "--no-cuda-graph", "--accept", "sglang",
     "--backend", "sglang-unified"],
)


def cosmic_ray_mutants(cosmic_ray: str, truth: Truth, work: Path) -> list[Mutant]:
    """Every mutation cosmic-ray's `init` lists for the truth table's modules."""
    cfg, session = work / "cosmic-ray.toml", work / "session.sqlite"
    paths = ", ".join(json.dumps(p) for p in sorted(truth.modules))
    # the test command is never run: each mutant is applied and judged here
    cfg.write_text(f'[cosmic-ray]\nmodule-path = [{paths}]\ntimeout = 60.0\nexcluded-modules = []\n'
                   f'test-command = "false"\n[cosmic-ray.distributor]\nname = "local"\n')
    subprocess.run([cosmic_ray, "init", str(cfg), str(session)], cwd=ROOT, check=True, capture_output=True)
    dump = subprocess.run([cosmic_ray, "dump", str(session)], cwd=ROOT, check=True, capture_output=True, text=True)
    return [Mutant.from_dump(json.loads(line)[0]) for line in dump.stdout.splitlines() if line.strip()]


def in_scope(mutants: list[Mutant], truth: Truth) -> tuple[list[Mutant], int]:
    """The mutants the truth table covers, less those inside annotations; and how many annotation ones."""
    spans = {p: annotation_spans((ROOT / p).read_text()) for p in truth.modules}
    scoped = [m for m in mutants if truth.in_scope(m)]
    kept = [m for m in scoped if not in_annotation(m, spans[m.module])]
    return kept, len(scoped) - len(kept)


def setting_run(r: CliRun) -> SettingRun:
    s = r.summary or {}
    # ddcheck's own exception: the run's one line, or a localizer that raised (kept as a note, the verdict stands)
    internal = INTERNAL_ERROR in r.stderr_tail or any(LOCALIZER_FAILED in n for n in s.get("notes") or ())
    return SettingRun(exit=r.exit, what=(s.get("first") or {}).get("what"), has_summary=r.summary is not None,
                      internal_error=internal, fingerprint=r.fingerprint)


def without_machine_paths(text: str, tree: str) -> str:
    """The private copy's path shown as the tree's root, the interpreter's as <python>: no path of this
    machine in the results."""
    for path, shown in ((tree, "."), (sys.prefix, "<python>"), (sys.base_prefix, "<python>"),
                        (tempfile.gettempdir() + "/", "<tmp>/")):
        text = text.replace(path, shown)
    return text


def cosmic_ray_apply(cosmic_ray: str, m: Mutant) -> Callable[[Path], None]:
    """M written into a tree by `cosmic-ray apply`."""
    def mutate(tree: Path) -> None:
        subprocess.run([cosmic_ray, "apply", m.module, m.operator, str(m.occurrence)], cwd=tree, check=True,
                       capture_output=True)
    return mutate


def export_mutants(cosmic_ray: str, mutants: list[Mutant], truth: Truth) -> list[ExportedMutant]:
    """Each mutant as its unified diff: applied by cosmic-ray to a copy of its module alone, then undone."""
    out = []
    with tempfile.TemporaryDirectory(prefix="ddcheck-crexport-") as d:
        for m in mutants:
            f = Path(d) / m.module
            f.parent.mkdir(parents=True, exist_ok=True)
            before = (ROOT / m.module).read_text()
            f.write_text(before)
            cosmic_ray_apply(cosmic_ray, m)(Path(d))
            out.append(ExportedMutant(m, truth.stage_of(m), unified_diff(m.module, before, f.read_text())))
    return out


def judge(m: Mutant, truth: Truth, baseline: list[str | None], mutate: Callable[[Path], None], timeout_s: float,
          memory: int, matrix: tuple[list[str], ...] = MATRIX) -> dict:
    """Apply M (MUTATE writes it into a tree) to a private copy of the tree and run the matrix until a setting
    catches it."""
    row = {"mutant": m.key, "module": m.module, "operator": m.operator, "family": operator_family(m.operator),
           "occurrence": m.occurrence, "line": m.line, "definition": m.definition,
           "expected_stage": truth.stage_of(m), "diff": None, "runs": [], "outcome": None, "internal_error": False,
           "no_verdict": False, "stage": None, "quantity": None, "fault_class": None, "explanation": None,
           "explanation_score": None, "seconds": 0.0}
    with tempfile.TemporaryDirectory(prefix="ddcheck-crmutant-") as d:
        tree = Path(d)
        copy_tree(tree)
        before = (tree / m.module).read_text()
        mutate(tree)
        row["diff"] = "".join(difflib.unified_diff(before.splitlines(True), (tree / m.module).read_text()
                                                   .splitlines(True), m.module, m.module, n=0))
        if not compiles((tree / m.module).read_text(), m.module):
            return {**row, "outcome": "incompetent", "caught_by": None}
        runs = []
        for args in matrix:
            r = run_cli(tree, [*args, *COMMON], tree / "records.jsonl", timeout_s, memory)
            sr = setting_run(r)
            runs.append(sr)
            o = setting_outcome(sr)
            row["seconds"] += r.seconds
            row["runs"].append({"setting": " ".join(args), "exit": r.exit, "outcome": o, "what": sr.what,
                                "stderr_tail": r.stderr_tail if o != "pass" else ""})
            row["internal_error"] |= sr.internal_error
            row["no_verdict"] |= r.exit not in (0, 124) and r.summary is None
            if o in ("caught", "crash-only", "no-judge", "timeout") and row["stage"] is None and r.summary:
                row.update(stage=r.summary.get("stage"), quantity=r.summary.get("quantity"),
                           fault_class=r.summary.get("fault_class"), explanation=r.summary.get("explanation"))
            if o == "caught":
                row.update(stage=r.summary.get("stage"), quantity=r.summary.get("quantity"),
                           fault_class=r.summary.get("fault_class"), explanation=r.summary.get("explanation"))
                break
        row = json.loads(without_machine_paths(json.dumps(row), d))
    row["outcome"] = mutant_outcome(runs, baseline)
    row["caught_by"] = caught_by(runs)   # divergence | proven-crash | None
    if row["outcome"] == "caught":
        row["explanation_score"] = score_explanation(truth, row["expected_stage"], row["stage"])
    return row


def baseline_fingerprints(timeout_s: float, memory: int,
                          matrix: tuple[list[str], ...] = MATRIX) -> list[str | None]:
    """The unmutated tree over the matrix: every setting must pass (else no mutant can be judged)."""
    out = []
    with tempfile.TemporaryDirectory(prefix="ddcheck-crbase-") as d:
        copy_tree(Path(d))
        for args in matrix:
            r = run_cli(Path(d), [*args, *COMMON], Path(d) / "records.jsonl", timeout_s, memory)
            if r.exit != 0:
                raise SystemExit(f"the unmutated tree fails `{' '.join(args)}` (exit {r.exit}): {r.stderr_tail}")
            out.append(r.fingerprint)
    return out


def tree_revision() -> str:
    """The commit the mutants were cut from, marked when the working tree differs from it."""
    if shutil.which("git") is None:
        return "unknown (no git here)"
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return head.strip() + ("+changes" if dirty else "")


def report(rows: list[dict], meta: dict, out: Path) -> None:
    body = {**meta, "totals": totals(rows), "per_module": tally(rows, "module"),
            "per_operator": tally(rows, "family"), "per_stage": tally(rows, "expected_stage"),
            "rows": sorted(rows, key=lambda r: r["mutant"])}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(body, indent=1))
    tmp.replace(out)   # a reader never sees half a file


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cosmic-ray", default=os.environ.get("COSMIC_RAY") or shutil.which("cosmic-ray") or "",
                    help="the cosmic-ray 8.x executable (default: $COSMIC_RAY, else on PATH; not with --from)")
    ap.add_argument("--sample", type=int, default=100, help="mutants to judge, stratified over modules (0: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reanchor", action="store_true", help="with --from: judge on a tree whose mutated modules "
                    "changed since the export; each mutant's hunk is applied where its lines stand now when they "
                    "stand in one place, left out (listed) otherwise")
    ap.add_argument("--only", default="", help="comma-separated mutant keys MODULE:OPERATOR:OCCURRENCE")
    ap.add_argument("--jobs", type=int, default=2, help="mutants judged at once")
    ap.add_argument("--device", default="cpu", help="--device of the settings on SGLang's kernels (cuda on a GPU "
                                                     "machine whose Triton cannot interpret them on the CPU)")
    ap.add_argument("--timeout-s", type=float, default=60.0, help="per ddcheck run")
    ap.add_argument("--memory-gib", type=float, default=6.0, help="address-space cap per ddcheck run")
    ap.add_argument("--time-budget-s", type=float, default=0.0, help="start no mutant after this long (0: none)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "mutation-engine.json"))
    ap.add_argument("--tables", metavar="JSON", help="print the per-module and per-operator tables of a results "
                    "file and exit (nothing is run)")
    ap.add_argument("--export", metavar="FILE", help="write the sampled mutants (their diffs) as JSON and exit "
                    "(nothing is judged)")
    ap.add_argument("--from", dest="from_file", metavar="FILE", help="judge the mutants of an --export file, "
                    "each diff applied in plain Python (no cosmic-ray)")
    ap.add_argument("--skip", nargs="+", default=[], metavar="JSON", help="with --from: leave out the mutants "
                    "these results files judged")
    ap.add_argument("--shard", metavar="I/N", help="with --from: judge only the mutants whose index is I mod N")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="results files of shards into one (--out)")
    a = ap.parse_args(argv)
    if a.tables or a.merge:
        return a
    if (a.shard or a.skip) and not a.from_file:
        ap.error("--shard and --skip go with --from")
    if a.shard:
        try:
            parse_shard(a.shard)
        except ValueError as e:
            ap.error(str(e))
    if a.from_file and a.export:
        ap.error("--from judges an export; --export writes one")
    if not a.from_file and (not a.cosmic_ray or not shutil.which(a.cosmic_ray)):
        ap.error("cosmic-ray 8.x not found: install the [mutate] extra (a venv of its own) and pass --cosmic-ray, "
                 "or judge an export with --from")
    if a.sample < 0 or a.jobs < 1 or a.timeout_s <= 0 or a.memory_gib < 0:
        ap.error("--sample >= 0, --jobs >= 1, --timeout-s > 0 and --memory-gib >= 0 (0: no cap)")
    return a


def print_tables(path: Path) -> int:
    body = json.loads(path.read_text())
    print(json.dumps(body["totals"], indent=1))
    for key, name in (("per_module", "module"), ("per_operator", "operator"), ("per_stage", "stage")):
        print("\n" + markdown(body[key], name))
    return 0


def merge(paths: list[Path], out: Path) -> int:
    """Shards' results files as one: every row once, the totals and tallies recomputed."""
    bodies = [json.loads(p.read_text()) for p in paths]
    rows = list({r["mutant"]: r for b in bodies for r in b["rows"]}.values())
    rows = [{**r, "outcome": "incompetent", "caught_by": None, "explanation_score": None} if stillborn(r) else r
            for r in rows]   # judged before the compile check
    meta = {k: v for k, v in bodies[0].items() if k not in ("totals", "per_module", "per_operator", "per_stage",
                                                             "rows", "shard", "seconds", "command")}
    meta.update(merged=[str(p) for p in paths], commands=[b.get("command") for b in bodies],
                seconds=[b.get("seconds") for b in bodies])
    report(rows, meta, out)
    print(json.dumps(totals(rows), indent=1))
    print(f"wrote {out}")
    return 0


def listed_and_chosen(a: argparse.Namespace, truth: Truth) -> tuple[list[Mutant], dict]:
    """cosmic-ray's mutants, in scope, sampled (or --only); what the results say of the listing."""
    with tempfile.TemporaryDirectory(prefix="ddcheck-cr-") as d:
        listed = cosmic_ray_mutants(a.cosmic_ray, truth, Path(d))
    mutants, annotations = in_scope(listed, truth)
    if a.only:
        chosen = [m for m in mutants if m.key in a.only.split(",")]
    else:
        chosen = stratified_sample(mutants, a.sample or len(mutants), a.seed)
    version = subprocess.run([a.cosmic_ray, "--version"], capture_output=True, text=True).stdout.strip()
    return chosen, {"cosmic_ray": version, "tree": tree_revision(), "listed": len(listed), "in_scope": len(mutants),
                    "in_annotations": annotations, "seed": a.seed}


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.tables:
        return print_tables(Path(a.tables))
    out = Path(a.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    if a.merge:
        return merge([Path(p) for p in a.merge], out)
    truth, memory = Truth.load(TRUTH), int(a.memory_gib * GiB)
    args = [("cosmic-ray" if x == a.cosmic_ray else x) for x in (argv if argv is not None else sys.argv[1:])]
    # the command as run, paths inside the project relative to it (no machine's paths in the results)
    command = ("PYTHONPATH=$PWD python benchmarks/mutation_engine.py " + shlex.join(args)).replace(f"{ROOT}/", "")
    if a.from_file:
        listing, exported = read_export(Path(a.from_file), ROOT, a.reanchor)
        judged = {r["mutant"] for f in a.skip for r in json.loads(Path(f).read_text())["rows"]}
        try:
            exported = pick(exported, set(filter(None, a.only.split(","))), judged)
        except ValueError as e:   # a usage error: nothing judged, nothing written
            print(f"mutation_engine.py: error: --only: {e}", file=sys.stderr)
            return 2
        if a.shard:
            exported = shard(exported, *parse_shard(a.shard))
        work = [(e.mutant, e.apply) for e in exported]
        listing = {k: listing.get(k) for k in ("cosmic_ray", "tree", "listed", "in_scope", "in_annotations", "seed",
                                               *(("changed_modules", "reanchored", "not_reanchored") if a.reanchor
                                                 else ()))}
        listing.update(exported_from=Path(a.from_file).name, shard=a.shard, tree_here=tree_revision())
    else:
        chosen, listing = listed_and_chosen(a, truth)
        if a.export:
            exported = export_mutants(a.cosmic_ray, chosen, truth)
            write_export(Path(a.export), {**listing, "command": command, "chosen": len(exported)}, exported,
                         {m: sha256((ROOT / m).read_text()) for m in sorted({m.module for m in chosen})})
            print(f"wrote {len(exported)} mutants to {a.export}")
            return 0
        work = [(m, cosmic_ray_apply(a.cosmic_ray, m)) for m in chosen]
    t0 = time.monotonic()
    # --device: the settings that run SGLang's kernels (the torch backend's graphs are CPU twins only)
    matrix = MATRIX if a.device == "cpu" else tuple([*m, "--device", a.device if m[-1].startswith("sglang") else "cpu"]
                                                    for m in MATRIX)
    baseline = baseline_fingerprints(a.timeout_s, memory, matrix)
    meta = {"command": command, **listing, "matrix": [" ".join(m) for m in matrix], "common": " ".join(COMMON),
            "modules": sorted(truth.modules), "chosen": len(work), "jobs": a.jobs, "timeout_s": a.timeout_s,
            "memory_gib": a.memory_gib}
    rows: list[dict] = []
    with ThreadPoolExecutor(a.jobs) as pool:
        pending = iter(work)
        running = set()

        def submit_next() -> None:
            if a.time_budget_s and time.monotonic() - t0 > a.time_budget_s:
                return
            item = next(pending, None)
            if item is not None:
                running.add(pool.submit(judge, item[0], truth, baseline, item[1], a.timeout_s, memory, matrix))

        for _ in range(a.jobs):
            submit_next()
        while running:
            done = next(as_completed(running))
            running.discard(done)
            r = done.result()
            rows.append(r)
            print(f"{len(rows):4} {r['outcome']:10} {r['caught_by'] or '-':12} {r['explanation_score'] or '-':7} "
                  f"{r['expected_stage']:18} {str(r['stage']):14} {r['seconds']:5.0f}s {r['mutant']} "
                  f"({r['definition']})", flush=True)
            report(rows, {**meta, "seconds": round(time.monotonic() - t0)}, out)
            submit_next()
    print(json.dumps(totals(rows), indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
