"""The CI gate: every case's matrix must pass, every expected fault must be
caught (and, when the localizer names it, named as its catalog entry says).
Planning turns cases into SettingJobs; judging turns results into one
Verdict per setting and per expected fault; JUnit XML and JSON come from the
verdicts.

Layer: workflows. Imports report, the check and below; never cli."""
from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, replace

from harness.workflows.cases import Case, model_vocab
from harness.report.model import describe_first
from harness.engine.settings import UsageError
from harness.workflows.sweep import SettingJob, SettingResult, short_label


@dataclass(frozen=True)
class Verdict:
    case: str
    kind: str           # setting | fault
    name: str           # testcase name
    setting: str        # the reproduce command
    passed: bool
    message: str        # first divergence / explanation, or why the fault was not caught
    seconds: float
    skipped: bool = False   # not run here (a port or this machine cannot run it): neither a pass nor a failure


def plan(cases: list[Case], inject: str | None = None) -> list[SettingJob]:
    """The jobs of every case: matrix settings (each distinct setting once, in
    file order), then expected faults. `inject` switches a fault on over every
    matrix setting where it can show."""
    from harness.faults import why_cannot_show
    jobs: list[SettingJob] = []
    shown = 0
    for case in cases:
        vocab = model_vocab(case.base.model)
        for s, label in case.labelled_settings():
            if inject and not s.fault and not why_cannot_show(inject, s, vocab):
                s = replace(s, fault=inject)  # where it cannot show, the setting runs fault-free
                shown += 1
            jobs.append(SettingJob(len(jobs), s, case.prompts_of(s), case.name, label,
                                   acceptance=None if s.fault else case.acceptance_for(label)))
        for f in case.faults:
            for s in map(case.with_tolerance, f.under.settings(case.base)):
                jobs.append(SettingJob(len(jobs), s, case.prompts_of(s), case.name, f"fault {f.name}", f.name))
    if inject and not shown:   # a fault switched on nowhere would make a vacuous pass
        raise UsageError(f"--fault {inject} can show in no matrix setting of "
                         f"{', '.join(c.name for c in cases)}; it needs: {catalog_shows_when(inject)}")
    return jobs


def catalog_shows_when(name: str) -> str:
    from harness.faults.registry import catalog
    return catalog()[name].shows_when


def judge(jobs: list[SettingJob], results: list[SettingResult]) -> list[Verdict]:
    from harness.faults.registry import catalog
    out = []
    for job, r in zip(jobs, results):
        s = job.settings
        name = f"{job.label}: {short_label(s)}"
        first = describe_first(r.summary)
        explanation = (r.localize or {}).get("explanation") or r.summary.get("explanation")
        kind = "setting" if job.expect_fault is None else "fault"
        if r.summary.get("skipped"):   # nothing was compared: no acceptance, no fault caught or missed
            out.append(Verdict(job.case, kind, name, r.setting, True, f"skipped: {r.summary['skipped']}", r.wall_s,
                               skipped=True))
            continue
        if job.expect_fault is None:
            passed, msg = r.passed, ""
            if r.summary.get("verdict") == "port-error":   # not a divergence: the port's own code raised
                msg = f"port error: {(r.summary.get('crash') or {}).get('sentence')}"
            elif not r.passed:
                msg = f"diverged: {first}" + (f"; {explanation}" if explanation else "")
            elif r.summary.get("acceptance_shortfall"):   # run_job wrote the baseline's verdict into the record
                passed, msg = False, f"acceptance: {r.summary['acceptance_shortfall']}"
            out.append(Verdict(job.case, "setting", name, r.setting, passed, msg, r.wall_s))
            continue
        fault = catalog()[job.expect_fault]
        named = (r.localize or {}).get("fault_class") or r.summary.get("fault_class")
        if r.passed:
            passed, msg = False, f"expected fault {fault.name} not caught: every node matched ({fault.breaks})"
        elif named != fault.expected_class:  # None: the run crashed or was not localized
            passed, msg = False, (f"fault {fault.name} caught ({first}) but named {named!r}, "
                                  f"expected {fault.expected_class!r}")
        else:
            passed, msg = True, f"caught: {first}" + (f"; {explanation}" if explanation else "")
        out.append(Verdict(job.case, "fault", name, r.setting, passed, msg, r.wall_s))
    return out


def stamp() -> dict:
    """Which ddcheck (version, git commit or null) and when (UTC), as the summary records carry it."""
    from harness.check.outputs import stamp as output_stamp
    return output_stamp()


def junit_xml(verdicts: list[Verdict], wall_s: float, made: dict | None = None) -> str:
    """One testsuite per case, one testcase per setting and per expected fault
    (classname = case name), the first divergence or explanation in the
    failure message; each suite stamped (timestamp, properties ddcheck_version
    and commit, "unknown" outside a git checkout)."""
    made = made or stamp()
    root = ET.Element("testsuites", name="ddcheck gate", tests=str(len(verdicts)),
                      failures=str(sum(not v.passed for v in verdicts)),
                      skipped=str(sum(v.skipped for v in verdicts)), time=f"{wall_s:.1f}", timestamp=made["time"])
    for case in dict.fromkeys(v.case for v in verdicts):
        mine = [v for v in verdicts if v.case == case]
        suite = ET.SubElement(root, "testsuite", name=case, tests=str(len(mine)),
                              failures=str(sum(not v.passed for v in mine)), skipped=str(sum(v.skipped for v in mine)),
                              time=f"{sum(v.seconds for v in mine):.1f}", timestamp=made["time"])
        props = ET.SubElement(suite, "properties")
        for key in ("ddcheck_version", "commit"):
            ET.SubElement(props, "property", name=key, value=str(made.get(key) or "unknown"))
        for v in mine:
            tc = ET.SubElement(suite, "testcase", classname=case, name=v.name, time=f"{v.seconds:.1f}")
            if v.skipped:
                ET.SubElement(tc, "skipped", message=v.message)
            elif not v.passed:
                fail = ET.SubElement(tc, "failure", message=v.message, type=v.kind)
                fail.text = f"{v.message}\nreproduce: {v.setting}"
            else:
                ET.SubElement(tc, "system-out").text = f"{v.message or 'all nodes match'}\nreproduce: {v.setting}"
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


_JUNIT_TIMES = re.compile(r' (time|timestamp)="[^"]*"')   # the only attributes junit_xml fills from the clock


def junit_run_to_run(xml: str) -> str:
    """The JUnit of junit_xml without what differs between two runs of one gate (wall times and the
    timestamp): what two executors, or two runs, must agree on. The commit and version stay."""
    return _JUNIT_TIMES.sub("", xml)


def json_summary(cases: list[Case], verdicts: list[Verdict], wall_s: float, records: str | None,
                 made: dict | None = None) -> str:
    """The verdicts per case, with the counts the stdout line and the JUnit
    give, and the stamp (ddcheck_version, commit or null, time)."""
    doc = {"passed": all(v.passed for v in verdicts), **counts(verdicts), **(made or stamp()),
           "wall_s": round(wall_s, 2), "records": records,
           "cases": [{"name": c.name, "file": str(c.path),
                      "passed": all(v.passed for v in verdicts if v.case == c.name),
                      "verdicts": [asdict(v) for v in verdicts if v.case == c.name]} for c in cases]}
    return json.dumps(doc, indent=2) + "\n"


def counts(verdicts: list[Verdict]) -> dict:
    """The tallies every rendering states (stdout, JSON, JUnit's attributes)."""
    n_faults = sum(v.kind == "fault" for v in verdicts)
    return {"settings": len(verdicts) - n_faults, "expected_faults": n_faults,
            "failing": sum(not v.passed for v in verdicts), "skipped": sum(v.skipped for v in verdicts)}


def gate_line(verdicts: list[Verdict], wall_s: float, jobs: int, records) -> str:
    """The gate's last stdout line."""
    n = counts(verdicts)
    return (f"gate: {'PASS' if not n['failing'] else 'FAIL'}: {n['settings']} settings, {n['expected_faults']} "
            f"expected faults, {n['failing']} failing"
            + (f", {n['skipped']} skipped (not run here: not checked, not passed)" if n["skipped"] else "")
            + f", in {wall_s:.1f} s on {jobs} jobs; records {records}")


CI_WIDTH = 80


def ci_line(v: Verdict) -> tuple[str, str]:
    """A failed verdict for a CI log: its name, then its message (each line
    cut to CI_WIDTH columns by the printer); the whole message and the
    reproduce command are in the records, the JUnit and `ddcheck report`."""
    return f"FAIL {v.case} / {v.name}", v.message


def fit(line: str, width: int = CI_WIDTH) -> str:
    return line if len(line) <= width else line[:width - 3] + "..."
