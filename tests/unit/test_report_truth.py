"""The report says what the gate says: runs grouped by run id, the same
failure count as the JUnit, missing evidence shown as incomplete (exit 1)."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from typer.testing import CliRunner

from harness.cli import _register, app
from harness.report.model import group

_register()
CASE = """name = "small"
max_new_tokens = 6
[[matrix]]
label = "twice"
budget = [16]
topk = [1]
batch = [1]
cuda_graph = [true, false]
"""


def test_failing_gate_report_counts_equal_junit(tmp_path):
    case = tmp_path / "small.toml"
    case.write_text(CASE)
    out, junit, html = tmp_path / "g.jsonl", tmp_path / "g.xml", tmp_path / "g.html"
    r = CliRunner().invoke(app, ["gate", str(case), "--fault", "padded-kv-visible", "--jobs", "1", "--out", str(out),
                                 "--junit", str(junit), "--html", str(html), "--device", "cpu"])
    assert r.exit_code == 1, r.output
    failures = int(ET.parse(junit).getroot().get("failures"))
    views = group([out])
    assert failures == sum(v.status in ("diverge", "missed") for v in views) == 2
    runs = {json.loads(x).get("run") for x in out.read_text().splitlines()}
    assert len(runs) == 2 and None not in runs      # every record carries its run's id
    summary = next(json.loads(x) for x in out.read_text().splitlines() if json.loads(x)["kind"] == "summary")
    assert summary["ddcheck_version"] and summary["time"]
    assert "2 diverge" in html.read_text()


def test_two_runs_with_one_reproduce_command_stay_apart(tmp_path):
    out = tmp_path / "r.jsonl"
    args = ["run", "--backend", "torch", "--max-new-tokens", "4", "--budget", "4"]
    for _ in range(2):
        assert CliRunner().invoke(app, [*args, "--out", str(tmp_path / "one.jsonl")]).exit_code == 0
        out.write_text(out.read_text() + (tmp_path / "one.jsonl").read_text() if out.exists()
                       else (tmp_path / "one.jsonl").read_text())
    views = group([out])
    assert len(views) == 2 and views[0].setting == views[1].setting
    assert all(len(v.nodes) == len(views[0].nodes) for v in views)


def test_missing_evidence_is_incomplete_and_exits_1(tmp_path):
    src = tmp_path / "r.jsonl"
    r = CliRunner().invoke(app, ["run", "--backend", "torch", "--max-new-tokens", "4", "--fault", "padded-kv-visible",
                                 "--budget", "16", "--out", str(src)])
    assert r.exit_code == 1
    cut = tmp_path / "cut.jsonl"
    lines = src.read_text().splitlines()
    cut.write_text("\n".join(ln for ln in lines if json.loads(ln)["kind"] != "summary") + "\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for path in (cut, empty):
        html = tmp_path / f"{path.stem}.html"
        res = CliRunner().invoke(app, ["report", str(path), "-o", str(html)])
        assert res.exit_code == 1, res.output
        assert "1 incomplete" in res.output
        assert "incomplete" in html.read_text() and 'class="verdict bad"' in html.read_text()
    ok = CliRunner().invoke(app, ["run", "--backend", "torch", "--max-new-tokens", "4", "--out", str(tmp_path / "ok.jsonl")])
    assert ok.exit_code == 0
    assert CliRunner().invoke(app, ["report", str(tmp_path / "ok.jsonl"), "-o", str(tmp_path / "ok.html")]).exit_code == 0


def test_no_vacuous_verdicts(tmp_path):
    r = CliRunner().invoke(app, ["faults", "--fault", "nosuch"])
    assert r.exit_code == 2 and "unknown fault 'nosuch'" in r.output
    case = tmp_path / "c.toml"
    case.write_text(CASE.replace("budget = [16]", "budget = [4]"))   # budget 4, topk 1: no padding rows
    out = tmp_path / "g.jsonl"
    r = CliRunner().invoke(app, ["gate", str(case), "--fault", "padded-kv-visible", "--jobs", "1",
                                 "--out", str(out), "--device", "cpu"])
    assert r.exit_code == 2 and "can show in no matrix setting" in r.output, r.output
    assert not out.exists()


def test_a_printed_reproduce_command_reproduces_a_case_run(tmp_path):
    """A gate setting of a case with its own token prompts: the summary's
    reproduce command, run as printed, gives the same node records."""
    import shlex
    case = tmp_path / "p.toml"
    case.write_text('max_new_tokens = 6\n[[prompts]]\nname = "mine"\ntokens = [5, 9, 17, 3, 3, 40, 2]\n'
                    'accuracy = 0.8\n[[matrix]]\nbudget = [8]\ntopk = [2]\n')
    out = tmp_path / "g.jsonl"
    assert CliRunner().invoke(app, ["gate", str(case), "--jobs", "1", "--device", "cpu", "--out", str(out)]).exit_code == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    command = next(r for r in recs if r["kind"] == "summary")["setting"]
    assert f"--case {case}" in command
    again = tmp_path / "again.jsonl"
    argv = shlex.split(command)[1:] + ["--out", str(again)]
    assert CliRunner().invoke(app, argv).exit_code == 0

    def nodes(rs):
        return [{k: v for k, v in r.items() if k not in ("run", "setting")} for r in rs if r["kind"] == "node"]
    assert nodes(recs) == nodes(json.loads(x) for x in again.read_text().splitlines())
    streams = [r for r in recs if r["kind"] == "stream"]
    assert streams[0]["prompt"] == "mine"


def test_every_rendering_counts_the_same_passes_skips_and_failures(tmp_path):
    """stdout's gate line, the JSON, the JUnit and the HTML render one set of
    records: a skipped setting is a skip in each (never a green PASS in the
    HTML), a setting below its acceptance baseline a failure in each, and
    each carries the version, commit and time stamp."""
    from harness.workflows.cases import load_case
    from harness.workflows.gate import gate_line, json_summary, judge, junit_xml, plan
    from harness.report.html import write_report
    from harness.workflows.sweep import SettingResult, gate_expectation, write_jsonl
    from report_fixtures import summary
    case = tmp_path / "c.toml"
    case.write_text('max_new_tokens = 2\n[[matrix]]\nlabel = "m"\nbudget = [4, 8, 16, 32]\n'
                    'acceptance = { mean_accepted_length = 3.0, band = 0.5 }\n')
    cases = [load_case(case)]
    jobs = plan(cases)
    kinds = [dict(passed=True, mean_accepted_length=3.1), dict(passed=True, skipped="this machine cannot run it"),
             dict(passed=False), dict(passed=True, mean_accepted_length=1.2)]   # pass, skip, diverge, below baseline
    results = []
    for j, kind in zip(jobs, kinds):
        skip = kind.pop("skipped", None)
        rec = {**summary(j.settings.command(), kind.pop("passed"), fault=None), **kind, "run": f"r{j.index}"}
        if skip:
            rec["skipped"] = skip
        else:
            rec.update(gate_expectation(j, rec))
        results.append(SettingResult(j.index, j.settings.command(), rec, None, (json.dumps(rec),), 0.1))
    out = tmp_path / "g.jsonl"
    write_jsonl(results, out)
    verdicts = judge(jobs, results)
    line = gate_line(verdicts, 1.0, 1, out)
    doc = json.loads(json_summary(cases, verdicts, 1.0, str(out)))
    junit = ET.fromstring(junit_xml(verdicts, 1.0))
    html = tmp_path / "g.html"
    views = write_report([out], html)
    page = html.read_text()
    assert "4 settings, 0 expected faults, 2 failing, 1 skipped" in line, [(v.passed, v.message) for v in verdicts]
    assert (doc["settings"], doc["failing"], doc["skipped"], doc["passed"]) == (4, 2, 1, False)
    assert (junit.get("tests"), junit.get("failures"), junit.get("skipped")) == ("4", "2", "1")
    assert [v.status for v in views] == ["pass", "skip", "diverge", "below-baseline"]
    assert "4 settings: 1 pass, 1 skipped (not run here: not checked, not passed), 1 diverge, " \
           "1 below the acceptance baseline, 0 incomplete" in page
    assert page.count('<span class="badge st-skip">SKIP</span>') == 1
    assert page.count('<span class="badge st-pass">PASS</span>') == 1
    assert doc["ddcheck_version"] and doc["time"] and "commit" in doc
    props = {p.get("name"): p.get("value") for p in junit.iter("property")}
    assert junit.get("timestamp") and props["ddcheck_version"] == doc["ddcheck_version"] and props["commit"]
    unstamped = ET.fromstring(junit_xml(verdicts, 1.0, {"ddcheck_version": "9", "commit": None, "time": "t"}))
    assert {p.get("name"): p.get("value") for p in unstamped.iter("property")}["commit"] == "unknown"
