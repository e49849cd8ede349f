"""Record types (docs/RECORDS.md) and an all-or-nothing JSONL writer.

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

import functools
import json
import re
import subprocess
import os
import tempfile
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from ddschema import SCHEMA_VERSION


@dataclass(frozen=True)
class NodeRecord:
    step: int
    request: int
    node: int              # verify row; 0 = root
    depth: int | None      # None for padding rows
    parent: int | None     # None for the root and padding rows
    token: int | None
    is_padding: bool
    accepted: bool
    rel_err: float | None  # None for padding rows (not judged by logits)
    top1_agree: bool | None
    kl: float | None
    ref_gap: float | None
    finite: bool
    verdict: str
    setting: str = ""
    kind: str = "node"
    twin_err: float | None = None     # the node's correct low-precision twin against the oracle (noise-floor verdict)
    noise_ratio: float | None = None  # rel_err / max(twin_err, rounded_err, floor); twin_err null (not computed: it
    #                                   could change no verdict of the node) over rounded_err alone, an upper bound
    rounded_err: float | None = None  # the oracle's own low-precision computation of the node against the oracle
    twin_dist: float | None = None    # max |logits - twin logits| / max |oracle|: the engine against its twin directly
    rel_l2: float | None = None       # ||logits - oracle||_2 / ||oracle||_2 (noise-floor runs): the whole vector's error
    twin_l2: float | None = None      # the same of the twin
    rounded_l2: float | None = None   # the same of the oracle's own low-precision computation


@dataclass(frozen=True)
class StreamRecord:
    request: int
    prompt: str
    engine_tokens: tuple[int, ...]
    reference_tokens: tuple[int, ...]
    first_mismatch: int | None
    verdict: str          # match | diverge | near-tie
    setting: str = ""
    kind: str = "stream"
    prompt_text: str | None = None       # the three decoded by the checkpoint's tokenizer.json (None: it has none)
    engine_text: str | None = None
    reference_text: str | None = None


def _default(o):
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    raise TypeError(type(o))


def _clean(v):
    if isinstance(v, float) and v != v:
        return None
    if isinstance(v, float) and v in (float("inf"), float("-inf")):
        return "inf" if v > 0 else "-inf"
    if isinstance(v, dict):  # nested records (a summary's `first`, a localize record's probes)
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


class RecordWriter:
    """Collects lines in a temporary file beside `path`; `commit` renames it in
    place, so a run that fails half-way leaves no half-written JSONL."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.lines: list[str] = []
        self.run_id: str | None = None

    def begin_run(self) -> str:
        """Every record written from now on carries this run's id, so that a
        report groups the records of one run even when two runs share a
        reproduce command."""
        self.run_id = uuid.uuid4().hex[:12]
        return self.run_id

    def write(self, record) -> None:
        d = asdict(record) if hasattr(record, "__dataclass_fields__") else dict(record)
        d = {k: _clean(v) for k, v in d.items()}
        d.setdefault("schema", SCHEMA_VERSION)
        if self.run_id is not None:
            d.setdefault("run", self.run_id)
        self.lines.append(json.dumps(d, default=_default, allow_nan=False))

    def commit(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write("\n".join(self.lines) + ("\n" if self.lines else ""))
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; records are ordinary files
            os.replace(tmp, self.path)
        finally:
            Path(tmp).unlink(missing_ok=True)   # no temporary file survives a failed write


@functools.lru_cache(maxsize=1)
def provenance() -> dict:
    """What produced the records: ddcheck's version and the project's git commit when known."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        ver = version("ddcheck")
    except PackageNotFoundError:
        ver = "unknown"
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5)
        commit = out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"ddcheck_version": ver, "commit": commit}


_RUN_TO_RUN_KEYS = re.compile(r"(_s|_s_per_step|_time_ratio|^time|^run)$")   # record keys that differ run to run
_FREE_MEMORY = re.compile(r"[\d.]+ GiB of room")                 # the oracle's placement reason states free memory


def same_run_to_run(record: dict) -> dict:
    """The record without what differs between two runs of one setting (run ids, times, the free memory the
    oracle's placement saw): what two executors, or two runs, must agree on."""
    out = {k: v for k, v in record.items() if not _RUN_TO_RUN_KEYS.search(k)}
    if isinstance(out.get("oracle_reason"), str):
        out["oracle_reason"] = _FREE_MEMORY.sub("? GiB of room", out["oracle_reason"])
    return out
