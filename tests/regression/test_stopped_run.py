"""A run stopped by a signal (issue 22 point 3) leaves its records so far and a summary that says so.

SIGTERM goes to the watchdog (the process a user or a scheduler sees), which forwards it to the child that
checks; the child writes the node records of the steps it checked and a summary of verdict `stopped`, exit 143.
The stop comes at a known point, whatever the machine's speed: the port under test blocks in its fourth tree
build and touches a marker file first."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

BLOCKING_PORT = Path(__file__).resolve().parents[1] / "fixtures" / "ports" / "ddtree_utils" / \
    "blocks_after_three_trees.py"


def _wait_for(marker: Path, proc: subprocess.Popen, bound_s: float) -> None:
    deadline = time.monotonic() + bound_s   # a bound on a hang, not a timing assertion
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)


def test_sigterm_keeps_the_records_and_says_stopped(tmp_path):
    out, marker = tmp_path / "run.jsonl", tmp_path / "blocked"
    env = {**os.environ, "DDCHECK_TEST_BLOCKED": str(marker), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-c", "from harness.cli import main; main()", "run", "--backend", "torch",
           "--max-new-tokens", "24", "--impl", f"ddtree-utils:{BLOCKING_PORT}", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _wait_for(marker, proc, 300)
        assert marker.exists(), proc.communicate(timeout=60)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, "the watchdog has no child checking the run"
        proc.send_signal(signal.SIGTERM)   # to the watchdog: it forwards it
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, stdout + stderr
    assert "STOPPED" in stdout and "SIGTERM" in stderr, stdout + stderr
    records = [json.loads(x) for x in out.read_text().splitlines()]
    summary = records[-1]
    assert summary["kind"] == "summary" and summary["verdict"] == "stopped" and summary["stopped"] == "SIGTERM"
    assert summary["passed"] is False and summary["steps"] == 3
    assert summary["engine_s_per_step"] is not None
    nodes = [r for r in records if r["kind"] == "node" and not r["is_padding"]]
    assert sorted({r["step"] for r in nodes}) == [0, 1, 2] and all(r["verdict"] == "match" for r in nodes)
    assert summary["nodes_checked"] == len(nodes)
    assert not [r for r in records if r["kind"] == "stream"]   # the streams were not compared
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
