"""Stale outputs: once run, sweep or gate accept their inputs, an earlier
output of the same name (JSONL, JUnit, JSON, HTML) is replaced, atomically,
by a placeholder that says the run is incomplete (never unlinked first), so a
run killed during the work leaves no previous "passed": true and no missing
file. A usage error leaves them in place (nothing touched)."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import harness.cli as cli
import harness.cli.run_cmd as run_cmd
import harness.cli.sweep_cmd as sweep_cmd

cli._register()
OLD_PASS = json.dumps({"kind": "summary", "setting": "ddcheck run", "passed": True}) + "\n"


class Killed(BaseException):
    """Stands for SIGKILL arriving during the work: nothing in ddcheck catches it."""


def _stale(tmp, names):
    paths = {n: tmp / f"old-{n}" for n in names}
    for n, p in paths.items():
        p.write_text(OLD_PASS if n != "html" else "<p>PASS</p>")
    return paths


def _kill_the_work(monkeypatch, paths, seen):
    """The work (a run's check, a sweep's or gate's settings) notes what each old output holds, then dies."""
    def killed(*_a, **_k):
        seen.update({n: p.read_text() if p.exists() else None for n, p in paths.items()})
        raise Killed
    monkeypatch.setattr(run_cmd, "check", killed)
    monkeypatch.setattr(sweep_cmd, "run_jobs", killed)


def _says_incomplete(name: str, text: str | None) -> bool:
    """What an output holds while its run is under way: incomplete, never a pass."""
    if text is None:
        return False
    if name == "out":
        first = json.loads(text.splitlines()[0])
        return first["kind"] == "started" and "passed" not in text
    if name == "json":
        doc = json.loads(text)
        return doc["passed"] is False and doc["incomplete"] is True
    if name == "junit":
        return 'failures="1"' in text and "incomplete" in text
    return "incomplete" in text and "PASS" not in text


COMMANDS = {
    "run": (("out", "html"), lambda p, case: ["run", "--backend", "torch", "--max-new-tokens", "2", "--budget", "4",
                                               "--out", str(p["out"]), "--html", str(p["html"])]),
    "sweep": (("out", "html"), lambda p, case: ["sweep", "--budget", "4", "--backend", "torch", "--max-new-tokens", "2",
                                                 "--jobs", "1", "--out", str(p["out"]), "--html", str(p["html"])]),
    "gate": (("out", "junit", "json", "html"), lambda p, case: [
        "gate", str(case), "--jobs", "1", "--device", "cpu", "--out", str(p["out"]), "--junit", str(p["junit"]),
        "--json", str(p["json"]), "--html", str(p["html"])]),
}


@pytest.mark.parametrize("command", COMMANDS)
def test_a_run_killed_during_the_work_leaves_incomplete_outputs_not_an_earlier_pass(command, tmp_path, monkeypatch):
    names, argv = COMMANDS[command]
    case = tmp_path / "c.toml"
    case.write_text("max_new_tokens = 2\n[[matrix]]\nbudget = [4]\n")
    paths = _stale(tmp_path, names)
    seen: dict = {}
    _kill_the_work(monkeypatch, paths, seen)
    with pytest.raises(Killed):
        CliRunner().invoke(cli.app, argv(paths, case), catch_exceptions=False)
    assert all(_says_incomplete(n, seen[n]) for n in names), seen   # replaced before the work started
    assert all(_says_incomplete(n, paths[n].read_text()) for n in names)   # and so left by the kill
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert left == [], left   # no temporary file, no lock file
    r = CliRunner().invoke(cli.app, ["report", str(paths["out"]), "-o", str(tmp_path / "r.html")])
    assert r.exit_code == 1 and "1 incomplete" in r.output, r.output   # the report calls it incomplete


def test_a_usage_error_leaves_earlier_outputs_alone(tmp_path):
    paths = _stale(tmp_path, ("out", "junit", "json", "html"))
    r = CliRunner().invoke(cli.app, ["gate", str(tmp_path / "missing.toml"), "--out", str(paths["out"]),
                                     "--junit", str(paths["junit"]), "--json", str(paths["json"]),
                                     "--html", str(paths["html"])])
    assert r.exit_code == 2, r.output
    assert all(p.read_text() in (OLD_PASS, "<p>PASS</p>") for p in paths.values())
