"""What one differential run found: the first divergence and the summary
record every report, gate and sweep reads (records render, never recompute).

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

from harness.check.records import provenance
from harness.engine.settings import RunSettings


@dataclass(frozen=True)
class FirstDivergence:
    step: int
    request: int
    node: int
    depth: int | None
    padding_present: bool
    rel_err: float | None
    what: str = "node"   # node | padding (non-finite padding row) | batch-padding (graph dummy row) | stream | accept
    #                     | config | weights (the engine's loader disagrees with the oracle's reading)
    #                     | tree | accept-ref (the engine's tree / walk against the oracle's own)
    #                     | provenance (a KV slot read or written against the canary's record of it)
    #                     | rank-* / kv-heads-sharded (--tp: a rank disagrees with rank 0; the class itself)
    #                     | crash (the engine under test raised before anything diverged; detail names where)
    #                     | round (the engine labelled a verify round with another number than the rounds before it)
    #                     | proven-crash (it raised, or its process died, at step `step`, and one stage's
    #                       replacement makes that step run and match the oracle: detail names the stage)
    #                     | drift (the noise floor's run-level test: every node's error above the oracle's
    #                       own low-precision computation's; detail says by how much)
    #                     | excess (the noise floor's count test: more nodes in the noise's upper tail than
    #                       correct nodes put there; detail names the largest)
    detail: str | None = None   # one sentence, for kinds the localizer does not explain (tree, accept-ref)


@dataclass
class CheckSummary:
    setting: str
    nodes_checked: int = 0
    divergent_nodes: int = 0
    near_ties: int = 0
    router_ties: int = 0        # divergent nodes whose divergence starts at a router flip inside the noise
    padding_rows: int = 0
    nonfinite_padding_rows: int = 0  # padding rows (tree or graph batch padding) whose logits are not finite: a
    #                                  divergence, but not a judged node (divergent_nodes <= nodes_checked)
    steps: int = 0
    stream_mismatches: int = 0
    accept_mismatches: int = 0   # steps where the walk and SGLang's verify_tree_greedy disagree
    load_mismatches: int = 0     # config keys and tensors where the engine's loader and the oracle's differ
    tree_mismatches: int = 0     # steps whose tree is not the oracle's best-first build from the same drafts
    round_mismatches: int = 0    # verify rounds the engine labelled with another number than the rounds before them
    accept_ref_mismatches: int = 0  # steps whose walk is not the oracle's greedy walk (beyond near ties)
    reference_near_ties: int = 0    # tree or walk differences explained by a near tie
    mean_accepted_length: float | None = None  # tokens committed per (step, request): accepted drafts + bonus
    acceptance_by_depth: list[float] = field(default_factory=list)  # [depth - 1] P(walk reaches depth | offered)
    max_rel_err: float = 0.0
    verdict_rule: str = "fixed"      # fixed (the dtype's table) | noise-floor (each node against its yardsticks)
    noise_rule: dict | None = None   # multiplier, floor, ceiling, drift_limit of the noise-floor rule
    planned_nodes: int | None = None       # the node count the noise-floor multiplier was set for
    max_noise_ratio: float | None = None   # largest rel_err / max(twin_err, rounded_err, floor) over judged nodes
    max_twin_err: float | None = None      # largest twin error: the dtype's noise on this model (of twin_nodes)
    twin_nodes: int | None = None          # judged nodes whose twin was computed: those whose verdict it could change
    #                                        (NoiseFloorRule.needs_twin), every one with Prepared.every_twin
    max_rounded_err: float | None = None   # largest error of the oracle's own low-precision computation
    noise_drift: float | None = None       # exp(median log(rel_err / max(rounded_err, floor))) over judged nodes
    drift_exceeded: bool = False           # noise_drift above the rule's drift_limit: a divergence of the run
    noise_excess: dict | None = None       # above, nodes, p: nodes over the rule's excess_ratio, binomial p
    excess_exceeded: bool = False          # that p under EXCESS_ALPHA: a divergence of the run
    max_node_bound: float = 0.0            # largest tolerance a node was judged at
    max_ref_scale: float = 0.0
    tolerance: float | None = None   # the relative tolerance the nodes were judged at
    first: FirstDivergence | None = None
    notes: list[str] = field(default_factory=list)
    fault_class: str | None = None   # the localizer's class of the first divergence
    explanation: str | None = None   # the localizer's paragraph
    stage: str | None = None         # the localizer's stage of the first wrong quantity
    quantity: str | None = None      # and that quantity
    port: dict | None = None         # the port under test (--impl): which stages were its own
    audit_errors: int = 0            # structural findings on the port's metadata (audit records)
    audit_warnings: int = 0          # findings that change no logits on this kernel
    first_finding: str | None = None
    strict: bool = False             # warnings fail the run too
    provenance_findings: int = 0     # KV canary findings: slots read or written against their provenance
    rank_findings: int = 0           # --tp: a rank's verify metadata or KV heads against rank 0's (tp-rank records)
    divergent_steps: int = 0         # verify steps with at least one divergent node
    stopped_early: bool = False      # the run ended after --stop-after divergent steps
    stopped: str | None = None       # the run was stopped from outside: timeout | SIGINT | SIGTERM (check/stop.py)
    engine_s_per_step: float | None = None  # mean wall seconds per verify step in the engine, after step 0
    oracle_s_per_step: float | None = None  # mean wall seconds per verify step in the float64 oracle, after step 0
    engine_warmup_s: float | None = None    # step 0 in the engine (compilation, graph capture, prefill)
    oracle_warmup_s: float | None = None    # step 0 in the check (the oracle's first forwards over the prompts)
    oracle_time_ratio: float | None = None  # oracle over engine seconds after step 0 (null with one step)
    oracle_device: str | None = None        # where the float64 oracle computed
    oracle: str | None = None               # which: dense (the whole model held) or streamed (a layer at a time)
    oracle_reason: str | None = None        # why that one there (harness/check/oracle_placement.py)
    load_s: dict = field(default_factory=dict)   # wall seconds of each loading phase (engine_load, oracle_load, ...)
    streams_s: float | None = None          # wall seconds of the stream check (the oracle's greedy streams)
    prefix_len_min: int = 0                 # committed prefix lengths the verify steps saw
    prefix_len_max: int = 0
    key_tiles: int | None = None            # prefix key tiles the backend's kernel walks at the longest prefix
    streams: list = field(default_factory=list)  # per request, decoded by the tokenizer: request, prompt, verdict,
    #                                              prompt_text, engine_text, reference_text (empty without one)
    replacements: list = field(default_factory=list)  # the first divergent step rerun with one stage's output
    #                                      replaced (localize/stage_swap.py): stage, replaced_by, step, error_before,
    #                                      error_after (x its bound; None: crashed), correct, judged_at
    crash: dict | None = None               # an exception met during the check: side, where, error, step
    error: str | None = None                # its last line (the crash's `error`)

    @property
    def verdict(self) -> str:
        """pass | diverge (a divergence, or the engine under test crashed) |
        port-error (the port under test raised in its own code before anything diverged:
        not a divergence, not a pass) | oracle-crash (the oracle raised before anything diverged) |
        internal-error (ddcheck's own code raised: nothing it says can be trusted) |
        stopped (a signal or --timeout ended the run before anything diverged: not a pass)."""
        side = (self.crash or {}).get("side")
        if side == "ddcheck":
            return "internal-error"
        if not self.checks_passed or side == "engine":
            return "diverge"
        if side in ("port", "oracle"):
            return {"port": "port-error", "oracle": "oracle-crash"}[side]
        return "stopped" if self.stopped else "pass"

    @property
    def passed(self) -> bool:
        return self.crash is None and self.checks_passed and self.stopped is None

    @property
    def checks_passed(self) -> bool:
        """No check found a divergence (whatever crashed after)."""
        return not self.failed_checks

    @property
    def failed_checks(self) -> list[str]:
        """Each check that found a divergence, as `name count` (the one list checks_passed reads, so a
        verdict of diverge always names why, divergent nodes or not)."""
        counts = (("divergent nodes", self.divergent_nodes), ("non-finite padding rows", self.nonfinite_padding_rows),
                  ("stream mismatches", self.stream_mismatches), ("accept mismatches", self.accept_mismatches),
                  ("load mismatches", self.load_mismatches), ("tree mismatches", self.tree_mismatches),
                  ("round mismatches", self.round_mismatches),
                  ("accept-ref mismatches", self.accept_ref_mismatches), ("audit errors", self.audit_errors),
                  ("audit warnings (strict)", self.audit_warnings if self.strict else 0),
                  ("provenance findings", self.provenance_findings), ("rank findings", self.rank_findings))
        out = [f"{name} {n}" for name, n in counts if n]
        if self.drift_exceeded:
            out.append(f"noise drift {self.noise_drift or 0:.2f}")
        if self.excess_exceeded:
            x = self.noise_excess or {}
            out.append(f"noise excess {x.get('above')} of {x.get('nodes')} (p {x.get('p') or 0:.1e})")
        return out

def summary_record(s: RunSettings, summary: CheckSummary) -> dict:
    if summary.divergent_nodes > summary.nodes_checked:   # every view reads these two as "divergent of checked"
        raise ValueError(f"summary counts {summary.divergent_nodes} divergent nodes of {summary.nodes_checked} checked")
    d = {k: v for k, v in asdict(summary).items() if k != "setting" and not (k == "error" and v is None)}
    return {"kind": "summary", "setting": summary.setting, "passed": summary.passed, "verdict": summary.verdict,
            "failed_checks": summary.failed_checks, "settings": s.to_dict(), **d, **provenance(),
            "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}
