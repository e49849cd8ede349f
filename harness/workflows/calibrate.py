"""`ddcheck calibrate`: measure a model's fault-free error distribution over a
case's settings and write the tolerances it supports into the case file.

bf16 / fp16 settings are judged by the noise floor; calibration keeps the
floor and sets
    multiplier  = max(1.5, 1.25 x the largest fault-free e / max(e_twin, e_rounded, floor))
    ceiling     = min(0.9, max(3 x the largest fault-free error, 2 x floor))
    drift_limit = max(the dtype's default, 1.25 x the largest fault-free run drift)
A calibrated multiplier is fixed: it does not grow with a run's node count
as the default does (harness/verdict/noise_floor.py). A fit to correct runs
alone says nothing of what the rule still sees: calibrate_leaks.py runs the one-key leaks under the rule before it is written (a multiplier set
above a leak's ratio would let that leak pass: on SmolLM2 the one-padding-
column leak sits at 0.8 to 2.4 in bf16, under any multiplier a correct run
needs) and names every leak the rule lets pass.
float32 settings get a fixed tolerance of 10 x the largest fault-free error
(at least 1e-7). The margins mirror the defaults' own (harness/check/compare/
noise_floor.py, tolerance.py): the correct runs sit well inside, and the
report of the calibration shows the distribution it came from.


Layer: workflows. Imports report, the check and below; never cli."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from harness.verdict.noise_floor import NOISE_FLOOR
from harness.engine.settings import RunSettings, UsageError


@dataclass(frozen=True)
class Calibration:
    dtype: str
    settings: int
    nodes: int
    max_rel_err: float
    p99_rel_err: float
    max_noise_ratio: float | None
    failed: int                                    # settings that diverged even so (never written)
    value: float | tuple[float, float, float, float]   # what goes into [tolerances]

    def toml(self) -> str:
        if isinstance(self.value, tuple):
            m, f, c, d = self.value
            return (f"{self.dtype} = {{ multiplier = {m:.3g}, floor = {f:.3g}, ceiling = {c:.3g}, "
                    f"drift_limit = {d:.3g} }}")
        return f"{self.dtype} = {self.value:.3g}"


def parse_noise_rule(text: str | None) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        values = ()
    if len(values) not in (3, 4):
        raise UsageError(f"--noise-rule takes MULTIPLIER,FLOOR,CEILING[,DRIFT_LIMIT] (e.g. 2.2,0.0039,0.25,1.5), "
                         f"got {text!r}")
    return values


def calibration_settings(case) -> list[RunSettings]:
    """The case's fault-free settings, judged by the default rule for their dtype, run to the end."""
    out = []
    for s in case.settings():
        if s.fault is None:
            out.append(replace(s, tolerance=None, noise_rule=None, verdict="auto", stop_after=0))
    return out


def measure(settings: list[RunSettings], on_setting=None) -> list[Calibration]:
    from harness.check.differential import check
    from harness.check.prepare import LoadCache
    from harness.check.records import RecordWriter
    from harness.workflows.cases import prompts_for
    loads = LoadCache()   # a case's settings of one model read its checkpoint once
    errs: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    drifts: dict[str, list[float]] = {}
    counts: dict[str, list[int]] = {}
    for i, s in enumerate(settings):
        w = RecordWriter(None)
        # every node's twin: the multiplier is fit to every node's ratio, not the upper bound a skipped twin leaves
        summary = check(replace(loads.prepare(s, prompts_for(s)), every_twin=True), w, localize=False)
        nodes = [r for r in map(json.loads, w.lines) if r.get("kind") == "node" and not r["is_padding"]]
        errs.setdefault(s.dtype, []).extend(float(r["rel_err"]) for r in nodes if isinstance(r["rel_err"], float))
        ratios.setdefault(s.dtype, []).extend(r["noise_ratio"] for r in nodes if r.get("noise_ratio") is not None)
        if summary.noise_drift is not None:
            drifts.setdefault(s.dtype, []).append(summary.noise_drift)
        c = counts.setdefault(s.dtype, [0, 0])
        c[0] += 1
        c[1] += not summary.passed
        if on_setting:
            on_setting(i, s, summary)
    return [_calibrate(d, errs[d], ratios[d], *counts[d], drifts=drifts.get(d, [])) for d in errs]


def _calibrate(dtype: str, errs: list[float], ratios: list[float], n_settings: int, failed: int,
               drifts: list[float] = ()) -> Calibration:
    if not errs:
        raise UsageError(f"calibrate: the {dtype} settings judged no node")
    ordered = sorted(errs)
    top, p99 = ordered[-1], ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    if dtype in NOISE_FLOOR:
        floor = NOISE_FLOOR[dtype].floor
        worst = max(ratios) if ratios else 1.0
        drift = round(max([NOISE_FLOOR[dtype].drift_limit] + [1.25 * d for d in drifts]), 3)
        value = (round(max(1.5, 1.25 * worst), 3), floor, round(min(0.9, max(3 * top, 2 * floor)), 4), drift)
        return Calibration(dtype, n_settings, len(errs), top, p99, worst, failed, value)
    return Calibration(dtype, n_settings, len(errs), top, p99, None, failed, float(f"{max(10 * top, 1e-7):.3g}"))


def noise_rules(calibrations: list[Calibration]) -> dict[str, tuple[float, ...]]:
    """dtype -> the calibrated noise-floor rule, for the low-precision dtypes."""
    return {c.dtype: c.value for c in calibrations if isinstance(c.value, tuple)}


def write_tolerances(case_path: Path, calibrations: list[Calibration], out: Path,
                     notes: list[str] = ()) -> str:
    """The case file's text with its [tolerances] table replaced by the
    calibrated one (everything else kept line for line); validated by
    parsing it back before it is written, atomically."""
    from harness.workflows.cases import load_case
    from harness.check.outputs import replace_atomically
    lines = Path(case_path).read_text(encoding="utf-8").splitlines()
    kept, skipping = [], False
    for line in lines:
        header = line.strip().startswith("[")
        if header:
            skipping = line.strip() == "[tolerances]"
        if not skipping:
            kept.append(line)
    while kept and not kept[-1].strip():
        kept.pop()
    text = "\n".join(kept + ["", "[tolerances]   # ddcheck calibrate: see docs/CASES.md"]
                     + [c.toml() for c in calibrations] + list(notes)) + "\n"
    probe = out.with_name(f".{out.name}.calibrate-check.toml")
    try:
        probe.write_text(text, encoding="utf-8")
        load_case(probe)   # the new file must parse as a case, or nothing is written
    finally:
        probe.unlink(missing_ok=True)
    replace_atomically(out, text)
    return text
