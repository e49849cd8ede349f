"""Records grouped per setting, as the report reads them. Nothing here
recomputes a metric: every number shown comes from a record (docs/RECORDS.md).
No torch import anywhere under harness/report.

Layer: report. Imports the check and below; never workflows or cli."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from harness.verdict.tolerance import REL_TOL


class ReportInputError(ValueError):
    """An unreadable records file: a usage error."""


@dataclass
class SettingView:
    key: str                       # anchor id
    setting: str                   # the reproduce command
    source: str                    # the JSONL it came from
    summary: dict | None = None
    nodes: list[dict] = field(default_factory=list)
    streams: list[dict] = field(default_factory=list)
    accepts: list[dict] = field(default_factory=list)
    audits: list[dict] = field(default_factory=list)   # a port's structural findings (`--impl` runs)
    localize: dict | None = None

    @property
    def settings(self) -> dict:
        return (self.summary or {}).get("settings") or {}

    @property
    def status(self) -> str:
        """pass | near-tie | skip | caught | diverge | below-baseline | missed | incomplete (see `status_of`)"""
        return "incomplete" if self.summary is None else status_of(self.summary)

    @property
    def tolerance(self) -> float | None:
        """The record's tolerance when it carries one, else the dtype's documented one."""
        bisect = (self.localize or {}).get("layer_bisect") or {}
        if bisect.get("tolerance") is not None:
            return float(bisect["tolerance"])
        if (self.summary or {}).get("tolerance") is not None:
            return float(self.summary["tolerance"])
        return REL_TOL.get(self.settings.get("dtype", ""))


BAD_STATUSES = ("diverge", "missed", "below-baseline")


def status_of(summary: dict) -> str:
    """A summary record's status. skip: not run here (`skipped`). A run without
    `expect_fault`: pass, near-tie (passed, some argmax flipped within
    tolerance), below-baseline (passed, but its mean accepted length fell
    below the gate's baseline: `acceptance_shortfall`) or diverge. A run
    the gate expected to fail (`expect_fault` set): caught when it diverged
    and the localizer named the fault's catalog class, else missed (bad)."""
    if summary.get("skipped"):   # not run here (a port or this machine cannot): nothing was compared
        return "skip"
    name = summary.get("expect_fault")
    if name:
        return "caught" if expected_fault_caught(summary) else "missed"
    if not summary.get("passed"):
        return "diverge"
    if summary.get("acceptance_shortfall"):   # the gate's acceptance baseline, written into the record
        return "below-baseline"
    return "near-tie" if summary.get("near_ties") or summary.get("router_ties") else "pass"


def expected_fault_caught(summary: dict) -> bool:
    """Diverged, and named with the class the record says the fault has
    (`expect_class`, written by the gate from the catalog)."""
    if not summary.get("expect_fault") or summary.get("passed"):
        return False
    return summary.get("fault_class") is not None and summary.get("fault_class") == summary.get("expect_class")


_NUM = (int, float, str, type(None))   # a number, "inf" / "-inf" as records write them, or null
_INT = (int, type(None))
# the types a record may hold in the fields the report reads (docs/RECORDS.md); any kind, then per kind
FIELD_TYPES = {
    "*": {"kind": (str,), "setting": (str, type(None)), "run": (str, type(None))},
    "summary": {"passed": (bool, type(None)), "first": (dict, type(None)), "settings": (dict, type(None)),
                "notes": (list, type(None)), "nodes_checked": _INT, "divergent_nodes": _INT, "near_ties": _INT, "router_ties": _INT,
                "padding_rows": _INT, "nonfinite_padding_rows": _INT, "max_rel_err": _NUM, "tolerance": _NUM, "fault_class": (str, type(None)),
                "explanation": (str, type(None)), "expect_fault": (str, type(None)), "error": (str, type(None)),
                "acceptance_by_depth": (list, type(None)), "mean_accepted_length": _NUM,
                "skipped": (str, type(None)), "acceptance_shortfall": (str, type(None)),
                "replacements": (list, type(None))},
    "node": {"step": (int,), "request": (int,), "node": (int,), "depth": _INT, "rel_err": _NUM,
             "is_padding": (bool,), "verdict": (str,)},
    "stream": {"request": (int,), "engine_tokens": (list,), "reference_tokens": (list,),
               "first_mismatch": _INT, "verdict": (str,)},
    "interrupted": {"finished": (int,), "total": (int,)},
    "started": {"total": (int,), "command": (str,)},
    "localize": {"mask_probe": (dict, type(None)), "layer_bisect": (dict, type(None)),
                 "kv_audit": (dict, type(None)), "first_wrong": (dict, type(None)),
                 "metadata_audit": (list, tuple, type(None))},
}
FIRST_TYPES = {"step": (int,), "request": (int,), "node": (int,), "depth": _INT, "rel_err": _NUM,
               "what": (str, type(None))}


def _typed(path: Path, n: int, rec: dict) -> None:
    """A record whose fields the report reads hold the types the writer gives them."""
    for where, fields, obj in (("", {**FIELD_TYPES["*"], **FIELD_TYPES.get(rec["kind"], {})}, rec),
                               ("first.", FIRST_TYPES, rec.get("first") or {})):
        for key, kinds in fields.items():
            v = obj.get(key)
            if key in obj and (not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds)):
                raise ReportInputError(f"{path}: line {n}: field '{where}{key}' holds a {type(v).__name__}, not a "
                                       f"ddcheck record's {' or '.join(k.__name__ for k in kinds)}")


def read_jsonl(path: Path) -> list[dict]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ReportInputError(f"{path}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ReportInputError(f"{path}: not UTF-8 text (byte {e.start}): not a JSONL of records") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ReportInputError(f"{path}: line {n}: not JSON ({e.msg})") from None
        except RecursionError:
            raise ReportInputError(f"{path}: line {n}: JSON nested too deep for a ddcheck record") from None
        if not isinstance(rec, dict) or "kind" not in rec:
            raise ReportInputError(f"{path}: line {n}: not a ddcheck record (no 'kind')")
        if not isinstance(rec["kind"], str):
            raise ReportInputError(f"{path}: line {n}: not a ddcheck record ('kind' is not a string)")
        _typed(path, n, rec)
        out.append(rec)
    return out


def group(paths: list[Path]) -> list[SettingView]:
    """Runs in the order they first appear, one view per (file, run id); records
    written before run ids existed group by (file, setting). A file with no
    record at all is one incomplete view: missing evidence never renders as a pass."""
    views: dict[tuple[str, str], SettingView] = {}
    for path in paths:
        last, records = "", read_jsonl(path)
        if not records:
            views[(str(path), "")] = SettingView(f"s{len(views)}", "(no records)", str(path))
        for rec in records:
            if rec["kind"] == "started":   # only a file whose run has not finished holds one (RECORDS.md)
                views[(str(path), "started")] = SettingView(
                    f"s{len(views)}", f"(incomplete: `ddcheck {rec.get('command')}` that writes this file has not "
                    f"finished: still running, or killed; {rec.get('total')} settings planned)", str(path))
                continue
            if rec["kind"] == "interrupted":   # settings that never ran: the file is incomplete
                views[(str(path), "interrupted")] = SettingView(
                    f"s{len(views)}", f"(interrupted: {rec.get('total', 0) - rec.get('finished', 0)} settings did not run)",
                    str(path))
                continue
            # a record without `setting` belongs to the run whose records precede it
            setting = str(rec.get("setting") or last)
            last = setting
            k = (str(path), str(rec.get("run") or setting))
            if k not in views:
                views[k] = SettingView(f"s{len(views)}", setting, k[0])
            v = views[k]
            kind = rec["kind"]
            if kind == "node":
                v.nodes.append(rec)
            elif kind == "stream":
                v.streams.append(rec)
            elif kind == "accept":
                v.accepts.append(rec)
            elif kind == "audit":
                v.audits.append(rec)
            elif kind == "localize" and v.localize is None:
                v.localize = rec
            elif kind == "summary":
                v.summary = rec
    return list(views.values())


def describe_first(summary: dict) -> str:
    """One line for a summary record's first divergence."""
    f = summary.get("first")
    crash = summary.get("crash") or {}
    if summary.get("error") and (not f or f.get("what") == "crash"):
        where = f" at {crash['where']}" if crash.get("where") else ""
        return f"crash ({crash.get('side', 'engine')}): {summary['error']}{where}"
    if f and f.get("what") == "proven-crash":   # the crash is the divergence's evidence, said in its detail
        return f"step {f['step']}: {f['detail']}" if f.get("step", -1) >= 0 else f["detail"]
    if f and crash:   # the divergence came first; the crash after it is said too
        return f"{describe_first({k: v for k, v in summary.items() if k not in ('crash', 'error')})}; then " \
               f"crash ({crash.get('side')}): {crash.get('error')}"
    if not f and summary.get("first_finding"):
        return f"audit: {summary['first_finding']}"
    if not f:
        return "none" if summary.get("passed", True) else "see records"
    if f.get("what") == "stream":
        return f"request {f['request']}: emitted stream differs at token {f['node']}"
    if f.get("what") in ("config", "weights"):
        return f"the checkpoint's {f['what']}: the engine's loader and the oracle's own reading disagree"
    if f.get("what") in ("tree", "accept-ref") and f.get("detail"):
        return f"{f['what']}: {f['detail']}"
    err = f.get("rel_err")
    err_s = f", rel. error {err:.2e}" if isinstance(err, (int, float)) else ""
    pad = "present" if f.get("padding_present") else "absent"
    return (f"step {f['step']}, request {f['request']}, node {f['node']} (depth {f.get('depth')})"
            f"{err_s}, padding rows {pad}")
