"""`ddcheck ports`, side by side, and --impl through sweep and case files."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from harness.cli import _register, app
from harness.ports.registry import families

_register()
FIX = Path(__file__).resolve().parents[1] / "fixtures" / "ports"
DDU = FIX / "ddtree_utils"


def test_ports_lists_at_least_four_families_with_conventions():
    r = CliRunner().invoke(app, ["ports"], env={"COLUMNS": "220"})
    assert r.exit_code == 0, r.output
    names = list(families())
    assert len(names) >= 4
    for name in names:
        assert name in r.output
    assert "counts the root" in r.output and "drafts only" in r.output


def test_side_by_side_names_where_two_ports_differ(tmp_path):
    out = tmp_path / "sbs.jsonl"
    r = CliRunner().invoke(app, ["run", "--impl", f"ddtree-utils:{DDU / 'faithful.py'}",
                                 "--impl", f"ddtree-utils:{DDU / 'chain_accept.py'}", "--budget", "16", "--topk", "2",
                                 "--batch", "2", "--backend", "torch", "--max-new-tokens", "12", "--out", str(out)],
                           env={"COLUMNS": "200"})
    assert r.exit_code == 1, r.output
    sbs = [json.loads(x) for x in out.read_text().splitlines() if json.loads(x)["kind"] == "side-by-side"]
    assert len(sbs) == 1 and sbs[0]["first_difference"] and "accepted" in sbs[0]["first_difference"]
    summaries = [json.loads(x) for x in out.read_text().splitlines() if json.loads(x)["kind"] == "summary"]
    assert [s["passed"] for s in summaries] == [True, False]


def test_side_by_side_of_identical_ports_finds_no_difference(tmp_path):
    out = tmp_path / "sbs.jsonl"
    impl = f"ddtree-utils:{DDU / 'faithful.py'}"
    r = CliRunner().invoke(app, ["run", "--impl", impl, "--impl", f"ddtree-utils:{DDU / 'count_nonzero_tokens.py'}",
                                 "--budget", "16", "--topk", "2", "--backend", "torch", "--max-new-tokens", "6",
                                 "--out", str(out)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output   # no real token 0 in these drafts: the two agree row for row
    assert "identical" in r.output


def test_sweep_impl_axis_and_skip_verdict(tmp_path):
    pytest.importorskip("sglang")
    out = tmp_path / "s.jsonl"
    r = CliRunner().invoke(app, ["sweep", "--budget", "4,16", "--topk", "1", "--backend", "torch", "--jobs", "1",
                                 "--max-new-tokens", "6", "--impl", f"ddtree-utils:{DDU / 'faithful.py'}",
                                 "--impl", "sglang-eagle", "--out", str(out)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    summaries = [json.loads(x) for x in out.read_text().splitlines() if json.loads(x)["kind"] == "summary"]
    assert len(summaries) == 4
    skipped = [s for s in summaries if s.get("skipped")]
    assert len(skipped) == 1 and "sglang-eagle" in skipped[0]["setting"] and "--budget 16" in skipped[0]["setting"]
    assert "skip" in r.output


def test_case_file_impl_is_relative_to_the_case(tmp_path):
    from harness.workflows.cases import load_case
    (tmp_path / "port.py").write_text((DDU / "faithful.py").read_text())
    case = tmp_path / "c.toml"
    case.write_text('impl = "ddtree-utils:port.py"\nport_stages = "compile"\n[[matrix]]\nbudget = [16]\n')
    c = load_case(case)
    assert all(s.impl == f"ddtree-utils:{tmp_path / 'port.py'}" and s.port_stages == "compile" for s in c.settings())
    case.write_text('impl = "nosuch:port.py"\n[[matrix]]\nbudget = [16]\n')
    with pytest.raises(Exception, match="key 'impl'"):
        load_case(case)


def test_dflash2_beam_compile_on_cpu_names_the_missing_kernel():
    from harness.check.differential import check
    from harness.check.prepare import prepare
    from harness.check.records import RecordWriter
    from harness.engine.settings import RunSettings
    for fixture, ok in (("faithful", True), ("ancestor_one_short", False)):
        s = RunSettings(backend="torch", budget=16, topk=4, batch=2, max_new_tokens=8,
                        impl=f"dflash2-beam:{FIX / 'dflash2_beam' / (fixture + '.py')}")
        summary = check(prepare(s), RecordWriter(None), localize=False)
        assert summary.passed is ok
        assert "sgl_kernel.speculative" in summary.port["stubbed_imports"]
        assert summary.port["port_stages"] == ["compile"]
        if not ok:
            assert summary.first_finding.startswith("mask-missing-key")


def test_faults_check_with_a_port_skips_faults_on_its_stages():
    from harness.workflows.fault_selftest import self_check
    rows = list(self_check("torch", seeds=1, quick=True, faults=["mask-row-stride", "bonus-from-wrong-node"],
                           impl=f"ddtree-utils:{DDU / 'faithful.py'}"))
    # the port owns compile and accept: both faults swap stages it replaces, so neither runs
    assert rows[:2] == [None, None]
    clean = [r for r in rows if r is not None]
    assert clean and all(r.fault is None and r.ok for r in clean)


def test_report_names_the_audit_findings(tmp_path):
    from harness.report.html import write_report
    out, html = tmp_path / "r.jsonl", tmp_path / "r.html"
    r = CliRunner().invoke(app, ["run", "--impl", f"ddtree-utils:{DDU / 'padding_rows_masked.py'}", "--budget", "16",
                                 "--topk", "1", "--backend", "torch", "--max-new-tokens", "4", "--out", str(out)])
    assert r.exit_code == 1, r.output
    write_report([out], html)
    text = html.read_text()
    assert "Port audit findings" in text and "padding-row-empty" in text


BROKEN = FIX / "broken"


def _cli(*argv: str, cwd: Path):
    """The console script in a child process: a port that ends the interpreter
    at import must not take the test with it, however ddcheck is broken."""
    import os
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "harness", *argv], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=600)


@pytest.mark.parametrize("command", ["run", "gate"])
@pytest.mark.parametrize("fixture", ["exits_at_import", "os_exit_at_import"])
def test_a_port_that_exits_while_imported_is_a_port_import_failure_not_a_pass(command, fixture, tmp_path):
    """sys.exit(0) or os._exit(0) at the port's import: exit 2, one line naming
    the port import, nothing written (no records, no JUnit that a CI step
    could read as green)."""
    impl = f"ddtree-utils:{BROKEN / (fixture + '.py')}"
    if command == "run":
        argv = ["run", "--impl", impl, "--backend", "torch", "--max-new-tokens", "2", "--out", str(tmp_path / "r.jsonl")]
    else:
        case = tmp_path / "c.toml"
        case.write_text("max_new_tokens = 2\n[[matrix]]\nbudget = [4]\nbackend = \"torch\"\n")
        argv = ["gate", str(case), "--impl", impl, "--jobs", "1", "--device", "cpu", "--out", str(tmp_path / "g.jsonl"),
                "--junit", str(tmp_path / "g.xml")]
    before = set(tmp_path.iterdir())
    proc = _cli(*argv, cwd=tmp_path)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("ddcheck: error: ") and "port import failed" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert set(tmp_path.iterdir()) == before


def test_a_port_calling_sys_exit_at_import_is_a_port_error_in_process_too():
    """A worker that loads the port itself (the child's check passed, the
    file changed since) sees a PortError, not the port's exit."""
    from harness.ports.loading import load_port_module
    from harness.ports.protocol import PortError
    with pytest.raises(PortError, match=r"called sys.exit\(0\) while being imported"):
        load_port_module(BROKEN / "exits_at_import.py")
