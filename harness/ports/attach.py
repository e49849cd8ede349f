"""A port attached to a run: its adapter, the stages it drives, its audit log,
and why a setting is one the port cannot run.

Layer: ports. Imports the engine and below; never faults, check, report, workflows or cli."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from harness.ports.audit import Finding
from harness.ports.protocol import Conventions
from harness.ports.registry import load_adapter, parse_impl
from harness.ports.stages import STAGE_FIELDS, AuditLog, PortStages, audit_step, parse_stages, port_pipeline
from harness.engine.pipeline import Pipeline
from harness.engine.settings import RunSettings
from harness.engine.ddtree.tree import expected_num_nodes


class SettingSkipped(Exception):
    """The port cannot run this setting (no padding path, batch limit): skipped with the reason, not failed."""


@dataclass
class PortRun:
    label: str                    # FAMILY:PATH as given
    stages: PortStages
    conventions: Conventions

    @property
    def log(self) -> AuditLog:
        return self.stages.log

    def describe(self) -> dict:
        """The summary's `port` entry: which stages were the port's, under which conventions."""
        c = self.conventions
        stubbed = getattr(self.stages.adapter, "stubbed", ())
        return {"impl": self.label, "family": c.family, "port_stages": list(self.stages.stages),
                "ddcheck_stages": [s for s in ("build", "compile", "accept", "commit") if s not in self.stages.stages],
                "budget_counts_root": c.budget_counts_root, "stubbed_imports": list(stubbed),
                "conventions": {k: v for k, v in asdict(c).items()}}

    def audit(self, step: int, vb, trees, acceptances, predicts, reads_prefix: bool,
              produced: tuple[str, list[list[bool]]] | None = None) -> list[Finding]:
        """produced: (backend name, per request and row whether its logits came out finite)."""
        conv = self.conventions if "compile" in self.stages.stages else None
        audit_step(self.log, step, vb, trees, acceptances, predicts, reads_prefix, conv, produced)
        self.log.step = step + 1
        return self.log.drain()


def attach_port(s: RunSettings, pipeline: Pipeline, vocab: int) -> tuple[Pipeline, PortRun | None]:
    if not s.impl:
        return pipeline, None
    spec = parse_impl(s.impl)
    adapter = load_adapter(spec)
    conv = adapter.conventions
    stages = PortStages(adapter, parse_stages(s.port_stages, conv.stages), AuditLog())
    skip = skip_reason(conv, stages.stages, s, vocab) or _fault_overridden(s, pipeline, stages)
    if skip:
        raise SettingSkipped(f"{conv.family} cannot run {s.command()}: {skip}")
    return port_pipeline(pipeline, stages), PortRun(spec.label, stages, conv)


def _fault_overridden(s: RunSettings, pipeline: Pipeline, stages: PortStages) -> str | None:
    """A fault swaps one of ddcheck's stages; if the port replaces that stage, the fault cannot show."""
    if not s.fault:
        return None
    faulted = {f for f in Pipeline.__dataclass_fields__ if getattr(pipeline, f) is not getattr(Pipeline(), f)}
    owned = {f for st in stages.stages for f in STAGE_FIELDS[st]}
    lost = sorted(faulted & owned)
    if lost:
        return f"fault {s.fault} changes ddcheck's {', '.join(lost)}, which the port's own stages replace"
    return None


def skip_reason(conv: Conventions, stages: tuple[str, ...], s: RunSettings, vocab: int) -> str | None:
    if s.page_size > 1 and "commit" in stages:
        return (f"page size {s.page_size}: the port's own commit re-points req_to_token one slot at a time "
                "(run its other stages with --port-stages, ddcheck's paged commit then compacts)")
    if conv.max_batch is not None and s.batch > conv.max_batch:
        return f"batch {s.batch} > the port's limit {conv.max_batch}"
    if not conv.has_padding:
        drafts = conv.num_drafts(s.budget) if "build" in stages else s.budget
        if expected_num_nodes(drafts, s.topk, s.block_size - 1, vocab) < drafts:
            return (f"its trees have no padding rows, and budget {s.budget} with topk {s.topk} and depth "
                    f"{s.block_size - 1} leaves some (at most {expected_num_nodes(drafts, s.topk, s.block_size - 1, vocab)} "
                    f"of {drafts} draft nodes)")
    return None
