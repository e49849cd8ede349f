"""A port attached to a run: its adapter, the stages it drives, its audit log,
and why a setting is one the port cannot run.

Layer: ports. Imports the engine and below; never faults, check, report, workflows or cli."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from harness.ports.audit import Finding
from harness.ports.protocol import Conventions, PortError
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
    not_driven: dict[str, str] = field(default_factory=dict)   # stage -> the function its worker never calls
    worker: str | None = None     # what the port's worker side calls (WorkerCalls.sentence), None: no worker found
    served: set[str] = field(default_factory=set)   # the verify input classes SGLang's backend received

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
                "not_driven": dict(self.not_driven), "worker": self.worker,
                "served_verify_input": sorted(self.served),
                "lineage": lineage.describe() if (lineage := getattr(self.stages.adapter, "lineage", None)) else None,
                "conventions": {k: v for k, v in asdict(c).items()}}

    def audit(self, step: int, vb, trees, acceptances, predicts, reads_prefix: bool,
              produced: tuple[str, list[list[bool]]] | None = None, served=None) -> list[Finding]:
        """produced: (backend name, per request and row whether its logits came out finite);
        served: what a serving backend handed SGLang and the width it served (ServedVerify), or None."""
        conv = self.conventions if "compile" in self.stages.stages else None
        audit_step(self.log, step, vb, trees, acceptances, predicts, reads_prefix, conv, produced)
        if served is not None:
            self.served.add(("the port's own " if served.ports_own else "the backend's ") + served.verify_input)
            self.log.add(audit_served_width(step, served, vb.q_len))
        self.log.step = step + 1
        return self.log.drain()


def audit_served_width(step: int, served, q_len: int) -> list[Finding]:
    """The width SGLang's backend served (rows per request in the metadata its kernel read) against
    the port's tree: a verify input that leaves its width to the server (num_tokens_per_req unset)
    is served at the server's configured width, whatever the port built."""
    if served.width == q_len:
        return []
    how = "the graph replay's captured metadata" if served.graph else "init_forward_metadata"
    return [Finding("served-width", "error", step, -1,
                    f"SGLang's TritonAttnBackend served {served.width} rows per request ({how}, verify input "
                    f"{served.verify_input}); the port's tree is {q_len} rows wide")]


def attach_port(s: RunSettings, pipeline: Pipeline, vocab: int) -> tuple[Pipeline, PortRun | None]:
    if not s.impl:
        return pipeline, None
    spec = parse_impl(s.impl)
    adapter = load_adapter(spec)
    if hasattr(adapter, "model_dtype"):   # a port whose worker hands it the model's dtype gets the run's
        adapter.model_dtype = s.torch_dtype
    conv = adapter.conventions
    driven, not_driven = worker_stages(adapter, parse_stages(s.port_stages, conv.stages), bool(s.port_stages))
    stages = PortStages(adapter, driven, AuditLog())
    skip = skip_reason(conv, stages.stages, s, vocab) or _fault_overridden(s, pipeline, stages)
    if skip:
        raise SettingSkipped(f"{conv.family} cannot run {s.command()}: {skip}")
    worker = getattr(adapter, "worker", None)
    return port_pipeline(pipeline, stages), PortRun(spec.label, stages, conv, not_driven,
                                                    worker.sentence() if worker else None)


def check_port_stages(impl: str, port_stages: str | None) -> None:
    """Before any work: the stages a run would drive exist in the port and run on its deployed
    path (PortError otherwise). Call after the port's import was tried in a child process."""
    adapter = load_adapter(parse_impl(impl))
    requested = parse_stages(port_stages, adapter.conventions.stages)
    PortStages(adapter, requested, AuditLog())     # a stage the family does not provide
    worker_stages(adapter, requested, bool(port_stages))


def worker_stages(adapter, requested: tuple[str, ...], explicit: bool) -> tuple[tuple[str, ...], dict[str, str]]:
    """(the stages to drive, {stage: function} left out): never a function the port's worker
    does not call. Asked for by --port-stages, such a stage is a usage error; by default it is
    left to ddcheck and said in the summary. A port file with no worker beside it: as asked."""
    worker = getattr(adapter, "worker", None)
    if worker is None:
        return requested, {}
    unused = worker.unused(dict(adapter.conventions.stage_functions), requested)
    if unused and explicit:
        stage, fn = next(iter(unused.items()))
        raise PortError(f"--port-stages {','.join(requested)}: the port's worker never calls {fn}() (the {stage} "
                        f"stage); {worker.sentence()}. ddcheck drives only what the deployed path runs: leave "
                        f"{', '.join(unused)} out of --port-stages")
    driven = tuple(st for st in requested if st not in unused)
    if not driven:
        raise PortError(f"the port's worker calls none of {', '.join(unused.values())}; {worker.sentence()}: "
                        "no stage of this adapter runs on the deployed path")
    return driven, unused


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
