"""A gate's records stream as its settings finish, and its outputs are held:
killed after N finished settings it leaves those N settings' records in a
file a report calls incomplete (never a pass), and a second gate on the same
paths meanwhile refuses, naming the first one's pid. The gate is frozen
(SIGSTOP) at a known point, after its first finished setting, not after a
fixed time."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from typer.testing import CliRunner

from harness.cli import _register, app

_register()
ROOT = Path(__file__).resolve().parents[2]
CASE = 'max_new_tokens = 3\n[[matrix]]\nbudget = [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]\nbackend = "torch"\n'


def _records(path: Path) -> list[dict]:
    text = path.read_text() if path.exists() else ""
    whole = text[:text.rfind("\n") + 1]   # a line still being written is not yet a record
    return [json.loads(ln) for ln in whole.splitlines() if ln.strip()]


def _summaries(path: Path) -> int:
    return sum(r["kind"] == "summary" for r in _records(path))


def test_a_gate_killed_after_n_settings_leaves_n_records_and_held_its_outputs(tmp_path):
    case = tmp_path / "c.toml"
    case.write_text(CASE)
    out, junit = tmp_path / "g.jsonl", tmp_path / "g.xml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    gate = subprocess.Popen([sys.executable, "-m", "harness", "gate", str(case), "--jobs", "1", "--device", "cpu",
                             "--out", str(out), "--junit", str(junit)], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600   # a bound on a hung gate, not a timing assertion
        while _summaries(out) < 1:
            assert gate.poll() is None, f"the gate ended (exit {gate.returncode}) before a setting finished"
            assert time.monotonic() < deadline, "no setting finished"
            time.sleep(0.05)
        gate.send_signal(signal.SIGSTOP)   # frozen mid-gate: what it wrote so far is on disk
        n = _summaries(out)
        records = _records(out)
        assert records[0]["kind"] == "started" and records[0]["total"] == 12 and records[0]["pid"] == gate.pid
        assert 1 <= n < 12, n
        assert "incomplete" in junit.read_text() and 'failures="1"' in junit.read_text()   # no green JUnit yet

        second = CliRunner().invoke(app, ["gate", str(case), "--jobs", "1", "--device", "cpu", "--out", str(out),
                                          "--junit", str(tmp_path / "other.xml")])
        assert second.exit_code == 2, second.output
        assert second.output.strip() == (f"ddcheck: error: --out {out}: in use by pid {gate.pid} (another ddcheck "
                                         "is writing it); wait for it or choose another path")
        assert _summaries(out) == n and not (tmp_path / "other.xml").exists()   # the second one wrote nothing

        gate.send_signal(signal.SIGKILL)
        gate.wait(timeout=60)
    finally:
        if gate.poll() is None:
            gate.kill()
            gate.wait()
    assert _summaries(out) == n   # the N finished settings' records survive the kill
    r = CliRunner().invoke(app, ["report", str(out), "-o", str(tmp_path / "g.html")])
    assert r.exit_code == 1 and f"{n + 1} runs, 0 failing, 1 incomplete" in r.output, r.output

    from harness.check.outputs import OutputClaim   # the dead gate's lock went with it
    with OutputClaim("gate", 1, out=out) as claim:
        claim.take()
