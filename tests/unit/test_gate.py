"""`ddcheck gate`: exit codes, JUnit (one testcase per setting and per expected
fault, classname = case), JSON summary, an expected fault not caught."""
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness.cases import load_case
from harness.gate import judge, junit_xml, plan
from harness.sweep import SettingResult

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
    r = _ddcheck("gate", str(case), "--jobs", "1", "--junit", str(junit), "--json", str(js),
                 "--out", str(tmp_path / "g.jsonl"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "gate: PASS" in r.stdout and " s on 1 jobs" in r.stdout
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
    assert "budget=16" in failures[0].get("name") and failures[0].get("classname") == "mini"
    assert failures[0].find("failure").get("message").startswith("diverged: step")
    assert "--fault padded-kv-visible" in failures[0].find("failure").text


def test_usage_errors_exit_2_and_write_nothing(tmp_path):
    junit = tmp_path / "g.xml"
    for args in (["--fault", "nope"], [str(tmp_path / "missing.toml")],
                 [str(_write(tmp_path, "bad.toml", CASE.replace('name = "padded-kv-visible"', 'name = "nope"')))]):
        r = _ddcheck("gate", *args, "--junit", str(junit))
        assert r.returncode == 2 and r.stderr.startswith("ddcheck: error:") and not junit.exists(), args


def test_expected_fault_not_caught_fails_the_gate(tmp_path):
    case = load_case(_write(tmp_path, "mini.toml", CASE))
    jobs = plan([case])
    clean = {"passed": True, "max_rel_err": 1e-7, "first": None}
    results = [SettingResult(j.index, j.settings.command(), clean, None, (), 0.1) for j in jobs]
    verdicts = judge([case], jobs, results)
    assert [v.passed for v in verdicts] == [True, True, False]
    assert "not caught" in verdicts[2].message
    misnamed = results[:2] + [SettingResult(2, "x", {"passed": False, "first": None}, {"fault_class": "mask-shift"},
                                            (), 0.1)]
    v = judge([case], jobs, misnamed)[2]
    assert not v.passed and "named 'mask-shift'" in v.message
    xml = ET.fromstring(junit_xml(verdicts, 1.0))
    assert xml.get("failures") == "1" and "not caught" in xml.find(".//failure").get("message")


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _ddcheck(*args):
    return subprocess.run([sys.executable, "-c", "from harness.cli import main; main()", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
