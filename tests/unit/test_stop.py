"""harness/check/stop.py and the watchdog's forwarding: a stop is a RunStopped with its reason, the exit
status follows the reason (1 once something diverged), the verdict says `stopped`, never `pass`."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from harness.check.stop import RunStopped, exit_code, stoppable
from harness.check.summary import CheckSummary
from harness.cli.watchdog import forwarding


def _wait_for_stop() -> None:
    deadline = time.monotonic() + 60   # a bound on a hang, not a timing assertion
    while time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.parametrize("sig,reason", [(signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "SIGINT")])
def test_a_signal_raises_run_stopped(sig, reason):
    before = signal.getsignal(sig)
    with pytest.raises(RunStopped) as e, stoppable(None):
        os.kill(os.getpid(), sig)
        _wait_for_stop()
    assert e.value.reason == reason and e.value.timeout_s is None
    assert signal.getsignal(sig) is before   # the handlers before are back


def test_the_timeout_raises_run_stopped():
    with pytest.raises(RunStopped) as e, stoppable(0.05):
        _wait_for_stop()
    assert e.value.reason == "timeout" and e.value.timeout_s == 0.05


def test_a_second_signal_is_ignored_while_stopping():
    with pytest.raises(RunStopped), stoppable(None):
        os.kill(os.getpid(), signal.SIGTERM)
        _wait_for_stop()
    # inside the block, once stopped, the records are written undisturbed: checked by a stop inside a stop
    with stoppable(None):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            _wait_for_stop()
        except RunStopped:
            os.kill(os.getpid(), signal.SIGINT)   # ignored now
            time.sleep(0.2)


def test_exit_codes_and_verdict():
    assert [exit_code(r, False) for r in ("timeout", "SIGINT", "SIGTERM")] == [124, 130, 143]
    assert exit_code("timeout", True) == 1
    s = CheckSummary(setting="x", stopped="timeout")
    assert s.verdict == "stopped" and not s.passed
    s.divergent_nodes, s.nodes_checked = 1, 1
    assert s.verdict == "diverge"


def test_the_watchdog_forwards_sigterm_to_its_child():
    child = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                              "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
                              "print('ready', flush=True)\n"
                              "time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        forwarded: list[int] = []
        with forwarding(child, forwarded):
            os.kill(os.getpid(), signal.SIGTERM)   # this process survives: the handler passes it on
            rc = child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    assert rc == 7 and forwarded == [signal.SIGTERM]


@pytest.mark.parametrize("value", ["0", "-3", "1e9"])
def test_a_bad_timeout_is_a_usage_error(value, tmp_path):
    from typer.testing import CliRunner

    import harness.cli as cli
    cli._register()
    out = tmp_path / "r.jsonl"
    r = CliRunner().invoke(cli.app, ["run", "--backend", "torch", "--timeout", value, "--out", str(out)])
    assert r.exit_code == 2 and "--timeout must be in" in r.output and not out.exists()
