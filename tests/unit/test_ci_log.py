"""Readable in a CI log (no terminal, 80 columns): a failing sweep or gate
prints a tally, one line per failed setting with its first divergence and
explanation, and a verdict line; `run` prints its records path whole;
`faults --check` reports each run as it finishes."""
from __future__ import annotations

from typer.testing import CliRunner

from harness.cli import _register, app

_register()
CI = {"COLUMNS": "80", "TERM": "dumb"}


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def test_failing_sweep_is_one_line_per_failed_setting_and_a_verdict(tmp_path):
    out = tmp_path / "a-rather-long-folder-name-for-the-records-of-this-sweep" / "sweep-records.jsonl"
    r = CliRunner().invoke(app, ["sweep", "--budget", "4,16", "--backend", "torch", "--max-new-tokens", "2",
                                 "--jobs", "1", "--fault", "padded-kv-visible", "--out", str(out)], env=CI)
    assert r.exit_code == 1, r.output
    lines = _lines(r.stdout)
    assert not any("│" in ln or "━" in ln for ln in lines), r.stdout   # no table squeezed into 80 columns
    assert lines[0] == "sweep: 1 settings: 1 DIVERGE"
    assert all(len(ln) <= 80 for ln in lines[:-2]), r.stdout   # the failures fit 80 columns
    i = next(i for i, ln in enumerate(lines) if ln.startswith("DIVERGE "))
    assert "sweep/flags b16 k1" in lines[i]
    assert lines[i + 1].startswith("    padding-leak: step 0, request 0, node")   # named, then where
    assert lines[-2] == f"sweep: each failure in full, with its reproduce command: ddcheck report {out}"
    assert lines[-1] == f"sweep: FAIL: 1 settings, 1 failing; records {out}"


def test_failing_gate_prints_its_failures_and_verdict_and_its_table_says_gate(tmp_path):
    case = tmp_path / "broken.toml"
    case.write_text('max_new_tokens = 2\n[[matrix]]\nlabel = "clean"\nbudget = [4, 16]\n'
                    '[[matrix]]\nlabel = "leak"\nbudget = 16\nfault = "padded-kv-visible"\n')
    argv = ["gate", str(case), "--jobs", "1", "--device", "cpu", "--out", str(tmp_path / "g.jsonl")]
    r = CliRunner().invoke(app, argv, env=CI)
    assert r.exit_code == 1, r.output
    lines = _lines(r.stdout)
    assert lines[0] == "gate: 3 settings: 2 pass, 1 DIVERGE", r.stdout
    assert all(len(ln) <= 80 for ln in lines[1:-2]), r.stdout   # each failure in two lines of 80 columns
    assert lines[1].startswith("FAIL broken / leak: b16 k1") and lines[2].startswith("    diverged: step 0")
    assert lines[3] == f"gate: each failure in full, with its reproduce command: ddcheck report {tmp_path / 'g.jsonl'}"
    assert lines[-1].startswith("gate: FAIL: 3 settings, 0 expected faults, 1 failing") and len(lines) == 5
    junit_like = CliRunner().invoke(app, ["report", str(tmp_path / "g.jsonl"), "-o", str(tmp_path / "g.html")])
    assert junit_like.exit_code == 1 and "--fault padded-kv-visible" in (tmp_path / "g.html").read_text()
    assert "sweep" not in r.stdout
    tty = CliRunner().invoke(app, argv, env={"COLUMNS": "200", "FORCE_COLOR": "1"})   # on a terminal: the table
    assert tty.exit_code == 1 and "gate summary" in tty.stdout and "sweep summary" not in tty.stdout


def test_run_prints_its_records_path_whole(tmp_path):
    out = tmp_path / ("records-" + "x" * 90) / "run-with-a-long-name.jsonl"
    r = CliRunner().invoke(app, ["run", "--backend", "torch", "--max-new-tokens", "2", "--budget", "4",
                                 "--out", str(out)], env=CI)
    assert r.exit_code == 0, r.output
    assert f"records: {out}" in r.stdout.splitlines()


def test_faults_check_reports_each_run_as_it_finishes(tmp_path):
    r = CliRunner().invoke(app, ["faults", "--check", "--quick", "--seeds", "1", "--fault", "padded-kv-visible",
                                 "--device", "cpu"], env=CI)
    assert r.exit_code == 0, r.output
    progress = [ln for ln in r.stderr.splitlines() if ln.startswith("[")]
    from harness.workflows.fault_selftest import CLEAN_QUICK
    n = 1 + len(CLEAN_QUICK)  # the fault, then the quick fault-free matrix at one seed
    assert progress[0].startswith(f"[1/{n}] padded-kv-visible seed 0: ok (")
    assert [ln.split("]")[0] for ln in progress] == [f"[{i}/{n}" for i in range(1, n + 1)]
    assert all("fault-free seed 0: ok" in ln for ln in progress[1:])
