"""`ddcheck gate`: exit codes, JUnit (one testcase per setting and per expected
fault, classname = case), JSON summary, an expected fault not caught."""
import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness.workflows.cases import load_case
from harness.workflows.gate import judge, junit_xml, plan
from harness.workflows.sweep import SettingResult

ROOT = Path(__file__).resolve().parents[2]
CASE = """
name = "mini"
max_new_tokens = 2
[[prompts]]
name = "code"
length = 6
accuracy = 0.9
[[matrix]]
label = "clean"
budget = [8, 16]
backend = "torch"
[[faults]]
name = "padded-kv-visible"
budget = 16
backend = "torch"
"""


@pytest.mark.slow
def test_gate_passes_writes_junit_and_json(tmp_path):
    case = _write(tmp_path, "mini.toml", CASE)
    junit, js = tmp_path / "g.xml", tmp_path / "g.json"
    html = tmp_path / "g.html"
    r = _ddcheck("gate", str(case), "--jobs", "1", "--junit", str(junit), "--json", str(js),
                 "--out", str(tmp_path / "g.jsonl"), "--html", str(html), "--device", "cpu")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "gate: PASS" in r.stdout and " s on 1 jobs" in r.stdout
    # the caught expected fault is neither a failure in the table nor in the report
    assert re.search(r"^gate: 3 settings: 2 pass, 1 caught$", r.stdout, re.M) and "DIVERGE" not in r.stdout
    assert "MISSED" not in r.stdout
    page = html.read_text()
    assert 'class="verdict good"' in page and "1 expected faults caught, 0 diverge" in page
    assert page.count('class="cell st-caught"') == 1 and "st-diverge" not in page.split("<body")[1].split("legend")[0]
    summaries = [json.loads(x) for x in (tmp_path / "g.jsonl").read_text().splitlines() if '"summary"' in x]
    assert [s.get("expect_fault") for s in summaries] == [None, None, "padded-kv-visible"]
    cases = ET.parse(junit).getroot().findall(".//testcase")
    assert len(cases) == 3 and {c.get("classname") for c in cases} == {"mini"}
    assert not ET.parse(junit).getroot().findall(".//failure")
    doc = json.loads(js.read_text())
    assert doc["passed"] and [v["kind"] for v in doc["cases"][0]["verdicts"]] == ["setting", "setting", "fault"]


@pytest.mark.slow
def test_fault_switched_on_in_a_case_fails_and_junit_names_the_setting(tmp_path):
    case = _write(tmp_path, "broken.toml", CASE.replace('label = "clean"', 'label = "clean"\nfault = "padded-kv-visible"')
                  .replace("budget = [8, 16]", "budget = 16"))
    junit = tmp_path / "g.xml"
    r = _ddcheck("gate", str(case), "--jobs", "1", "--junit", str(junit), "--out", str(tmp_path / "g.jsonl"))
    assert r.returncode == 1, r.stdout + r.stderr
    failures = ET.parse(junit).getroot().findall(".//testcase[failure]")
    assert len(failures) == 1
    assert "b16 k1 graph-off torch bs1" in failures[0].get("name") and failures[0].get("classname") == "mini"
    assert failures[0].find("failure").get("message").startswith("diverged: step")
    assert "--fault padded-kv-visible" in failures[0].find("failure").text


def test_usage_errors_exit_2_and_write_nothing(tmp_path):
    """The first from a real process, the rest in this one (each process start costs seconds)."""
    from typer.testing import CliRunner

    import harness.cli.gate_cmd  # noqa: F401  (registers the command)
    from harness.cli import app
    junit = tmp_path / "g.xml"
    r = _ddcheck("gate", "--fault", "nope", "--junit", str(junit))
    assert r.returncode == 2 and r.stderr.startswith("ddcheck: error:") and not junit.exists(), r.stderr
    for args in ([str(tmp_path / "missing.toml")], ["--device", "gpu"],
                 [str(_write(tmp_path, "bad.toml", CASE.replace('name = "padded-kv-visible"', 'name = "nope"')))]):
        r = CliRunner().invoke(app, ["gate", *args, "--junit", str(junit)])
        assert r.exit_code == 2 and r.stderr.startswith("ddcheck: error:") and not junit.exists(), (args, r.output)


def test_expected_fault_not_caught_fails_the_gate(tmp_path):
    case = load_case(_write(tmp_path, "mini.toml", CASE))
    jobs = plan([case])
    clean = {"passed": True, "max_rel_err": 1e-7, "first": None}
    results = [SettingResult(j.index, j.settings.command(), clean, None, (), 0.1) for j in jobs]
    verdicts = judge(jobs, results)
    assert [v.passed for v in verdicts] == [True, True, False]
    assert "not caught" in verdicts[2].message
    misnamed = results[:2] + [SettingResult(2, "x", {"passed": False, "first": None}, {"fault_class": "mask-shift"},
                                            (), 0.1)]
    v = judge(jobs, misnamed)[2]
    assert not v.passed and "named 'mask-shift'" in v.message
    xml = ET.fromstring(junit_xml(verdicts, 1.0))
    assert xml.get("failures") == "1" and "not caught" in xml.find(".//failure").get("message")


def test_an_expected_fault_that_crashed_unlocalized_is_not_caught(tmp_path):
    case = load_case(_write(tmp_path, "mini.toml", CASE))
    jobs = plan([case])
    clean = {"passed": True, "max_rel_err": 1e-7, "first": None}
    crash = {"passed": False, "first": None, "error": "IndexError: x", "fault_class": None}
    results = [SettingResult(j.index, j.settings.command(), clean, None, (), 0.1) for j in jobs[:2]]
    v = judge(jobs, results + [SettingResult(2, "x", crash, None, (), 0.1)])[2]
    assert not v.passed and "named None" in v.message


def test_a_skipped_setting_or_fault_is_a_skip_not_a_pass_or_a_miss(tmp_path):
    """A setting this machine or a port cannot run was never compared: no
    acceptance shortfall, no expected fault 'not caught', a JUnit <skipped>."""
    case = load_case(_write(tmp_path, "mini.toml", CASE.replace(
        'label = "clean"', 'label = "clean"\nacceptance = { mean_accepted_length = 2.0, band = 0.1 }')))
    jobs = plan([case])
    skipped = {"passed": True, "first": None, "skipped": "--cuda-graph on CUDA needs a backend that can be captured"}
    verdicts = judge(jobs, [SettingResult(j.index, j.settings.command(), skipped, None, (), 0.1) for j in jobs])
    assert [(v.kind, v.passed, v.skipped) for v in verdicts] == [("setting", True, True)] * 2 + [("fault", True, True)]
    assert all("can be captured" in v.message and "not caught" not in v.message for v in verdicts)
    xml = ET.fromstring(junit_xml(verdicts, 1.0))
    assert xml.get("failures") == "0" and xml.get("skipped") == "3" and len(xml.findall(".//skipped")) == 3


def test_plan_runs_a_setting_two_matrix_tables_share_once(tmp_path):
    text = CASE.replace("[[faults]]", '[[matrix]]\nlabel = "again"\nbudget = [16, 32]\nbackend = "torch"\n[[faults]]')
    jobs = plan([load_case(_write(tmp_path, "mini.toml", text))])
    matrix = [(j.settings.budget, j.label) for j in jobs if j.expect_fault is None]
    assert matrix == [(8, "clean"), (16, "clean"), (32, "again")]
    assert [j.index for j in jobs] == list(range(len(jobs)))


def test_gate_device_applies_to_every_job_and_cuda_without_cuda_is_a_usage_error(tmp_path):
    import torch

    from harness.workflows.sweep import on_device
    jobs = on_device(plan([load_case(_write(tmp_path, "mini.toml", CASE))]), "cuda")
    assert {j.settings.device for j in jobs} == {"cuda"} and jobs[2].expect_fault == "padded-kv-visible"
    if not torch.cuda.is_available():
        r = _ddcheck("gate", str(tmp_path / "mini.toml"), "--device", "cuda", "--out", str(tmp_path / "g.jsonl"))
        assert r.returncode == 2 and "no CUDA device" in r.stderr and not (tmp_path / "g.jsonl").exists()


@pytest.mark.parametrize("command", ["gate", "sweep"])
def test_device_flag_reaches_every_job_of_a_case(tmp_path, monkeypatch, command):
    """In process, with the pool and the backend check stubbed: --device cuda is
    applied to every job the gate or `sweep --case` plans (case files name no device)."""
    from typer.testing import CliRunner

    import harness.cli.gate_cmd  # noqa: F401  (registers the commands)
    import harness.cli.sweep_cmd as sweep_cmd
    import harness.workflows.sweep
    from harness.cli import app
    seen = []

    def fake_run(jobs, n_jobs, on_done=None, executor=None):
        seen.extend(jobs)
        return [SettingResult(j.index, j.settings.command(), {"passed": True}, None, (), 0.0) for j in jobs]

    monkeypatch.setattr(sweep_cmd, "run_jobs", fake_run)
    monkeypatch.setattr(sweep_cmd, "pick_device", lambda device: device)
    monkeypatch.setattr(sweep_cmd, "validate", lambda jobs: None)
    monkeypatch.setattr(harness.workflows.sweep, "validate", lambda jobs: None)
    case = str(_write(tmp_path, "mini.toml", CASE))
    args = [case] if command == "gate" else ["--case", case]
    r = CliRunner().invoke(app, [command, *args, "--device", "cuda", "--out", str(tmp_path / "g.jsonl")])
    assert len(seen) == (3 if command == "gate" else 2), r.output
    assert {j.settings.device for j in seen} == {"cuda"}


def test_judge_finds_the_catalog_without_it_being_imported_first():
    code = ("from harness.workflows.gate import judge; from harness.workflows.sweep import SettingJob, SettingResult;"
            "from harness.engine.settings import RunSettings;"
            "j = SettingJob(0, RunSettings(fault='padded-kv-visible'), case='c', label='f', "
            "expect_fault='padded-kv-visible');"
            "r = SettingResult(0, 'x', {'passed': False, 'fault_class': 'padding-leak'}, None, (), 0.1);"
            "print(judge([j], [r])[0].passed)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "True", out.stderr[-2000:]


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _ddcheck(*args):
    return subprocess.run([sys.executable, "-c", "from harness.cli import main; main()", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_junit_run_to_run_drops_the_clock_and_keeps_verdicts_and_stamp():
    """Two runs of one gate: other wall times and timestamps, the same JUnit once junit_run_to_run takes
    them out; another message, reproduce command or commit is still another JUnit."""
    from dataclasses import replace

    from harness.workflows.gate import Verdict, junit_run_to_run
    verdicts = [Verdict("mini", "setting", "clean: b8", "ddcheck run --budget 8", True, "", 1.0),
                Verdict("mini", "fault", "fault x: b16", "ddcheck run --budget 16", True, "caught: mask", 2.0)]
    made = {"time": "2026-01-01T00:00:00+00:00", "ddcheck_version": "0.1.0", "commit": "abc"}
    first = junit_xml(verdicts, 3.0, made)
    later = {**made, "time": "2026-01-02T01:02:03"}
    again = junit_xml([replace(v, seconds=v.seconds * 7) for v in verdicts], 9.5, later)
    assert first != again and junit_run_to_run(first) == junit_run_to_run(again)
    assert 'time="' not in junit_run_to_run(first) and "abc" in junit_run_to_run(first)
    others = (junit_xml([verdicts[0], replace(verdicts[1], message="caught: kv")], 3.0, made),
              junit_xml([replace(verdicts[0], setting="ddcheck run --budget 4"), verdicts[1]], 3.0, made),
              junit_xml(verdicts, 3.0, {**made, "commit": "def"}))
    assert all(junit_run_to_run(o) != junit_run_to_run(first) for o in others)
