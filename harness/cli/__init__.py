"""`ddcheck` command line. Every command exits 0 (all match), 1 (divergence),
2 (usage or environment error, one line on stderr, nothing written), 3
(ddcheck's own error, or the oracle's) or 130 (interrupted); docs/RECORDS.md,
"Exit codes".

Layer: cli. Imports any layer below it."""
from __future__ import annotations

import sys

from harness.cli.app import app  # noqa: F401  (the application the commands register on)


def _register() -> None:
    from harness.cli import run_cmd  # noqa: F401
    for optional in ("faults_cmd", "sweep_cmd", "gate_cmd", "report_cmd", "ports_cmd", "calibrate_cmd", "reduce_cmd",
                     "models_cmd"):
        try:
            __import__(f"harness.cli.{optional}")
        except ModuleNotFoundError as e:
            if e.name != f"harness.cli.{optional}":
                raise


def main() -> None:
    from harness.cli import watchdog
    # a kernel that kills its process still ends in a verdict (watchdog.py). Only a single run is watched:
    # sweep and gate own their process (its pid, its signals) and judge each setting in a worker of its own
    watched = sys.argv[1:2] == ["run"]
    if watched and not watchdog.in_child():
        sys.exit(watchdog.run_in_child(sys.argv[1:]))
    dump = watchdog.enable_fault_dump() if watchdog.in_child() else None  # noqa: F841  (open for the process's life)
    try:   # the commands and all they import (the engine under test among them): a raise here is attributed
        import os
        from harness.check.refusal import skip_from_env
        skip_from_env()   # a rerun proving a validator's refusal false: skipped before the engine is imported
        import torch
        from harness.cli.common import USAGE_ERRORS, exit_usage, threads_from_env
        _register()
    except Exception as e:  # noqa: BLE001  (harness/cli/import_crash.py: a verdict, never a bare traceback)
        from harness.cli.import_crash import crashed_while_importing
        crashed_while_importing(e)
    # The presets are tiny: extra intra-op threads only fight over the cores
    # (measured: --batch 4 ran 2x faster on 1 thread than on 2). Sweeps use processes.
    try:
        torch.set_num_threads(threads_from_env(os.environ))
    except USAGE_ERRORS as e:
        exit_usage(e)
    try:
        app(standalone_mode=True)
    except USAGE_ERRORS as e:  # raised outside a command's own handling
        exit_usage(e)


if __name__ == "__main__":
    sys.exit(main())
