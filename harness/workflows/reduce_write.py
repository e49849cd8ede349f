"""What `ddcheck reduce` writes: DIR/case.toml (a case file, docs/CASES.md)
and DIR/repro.py (a standalone script: the reduced setting's first failing
verify step against the oracle, exit 1 if it diverges).

Layer: workflows. Imports report, the check and below; never cli."""
from __future__ import annotations

import json
import textwrap
from dataclasses import fields
from pprint import pformat
from pathlib import Path

from harness.check.outputs import replace_atomically
from harness.engine.settings import RunSettings

# run settings a case file cannot hold: said in a comment when they are not the defaults
NOT_IN_CASES = ("device", "kv_poison", "eos_id", "verdict", "tf32", "oracle_device", "oracle")


def _toml(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return json.dumps(str(v))   # a TOML basic string is a JSON string


def _impl(impl: str | None) -> str | None:
    if impl is None:
        return None
    family, sep, where = impl.partition(":")
    return f"{family}{sep}{Path(where).expanduser().resolve()}" if sep else impl


def case_toml(result, records: Path) -> str:
    s, prompts = result.reduced.settings, result.reduced.prompts
    o = result.recorded
    lines = [f"# Written by `ddcheck reduce {records}`: the smallest setting found that still fails ({result.kind}).",
             f"# Recorded setting: {o.command()}",
             f"# Reduced setting's first divergence: {result.first}",
             "# Run it: ddcheck sweep --case THIS_FILE, or python repro.py beside it."]
    default = RunSettings()
    odd = [f"{k} = {getattr(s, k)!r}" for k in NOT_IN_CASES if getattr(s, k) != getattr(default, k)]
    if odd:
        lines.append(f"# Run settings a case file does not hold (give them to ddcheck run): {', '.join(odd)}")
    lines += ['name = "reduced"',
              f"description = {_toml(f'reduced from {records.name}: {result.kind}, ' + (result.fault_class or ''))}",
              f"model = {_toml(s.model)}", f"seed = {s.seed}", f"max_new_tokens = {s.max_new_tokens}",
              f"block_size = {s.block_size}"]
    if s.impl:
        lines.append(f"impl = {_toml(_impl(s.impl))}")
    if s.port_stages:
        lines.append(f"port_stages = {_toml(s.port_stages)}")
    if s.strict:
        lines.append("strict = true")
    for p in prompts:
        lines += ["", "[[prompts]]", f"name = {_toml(p.name)}", f"tokens = {_toml(list(p.tokens))}",
                  f"accuracy = {p.accuracy!r}"]
    lines += ["", "[[matrix]]", 'label = "reduced"', f"budget = {s.budget}", f"topk = {s.topk}", f"batch = {s.batch}",
              f"cuda_graph = {_toml(s.cuda_graph)}", f"backend = {_toml(s.backend)}", f"dtype = {_toml(s.dtype)}",
              f"accept = {_toml(s.accept)}"]
    if s.fault:
        lines.append(f"fault = {_toml(s.fault)}")
    if s.tolerance is not None:
        lines += ["", "[tolerances]", f"{s.dtype} = {s.tolerance!r}"]
    return "\n".join(lines) + "\n"


_STEP_BODY = '''
def main() -> int:
    p = prepare(replace(SETTINGS, fault=FAULT), PROMPTS)
    result = next((r for r in p.engine.rounds() if r.step == STEP), None)
    if result is None:
        print(f"the engine finished before verify step {STEP}: nothing diverged")
        return 0
    diverged = 0
    for rs in result.requests:
        tree = rs.tree
        ref = p.oracle.tree_logits(list(rs.prefix), list(tree.tokens), [-1] + [int(x) for x in tree.parents[1:]])
        parents = [-1] + [int(x) for x in tree.parents[1:]]
        twin = p.twin.tree_logits(rs.prefix, tree) if p.rule is not None else None
        rounded = (p.oracle.rounded_tree_logits(list(rs.prefix), list(tree.tokens), parents, SETTINGS.dtype,
                                                p.rounded_probabilities)
                   if p.rule is not None else None)
        for row in range(tree.q_len):
            if row >= tree.num_rows:   # a padding row is not judged by its logits, but must stay finite
                if not bool(torch.isfinite(rs.logits[row]).all()):
                    diverged += 1
                    print(f"request {rs.rid}, padding row {row}: logits not finite")
                continue
            m = compare_node(rs.logits[row], ref[row])
            tol = (p.rule.bound(compare_node(twin[row], ref[row]).rel_err, compare_node(rounded[row], ref[row]).rel_err)
                   if twin is not None else p.tolerance)
            if m.verdict(tol) == "diverge":
                diverged += 1
                print(f"request {rs.rid}, row {row} (depth {tree.depths[row]}): rel. error {m.rel_err:.2e} > {tol:.1e}")
    print(f"verify step {STEP}: {diverged} rows diverge from the float64 oracle" if diverged
          else f"verify step {STEP}: every row matches the float64 oracle")
    return 1 if diverged else 0
'''

_RUN_BODY = '''
def main() -> int:
    p = prepare(replace(SETTINGS, fault=FAULT), PROMPTS)
    summary = check(p, RecordWriter(None), localize=False)
    f = summary.first
    print("every check matches the float64 oracle" if summary.passed else
          f"{summary.verdict}: {f.what if f else 'audit'} at step {f.step if f else '-'}"
          + (f": {f.detail}" if f and f.detail else ""))
    return 0 if summary.passed else 1
'''


def repro_py(result, records: Path) -> str:
    s = result.reduced.settings
    settings = {f.name: getattr(s, f.name) for f in fields(RunSettings) if f.name != "fault"}
    if s.impl:
        settings["impl"] = _impl(s.impl)
    step_mode = result.step >= 0
    what = (f"runs verify steps 0..{result.step} of the reduced setting and judges step {result.step}'s rows "
            "against the float64 oracle" if step_mode else
            "runs the reduced setting's check against the float64 oracle (its divergence is not one verify "
            "step's rows)")
    what = "\n".join(textwrap.wrap(f"It {what}: exit 1 if it diverges, 0 if not.", 100))
    prompts = ",\n    ".join(f"PromptSpec({p.name!r}, {len(p.tokens)}, {p.accuracy!r}, {tuple(p.tokens)!r})"
                             for p in result.reduced.prompts)
    head = f'''"""Reproduction written by `ddcheck reduce {records.name}` ({result.kind}: {result.first}).

{what}
FAULT is the planted fault (None: the engine as it is); set FAULT = None to
see the same step pass without it. Needs ddcheck importable (installed, or PYTHONPATH at its checkout).
"""
import sys
from dataclasses import replace

import torch

from harness.check.differential import check

from harness.check.prepare import prepare
from harness.check.compare.metrics import compare_node
from harness.check.records import RecordWriter
from harness.engine.settings import PromptSpec, RunSettings

FAULT = {s.fault!r}
STEP = {result.step}
SETTINGS = RunSettings(**{pformat(settings, width=110, sort_dicts=False)})
PROMPTS = (
    {prompts},
)
'''
    tail = '''

if __name__ == "__main__":
    sys.exit(main())
'''
    return head + (_STEP_BODY if step_mode else _RUN_BODY) + tail


def write_outputs(result, records: Path, out: Path) -> None:
    replace_atomically(out / "case.toml", case_toml(result, records))
    replace_atomically(out / "repro.py", repro_py(result, records))
