"""Ctrl-C on a sweep: pending settings are cancelled, the finished ones'
records are written and marked incomplete, exit 130, no worker outlives it."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil


BLOCKING_PORT = Path(__file__).resolve().parents[1] / "fixtures" / "ports" / "ddtree_utils" / "blocks_smallest_trees.py"


def _lines_until(proc, pattern: str, count: int, timeout_s: float) -> list[str]:
    """stderr lines of `proc` (a sweep's line per finished setting) until `count` of them start with
    `pattern` (or it exits, or time runs out)."""
    seen, deadline = [], time.monotonic() + timeout_s
    while sum(x.startswith(pattern) for x in seen) < count and time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stderr], [], [], 1.0)
        if ready:
            line = proc.stderr.readline()
            if not line:
                break
            seen.append(line)
    return seen


def test_sigint_stops_a_sweep_cleanly(tmp_path):
    """Ctrl-C at a known point, whatever the machine's speed: the port under
    test never finishes a tree of budget 4, and a sweep starts its cheapest
    settings last, so the signal comes when the other 6 have finished and
    those two run."""
    out = tmp_path / "s.jsonl"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-c", "from harness.cli import main; main()", "sweep", "--budget", "4,8,16,32",
           "--topk", "1,2", "--batch", "1", "--backend", "torch", "--max-new-tokens", "24", "--jobs", "2",
           "--impl", f"ddtree-utils:{BLOCKING_PORT}", "--out", str(out)]
    # a shell without job control starts background jobs with SIGINT ignored, and Python then never raises
    # KeyboardInterrupt: give the sweep the terminal's default, as a user pressing Ctrl-C has it
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        finished = _lines_until(proc, "pass ", 6, timeout_s=600)
        assert sum(x.startswith("pass ") for x in finished) == 6, "".join(finished)
        parent = psutil.Process(proc.pid)
        workers = parent.children(recursive=True)
        assert workers, "the sweep has no worker left running the two blocked settings"
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=120)
        err = "".join(finished) + rest
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted: 6 of 8 settings finished" in err, err
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert records[-1]["kind"] == "interrupted" and records[-1]["total"] == 8
    assert records[-1]["finished"] == sum(r["kind"] == "summary" for r in records) == 6
    deadline = time.monotonic() + 30   # the workers are stopped with the sweep; a loaded machine may take a while

    def alive():
        return [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]
    while alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive()


def test_workers_die_with_a_killed_sweep(tmp_path):
    """kill -9 on the sweep: its pool workers get SIGKILL too (no orphans)."""
    cmd = [sys.executable, "-c", "from harness.cli import main; main()", "sweep", "--budget", "4,8,16,32",
           "--topk", "1,2", "--batch", "1,2", "--backend", "torch", "--max-new-tokens", "24", "--jobs", "2",
           "--out", str(tmp_path / "s.jsonl")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    parent = psutil.Process(proc.pid)
    deadline = time.time() + 240
    while time.time() < deadline and len(parent.children(recursive=True)) < 2:
        time.sleep(0.5)
    time.sleep(3)
    workers = parent.children(recursive=True)
    assert workers
    proc.kill()
    proc.wait(timeout=30)

    def alive_workers():
        return [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]
    deadline = time.time() + 30   # SIGKILL is delivered at once; a loaded machine may take a while to reap
    while alive_workers() and time.time() < deadline:
        time.sleep(0.5)
    alive = alive_workers()
    for w in alive:
        w.kill()
    assert not alive, f"{len(alive)} workers outlived the sweep"


def _setting_workers(parent) -> list:
    """The gate's pool workers (multiprocessing's spawned processes), not its other children."""
    out = []
    for c in parent.children(recursive=True):
        try:
            if "spawn_main" in " ".join(c.cmdline()):
                out.append(c)
        except psutil.Error:   # a child that ended meanwhile
            pass
    return out


def test_a_killed_gate_leaves_no_stale_verdict(tmp_path):
    """The previous run's JSONL, JUnit, JSON ("passed": true) and HTML are
    replaced by the gate's "incomplete" placeholders once its work starts:
    kill -9 while a setting runs leaves no earlier verdict and no temporary file."""
    case = tmp_path / "c.toml"
    case.write_text('max_new_tokens = 24\n[[matrix]]\nbudget = [4, 8, 16, 32]\ntopk = [1, 2]\n')
    outs = {"--out": tmp_path / "g.jsonl", "--junit": tmp_path / "g.xml", "--json": tmp_path / "g.json",
            "--html": tmp_path / "g.html"}
    for p in outs.values():
        p.write_text('{"passed": true}\n')
    cmd = [sys.executable, "-c", "from harness.cli import main; main()", "gate", str(case), "--device", "cpu",
           "--jobs", "2", *[x for flag, p in outs.items() for x in (flag, str(p))]]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    parent = psutil.Process(proc.pid)
    deadline = time.time() + 240
    while time.time() < deadline and not _setting_workers(parent):   # a pool worker: the settings run
        time.sleep(0.2)             # (not any child: multiprocessing's resource tracker may start first)
    assert _setting_workers(parent), "the gate started no worker"
    workers = parent.children(recursive=True)
    proc.kill()
    proc.wait(timeout=30)
    time.sleep(1)
    for w in workers:
        if w.is_running():
            w.kill()
    # each output is the killed gate's own placeholder (incomplete), never the earlier "passed": true,
    # and beside them nothing but the outputs' lock files (no longer held: the lock died with the gate)
    left = sorted(p.name for p in tmp_path.iterdir() if p.name != "c.toml")
    assert [n for n in left if not n.endswith(".lock")] == sorted(p.name for p in outs.values()), left
    for p in outs.values():
        text = p.read_text()
        assert '"passed": true' not in text, p.name
    assert json.loads(outs["--out"].read_text().splitlines()[0])["kind"] == "started"   # a report: incomplete
    assert all("incomplete" in outs[flag].read_text() for flag in ("--junit", "--json", "--html"))


def test_an_interrupted_sweep_exits_even_when_a_pool_thread_never_ends():
    """The exit after Ctrl-C gives the pool's threads a grace, then leaves
    without joining them: a thread that never ends (as the pool's manager
    did once, left with terminated workers) cannot hold the exit."""
    code = ("import threading, time\n"
            "from harness.cli.sweep_cmd import leave_after_interrupt\n"
            "threading.Thread(target=lambda: time.sleep(3600)).start()   # not a daemon: exit would join it\n"
            "leave_after_interrupt(130, grace_s=0.5)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 130, proc.stderr
