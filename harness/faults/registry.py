"""The fault catalog by name: look a fault up, say why it cannot show under
a run's settings, apply it to a pipeline. Imports the catalog and the
engine; nothing above them.

Layer: faults. Imports the engine and below; never ports, check, report, workflows or cli."""
from __future__ import annotations

from harness.engine.attn.registry import serves_batches
from harness.engine.pipeline import Pipeline
from harness.engine.settings import RunSettings, UsageError
from harness.faults.catalog import FAULTS
from harness.faults.fault import Fault


def catalog() -> dict[str, Fault]:
    return FAULTS


def why_cannot_show(name: str, s: RunSettings, vocab: int) -> str | None:
    fault = FAULTS.get(name)
    if fault is None:
        return f"unknown fault {name!r}; `ddcheck faults` lists them"
    if not fault.can_show(s, vocab):
        own_graph = ""
        if _flips_graph(fault) and serves_batches(s.backend):
            own_graph = (f"; it flips ddcheck's own graph runner, and --backend {s.backend} replays SGLang's own "
                         "graph state")
        return f"fault {name!r} cannot show under these settings: it needs {fault.shows_when}{own_graph}"
    return None


def _flips_graph(fault: Fault) -> bool:
    """The fault switches one of ddcheck's graph runner options (harness/engine/graph.py, GraphOptions)."""
    return fault.apply(Pipeline()).graph != Pipeline().graph


def apply_fault(name: str | None, s: RunSettings, vocab: int, pipeline: Pipeline = Pipeline()) -> Pipeline:
    if name is None:
        return pipeline
    reason = why_cannot_show(name, s, vocab)
    if reason:
        raise UsageError(reason)
    return FAULTS[name].apply(pipeline)
