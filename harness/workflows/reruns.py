"""A `run` whose engine crashed before there was an engine to rerun in-process (a raise while the engine under
test was imported or built), or whose process a kernel killed: the same command again in new processes, each
with one stage replaced from the start (DDCHECK_REPLACE_STAGE: harness/check/from_start.py), narrowest first,
until one ends without a crash and matches the oracle. That stage is proven and the crash becomes a divergence
(harness/check/crash.py prove_from_start); the rungs tried and what each did join the summary either way.

Only the replacements whose code the crash passed through are tried (from_start.ladder): one that stands in for
none of the crash's frames cannot take the crash away. A rerun never reruns (the variable is already set).

Used by `run` (harness/cli/run_cmd.py, import_crash.py, the watchdog) and by a sweep's or gate's setting
(harness/workflows/sweep.py), whose rerun is the setting's own `ddcheck run` command line.

Layer: workflows. Imports report, the check and below; never cli."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPLACE_STAGE_ENV = "DDCHECK_REPLACE_STAGE"   # harness/engine/attn/exact.py's name (this module imports no torch)
_OUTPUTS = ("--out", "--html")


def in_rerun() -> bool:
    return bool(os.environ.get(REPLACE_STAGE_ENV))


def without_outputs(argv: list[str]) -> list[str]:
    """ARGV without its --out / --html (the crashed run's records are the ones written)."""
    kept, skip = [], False
    for a in argv:
        if skip or a in _OUTPUTS:
            skip = not skip and a in _OUTPUTS
            continue
        if not a.startswith(tuple(o + "=" for o in _OUTPUTS)):
            kept.append(a)
    return kept


def replaced_rerun(argv: list[str], key: str) -> dict | None:
    """`run ARGV` again in a new process with DDCHECK_REPLACE_STAGE=KEY: its summary, or None (another command,
    already a rerun, or it left no summary)."""
    if argv[:1] != ["run"] or in_rerun():
        return None
    with tempfile.TemporaryDirectory(prefix="ddcheck-replaced-") as d:
        out = Path(d) / "replaced.jsonl"
        subprocess.call([sys.executable, "-m", "harness", *without_outputs(argv), "--out", str(out)],
                        env={**os.environ, REPLACE_STAGE_ENV: key}, stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL)
        rows = [json.loads(x) for x in out.read_text().splitlines() if x.strip()] if out.is_file() else []
    return next((r for r in reversed(rows) if r.get("kind") == "summary"), None)


def prove_by_reruns(summary: dict, argv: list[str], keys: list[str], rerun=replaced_rerun) -> None:
    """SUMMARY (the crashed run's, as written) with the ladder KEYS climbed: each rerun's outcome as a rung, up to
    the first that proves its stage. rerun(argv, key) -> the rerun's summary (a test's stand-in for the process)."""
    from harness.check.crash import prove_from_start
    from harness.check.from_start import described
    if not keys or argv[:1] != ["run"] or in_rerun():
        return
    tried = []
    for key in keys:
        stage, replaced_by = described(key)
        tried.append(stage)
        if prove_from_start(summary, stage, replaced_by.partition(", from the start")[0], replaced_by,
                            rerun(argv, key), "the crashed run rerun in a new process"):
            return
    summary["explanation"] = (f"{summary.get('explanation')}; by replacement from the start: no replaced stage "
                              f"({', '.join(tried)}) made the run end and match")


def prove_written_summary(writer, e: BaseException, argv: list[str] | None = None) -> None:
    """The crash summary just written to WRITER (a RecordWriter), with the proof of reruns in new processes where
    the engine under test raised before there was an engine to rerun in-process."""
    at = max((i for i, ln in enumerate(writer.lines) if '"kind": "summary"' in ln), default=None)
    if at is None:
        return
    row = json.loads(writer.lines[at])
    prove_crash_summary(row, e, argv)
    writer.lines[at] = json.dumps(row)


def run_argv(command: str) -> list[str]:
    """A setting's `ddcheck run ...` command (RunSettings.command) as the argv of `python -m harness`."""
    import shlex
    words = shlex.split(command)
    return words[1:] if words[:2] == ["ddcheck", "run"] else []


def prove_crash_summary(summary: dict, e: BaseException, argv: list[str] | None = None) -> None:
    """The crash `e` of the engine under test, raised before any verify step with no engine to rerun: its summary
    (a dict, as written) with the reruns' proof."""
    from harness.check.from_start import engine_frames, ladder
    from harness.check.refusal import REFUSAL_PREFIX, refused_by
    if (summary.get("crash") or {}).get("side") != "engine":
        return
    refusal = refused_by(e)
    prove_by_reruns(summary, sys.argv[1:] if argv is None else argv,
                    ladder(engine_frames(e), REFUSAL_PREFIX + refusal if refusal else None))
