"""Where a sweep's settings run: a registry of executors (local process
pool, the default; Ray, optional), each behind one protocol (base.Executor).

Layer: workflows. Imports report, the check and below; never cli."""
from __future__ import annotations

from harness.workflows.executors.base import Executor, ExecutorSpec, make_executor, EXECUTOR_NAMES

__all__ = ["Executor", "ExecutorSpec", "make_executor", "EXECUTOR_NAMES"]
