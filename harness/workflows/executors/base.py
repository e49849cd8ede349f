"""The executor protocol: settings go in, each one's result comes back as it
finishes (streamed to `done`), and the sweep puts them in setting order.
A spec names the executor and its arguments; the registry builds it.

Layer: workflows. Imports report, the check and below; never cli."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from harness.engine.settings import UsageError

# jobs are harness.workflows.sweep.SettingJob, results SettingResult (not imported: the sweep imports this)
Done = Callable[[Any], None]                     # a result, as it comes back
Task = Callable[[Any], Any]                      # job -> result: one setting, run where the executor puts it
Died = Callable[[Any, tuple[str, ...]], Any]     # (job, reasons) -> the result of a setting whose worker kept dying
# (index, setting, summary, record lines, wall s) -> the result of a setting whose process died once, judged
# from its fault dump (workflows/worker_deaths.py)
Crashed = Callable[[int, str, dict, tuple[str, ...], float], Any]


class Executor(Protocol):
    """Runs `task` on each setting somewhere; calls `done` once per setting
    as it finishes (any order); raises KeyboardInterrupt after stopping what
    still runs. The sweep hands in the task and what a lost setting becomes,
    so that executors know nothing of the check."""

    name: str

    def run(self, jobs: list, done: Done, task: Task, died: Died, crashed: Crashed | None = None) -> None: ...


# name -> "module:class", imported only when chosen (ray is an optional extra)
_REGISTRY = {"local": "harness.workflows.executors.local:LocalExecutor",
             "ray": "harness.workflows.executors.ray_executor:RayExecutor"}
EXECUTOR_NAMES = tuple(_REGISTRY)


@dataclass(frozen=True)
class ExecutorSpec:
    """Which executor and its arguments: `workers` settings at once (the
    pool's processes, or a local Ray cluster's CPUs), `address` an existing
    Ray cluster (ray only; None starts a local one)."""
    name: str = "local"
    workers: int = 1
    address: str | None = None

    def __post_init__(self) -> None:
        if self.name not in _REGISTRY:
            raise UsageError(f"--executor must be one of {', '.join(EXECUTOR_NAMES)}, got {self.name!r}")
        if self.workers < 1:
            raise UsageError(f"--workers must be at least 1, got {self.workers}")
        if self.address is not None and self.name != "ray":
            raise UsageError("--ray-address needs --executor ray")


def make_executor(spec: ExecutorSpec) -> Executor:
    """The executor a spec names (a usage error when its package is missing)."""
    import importlib
    module, _, cls = _REGISTRY[spec.name].partition(":")
    return getattr(importlib.import_module(module), cls).from_spec(spec)
