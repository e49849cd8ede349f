"""A run stopped from outside (issue 22 point 3): SIGTERM, SIGINT or `run --timeout SECONDS` end the check where
it is, and the records written so far stay, with a summary of verdict `stopped` (or `diverge` when something
diverged before the stop) that names the reason.

The signal handlers raise RunStopped in the main thread. It is a BaseException, like KeyboardInterrupt, so the
check's own handling of crashes (`except Exception`, attributed to a side) never takes a stop for a crash. The
first stop switches the handlers off, so a second signal (Ctrl-C reaches the watchdog's child twice: from the
terminal and forwarded) cannot interrupt the writing of the records.

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

import signal
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

# exit status of a stopped run by its reason (as `timeout` and a shell report them); 1 where a divergence was seen
STOP_EXITS = {"timeout": 124, "SIGINT": 130, "SIGTERM": 143}
_SIGNALS = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT", signal.SIGALRM: "timeout"}


class RunStopped(BaseException):
    """Raised in the main thread by a stop signal or the run's timeout; `reason` is a key of STOP_EXITS."""

    def __init__(self, reason: str, timeout_s: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.timeout_s = timeout_s   # the run's --timeout, where one was set


@dataclass(frozen=True)
class StopWhy:
    reason: str            # timeout | SIGINT | SIGTERM
    timeout_s: float | None

    def sentence(self, steps: int) -> str:
        what = f"its --timeout of {self.timeout_s:g} s ran out" if self.reason == "timeout" else \
            f"it received {self.reason}"
        return f"run stopped after {steps} verify steps: {what}; the records up to there are kept, the streams " \
               "and the localizer were not run"


def _ignore_stops() -> None:
    signal.setitimer(signal.ITIMER_REAL, 0)
    for sig in _SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def _stop_raiser(timeout_s: float | None):
    def raise_stop(signum, frame) -> None:   # noqa: ARG001  (a signal handler's signature)
        _ignore_stops()
        raise RunStopped(_SIGNALS[signal.Signals(signum)], timeout_s)
    return raise_stop


@contextmanager
def stoppable(timeout_s: float | None) -> Iterator[None]:
    """Inside: SIGTERM, SIGINT and (with a timeout) SIGALRM after timeout_s raise RunStopped; the handlers
    before are restored after. Main thread only (Python delivers signals there)."""
    before = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    for sig in _SIGNALS:
        signal.signal(sig, _stop_raiser(timeout_s))
    if timeout_s:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in before.items():
            signal.signal(sig, handler)


def exit_code(reason: str, diverged: bool) -> int:
    return 1 if diverged else STOP_EXITS[reason]
