"""One differential run: the engine under test next to the oracle, compared
per (step, request, node), then the emitted streams against the oracle's
greedy continuation.

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch

from harness.check.summary import CheckSummary, FirstDivergence, summary_record
from harness.check.compare.acceptance_stats import AcceptanceTally
from harness.check.compare.metrics import engine_block
from harness.check.compare.step_table import RequestRows, RowResult
from harness.check.compare.router_tie import RouterTies, StepRouting, noise_band
from harness.verdict.noise_floor import EXCESS_ALPHA, EXCESS_TAIL, planned_nodes
from harness.check.compare.tree_accept import DDTREE, check_acceptance, check_tree
from harness.check.crash import Crash, attribute
from harness.check.load_agreement import explain as explain_load
from harness.check.prepare import Prepared
from harness.check.records import NodeRecord, RecordWriter, StreamRecord
from harness.engine.loop import RequestStep
from harness.engine.settings import RunSettings
from harness.check.step_clock import StepClock, oracle_thread_count, oracle_threads, timed_phase
from harness.check.stop import RunStopped, StopWhy
from harness.check.twin_step import table_with_twins
from harness.engine.tp.audit import RANK_CLASSES, RANK_WHERE


def check(p: Prepared, writer: RecordWriter, on_step: Callable[[int, int], None] | None = None,
          localize: bool = True) -> CheckSummary:
    """Every verify step against the oracle, then the streams; the summary is
    the last record. An exception is a finding, never the end of the
    evidence: the divergences recorded before it stay, are localized, and a
    `crash` record names the side that raised (harness/check/crash.py)."""
    s = p.settings
    tol = p.tolerance
    writer.begin_run()
    summary = CheckSummary(setting=s.command(), tolerance=tol, strict=s.strict,
                           port=p.port.describe() if p.port else None, oracle_device=p.oracle_device,
                           oracle=p.oracle_plan and p.oracle_plan.name,
                           oracle_reason=p.oracle_plan and p.oracle_plan.reason, load_s=dict(p.load_s))
    if p.rule is not None:
        summary.verdict_rule, summary.noise_rule = "noise-floor", asdict(p.rule)
        summary.planned_nodes = planned_nodes(s) if s.noise_rule is None else None
    if p.load_mismatches:  # not the checkpoint's model: comparing its logits would say nothing more
        return _load_divergence(p, summary, writer)
    progress = _Progress()
    try:
        try:
            _run_checks(p, summary, writer, on_step, progress)
        except Exception as e:  # noqa: BLE001  (attributed: engine, oracle or ddcheck)
            _crashed(p, summary, writer, attribute(e, progress.step, progress.in_step), progress)
        if summary.first is not None and localize and summary.verdict != "internal-error":
            _localize(p, summary, writer)
    except RunStopped as e:   # a signal or --timeout (check/stop.py): the records so far, a summary saying so
        _stopped(summary, e, progress)
    if p.port:   # the port's entry again: its lineage now names the port code the run reached
        summary.port = p.port.describe()
    writer.write(summary_record(s, summary))
    return summary


@dataclass
class _Progress:
    step: int | None = None       # the last verify step the engine produced
    in_step: bool = False         # that step is being checked
    streams_checked: bool = False
    ignored_prefix_keys: int = 0
    drift_pairs: list = field(default_factory=list)   # (rel_err, rounded_err) of every judged node: the run's drift
    ratios: list = field(default_factory=list)        # (noise ratio, step, request, node) of every judged node
    router_ties: RouterTies | None = None              # committed positions tied by a router flip, per request
    clock: StepClock = field(default_factory=StepClock)   # engine and oracle seconds of the steps so far


def _stopped(summary: CheckSummary, stop: RunStopped, progress: _Progress) -> None:
    """The summary of a run stopped from outside: the reason, the steps' timing so far, a note."""
    summary.stopped = stop.reason
    if summary.engine_warmup_s is None:
        _note_times(summary, progress.clock)
    summary.notes.append(StopWhy(stop.reason, stop.timeout_s).sentence(summary.steps))


def _note_times(summary: CheckSummary, clock: StepClock) -> None:
    """Per-step times after the warm-up, the warm-up (step 0) apart, and their ratio (check/step_clock.py)."""
    summary.engine_s_per_step, summary.oracle_s_per_step = clock.per_step(summary.steps)
    if summary.steps:
        summary.engine_warmup_s, summary.oracle_warmup_s = clock.engine_warmup_s, clock.oracle_warmup_s
    summary.oracle_time_ratio = clock.ratio()


def _run_checks(p: Prepared, summary: CheckSummary, writer: RecordWriter,
                on_step: Callable[[int, int], None] | None, progress: _Progress) -> None:
    s = p.settings
    tally = AcceptanceTally()
    clock = progress.clock
    # a preset's oracle is tiny (threads only contend); a checkpoint's wants the cores others leave idle
    threads = oracle_thread_count(s.model, p.oracle_device)
    for result in clock.timed(p.engine.rounds()):
        progress.step, progress.in_step = result.step, True
        summary.steps += 1
        _check_round_label(result.step, summary.steps - 1, summary)
        progress.ignored_prefix_keys += _ignored_prefix_keys(result.batch, p.engine.backend)
        divergent_before = summary.divergent_nodes + summary.nonfinite_padding_rows
        _check_ranks(result, summary, writer)   # --tp: the cause, where a rank disagrees, before its logits
        with clock.oracle(), oracle_threads(threads):
            _prepare_oracle_step(p, result.requests)
            steps = [_engine_rows(rs, p.engine.cfg.vocab_size, summary) for rs in result.requests]
            judged = [_judge_request_step(rs, p) for rs in steps]
            tables = table_with_twins(p, steps, judged)   # on the run's device, one host copy (and the twins')
            for rs, j, rows in zip(steps, judged, tables):
                _check_request_step(rs, p, summary, writer, progress, rows)
                _cross_check_acceptance(rs, s.accept, summary, writer)
                _check_against_reference(p, rs, j.ref, summary, writer)
                tally.add(rs.tree, rs.acceptance)
                _note_prefix(summary, len(rs.prefix))
        _check_batch_padding(p, result.step, summary)
        _check_provenance(result.provenance, result.requests, summary, writer)
        if p.port is not None:
            _audit_port_step(p, result, summary, writer)
        if on_step:
            on_step(result.step, sum(len(r.emitted) for r in p.engine.requests))
        summary.divergent_steps += summary.divergent_nodes + summary.nonfinite_padding_rows > divergent_before
        summary.mean_accepted_length, summary.acceptance_by_depth = tally.mean_length, tally.by_depth
        if s.stop_after and summary.divergent_steps >= s.stop_after:
            summary.stopped_early = True
            summary.notes.append(f"stopped after {summary.divergent_steps} divergent steps (--stop-after "
                                 f"{s.stop_after}); streams compared over the tokens emitted")
            break
        progress.in_step = False   # the engine's next round (or its end) is under way
    _note_times(summary, clock)
    _check_drift(p, summary, progress.drift_pairs)
    _check_excess(p, summary, progress.ratios)
    tiles = getattr(p.engine.backend, "key_tiles", None)
    summary.key_tiles = tiles(summary.prefix_len_max, p.engine.cfg.head_dim) if tiles and summary.steps else None
    if not summary.stopped_early:   # an unfinished engine has no finish findings
        _check_provenance(tuple(p.engine.finish_findings), (), summary, writer)
    progress.streams_checked = True
    streams: dict[str, float] = {}
    with oracle_threads(threads), timed_phase(streams, "streams"):
        _check_streams(p, summary, writer)
    summary.streams_s = streams["streams"]
    _add_notes(p, summary, progress.ignored_prefix_keys)


def _prepare_oracle_step(p: Prepared, requests) -> None:
    """Hand the oracle the whole step's trees first, where it can judge them together (the optional
    `prepare_step` of ddschema/oracle.py: one pass over its weights for every request); the per-request
    tree_logits / rounded_tree_logits calls below then read that pass."""
    prepare = getattr(p.oracle, "prepare_step", None)
    if prepare is None or not requests:
        return
    trees = [(list(rs.prefix), list(rs.tree.tokens), [-1] + [int(x) for x in rs.tree.parents[1:]])
             for rs in requests]
    prepare(trees, [(p.settings.dtype, bool(p.rounded_probabilities))] if p.rule is not None else [])


def _crashed(p: Prepared, summary: CheckSummary, writer: RecordWriter, crash: Crash, progress: _Progress) -> None:
    """A crash record; the divergences seen before it stand. An engine crash
    is a divergence named "crash" when nothing diverged before it; after an
    engine crash the streams are still compared over the tokens emitted."""
    writer.write(crash.record(summary.setting))
    summary.crash = crash.brief()
    summary.error = crash.error
    if crash.side == "engine" and not progress.streams_checked:
        summary.stopped_early = True   # compare what was emitted, as a run stopped early does
        try:
            _check_streams(p, summary, writer)
        except Exception as e:  # noqa: BLE001  (a second failure must not replace the first)
            summary.notes.append(f"streams not compared: {attribute(e).sentence()}")
    try:
        _add_notes(p, summary, progress.ignored_prefix_keys)
    except Exception:  # noqa: BLE001  (notes are a courtesy)
        pass
    before = summary.divergent_nodes + summary.nonfinite_padding_rows + summary.stream_mismatches + summary.tree_mismatches \
        + summary.accept_ref_mismatches + summary.accept_mismatches + summary.provenance_findings
    if summary.first is None and crash.side == "engine":
        step = crash.step if crash.step is not None else -1
        summary.first = FirstDivergence(step, -1, -1, None, False, None, "crash", crash.sentence())
    elif before:
        summary.notes.append(f"{crash.sentence()}, after {before} divergences were recorded; the first of them "
                             "is the one reported")
    else:
        summary.notes.append(crash.sentence())


def _note_prefix(summary: CheckSummary, n: int) -> None:
    summary.prefix_len_min = min(summary.prefix_len_min or n, n)
    summary.prefix_len_max = max(summary.prefix_len_max, n)


def _load_divergence(p: Prepared, summary: CheckSummary, writer: RecordWriter) -> CheckSummary:
    return _load_divergence_of(p.settings, p.load_mismatches, summary, writer)


def _load_divergence_of(s: RunSettings, mismatches, summary: CheckSummary, writer: RecordWriter) -> CheckSummary:
    """The engine's parsed checkpoint differs from the oracle's own reading:
    one `load` record per key or tensor, the summary names the first."""
    for m in mismatches:
        writer.write({**asdict(m), "setting": summary.setting, "verdict": "diverge"})
    first = mismatches[0]
    summary.load_mismatches = len(mismatches)
    summary.first = FirstDivergence(-1, -1, -1, None, False, None, first.what)
    summary.fault_class, summary.explanation = first.what, explain_load(list(mismatches))
    summary.stage, summary.quantity = "load", first.what   # the loader produced the first wrong quantity
    writer.write(summary_record(s, summary))
    return summary


def write_load_divergence(s: RunSettings, writer: RecordWriter, mismatches) -> CheckSummary:
    """The engine's loader raised on a checkpoint the oracle read (check/load_agreement.py LoadDivergence): the
    load records and a failing summary, no engine built, no step run."""
    if writer.run_id is None:
        writer.begin_run()
    return _load_divergence_of(s, tuple(mismatches), CheckSummary(setting=s.command()), writer)


def write_crash_summary(s: RunSettings, writer: RecordWriter, e: Exception) -> CheckSummary:
    """An exception check() did not keep (building the engine or the oracle,
    or ddcheck's own summary code): a crash record naming the side that
    raised, and a failing summary in place of any other."""
    crash = attribute(e)
    if writer.run_id is None:
        writer.begin_run()
    writer.lines = [ln for ln in writer.lines if '"kind": "summary"' not in ln]
    summary = CheckSummary(setting=s.command(), crash=crash.brief(), error=crash.error)
    if crash.side == "engine":
        summary.first = FirstDivergence(-1, -1, -1, None, False, None, "crash", crash.sentence())
        summary.fault_class, summary.explanation = "crash", crash.sentence()
    writer.write(crash.record(summary.setting))
    writer.write(summary_record(s, summary))
    return summary


def write_stopped_summary(s: RunSettings, writer: RecordWriter, stop: RunStopped) -> CheckSummary:
    """A stop check() did not keep (while the engine or the oracle was being built, or while the summary was
    being written): the records so far and a summary of verdict `stopped` in place of any other."""
    if writer.run_id is None:
        writer.begin_run()
    writer.lines = [ln for ln in writer.lines if '"kind": "summary"' not in ln]
    summary = CheckSummary(setting=s.command())
    _stopped(summary, stop, _Progress())
    writer.write(summary_record(s, summary))
    return summary


def _engine_rows(rs: RequestStep, vocab: int, summary: CheckSummary) -> RequestStep:
    """The request's logits as [q_len, vocab]: a block of another shape is the engine's divergence
    (compare/metrics.py engine_block), noted, never an error of the check."""
    logits, wrong_shape = engine_block(rs.logits, rs.tree.q_len, vocab)   # [q_len, vocab]
    if wrong_shape is None:
        return rs
    summary.notes.append(f"step {rs.step}, request {rs.rid}: {wrong_shape}")
    return replace(rs, logits=logits)


def _judge_request_step(rs: RequestStep, p: Prepared) -> RequestRows:
    """The oracle's rows for the request's tree, and under the noise-floor verdict its two yardsticks (the
    twin and the oracle's own low-precision computation): what compare/step_table.py compares. The twin only
    with Prepared.every_twin: else check/twin_step.py computes it for the nodes whose verdict it can change."""
    tree = rs.tree
    parents = [-1] + [int(x) for x in tree.parents[1:]]
    ref = p.oracle.tree_logits(list(rs.prefix), list(tree.tokens), parents)  # [num_rows, vocab] float64
    if p.rule is None:
        return RequestRows(rs.logits, ref)
    rounded = p.oracle.rounded_tree_logits(list(rs.prefix), list(tree.tokens), parents, p.settings.dtype,
                                           p.rounded_probabilities)            # [num_rows, vocab] float64
    twin = p.twin.tree_logits(rs.prefix, tree) if p.every_twin else None      # [num_rows, vocab] float32
    return RequestRows(rs.logits, ref, twin, rounded)


def _check_request_step(rs: RequestStep, p: Prepared, summary: CheckSummary, writer: RecordWriter,
                        progress: _Progress, rows: list[RowResult]) -> None:
    """Judge every verify row from its quantities (compare/step_table.py), one record each."""
    tree = rs.tree
    rule = p.rule
    if progress.router_ties is None:
        progress.router_ties = RouterTies(noise_band(p.settings.torch_dtype))
    routed = StepRouting(rs, p.oracle, progress.router_ties)   # router near ties (compare/router_tie.py)
    accepted = set(rs.acceptance.rows)
    for row in range(tree.q_len):
        padding = row >= tree.num_rows
        if padding:
            finite = rows[row].finite
            summary.padding_rows += 1
            if not finite:  # a padding row must see at least one key: NaN here is a fully masked row
                summary.nonfinite_padding_rows += 1   # not a judged node: divergent_nodes counts nodes_checked's
                if summary.first is None:
                    summary.first = FirstDivergence(rs.step, rs.rid, row, None, True, None, "padding")
            writer.write(NodeRecord(rs.step, rs.rid, row, None, None, None, True, False, None, None, None,
                                    None, finite, "padding" if finite else "diverge", summary.setting))
            continue
        m, r = rows[row].metrics, rows[row]
        twin_err = rounded_err = ratio = twin_dist = None
        l2 = (None, None, None)
        tol = p.tolerance
        if rule is not None:
            twin_err, rounded_err, twin_dist, l2 = r.twin_err, r.rounded_err, r.twin_dist, r.l2
            known = 0.0 if twin_err is None else twin_err   # not computed: it could not change this node's verdicts
            tol, ratio = rule.bound(known, rounded_err), rule.ratio(m.rel_err, known, rounded_err)
            summary.max_noise_ratio = max(summary.max_noise_ratio or 0.0, ratio)
            if twin_err is not None:
                summary.max_twin_err = max(summary.max_twin_err or 0.0, twin_err)
                summary.twin_nodes = (summary.twin_nodes or 0) + 1
            summary.max_rounded_err = max(summary.max_rounded_err or 0.0, rounded_err)
            progress.drift_pairs.append((m.rel_err, rounded_err))
            progress.ratios.append((ratio, rs.step, rs.rid, row))
        summary.max_node_bound = max(summary.max_node_bound, tol)
        verdict = m.verdict(tol)
        if verdict == "diverge" and routed.verdict(row) == "router-tie":
            verdict = "router-tie"   # a router flip inside the noise on both sides: counted, shown, not a divergence
        summary.router_ties += verdict == "router-tie"
        summary.nodes_checked += 1
        summary.max_rel_err = max(summary.max_rel_err, m.rel_err)
        summary.max_ref_scale = max(summary.max_ref_scale, m.ref_scale)
        summary.near_ties += verdict == "near-tie"
        if verdict == "diverge":
            summary.divergent_nodes += 1
            if summary.first is None:
                summary.first = FirstDivergence(rs.step, rs.rid, row, tree.depths[row], tree.num_padding > 0, m.rel_err)
        writer.write(NodeRecord(rs.step, rs.rid, row, tree.depths[row], tree.parents[row], tree.tokens[row],
                                False, row in accepted, m.rel_err, m.top1_agree, m.kl, m.ref_gap, m.finite,
                                verdict, summary.setting, twin_err=twin_err, noise_ratio=ratio,
                                rounded_err=rounded_err, twin_dist=twin_dist, rel_l2=l2[0], twin_l2=l2[1],
                                rounded_l2=l2[2]))
    routed.commit()


def _check_drift(p: Prepared, summary: CheckSummary, pairs: list[tuple[float, float]]) -> None:
    """The noise-floor rule's run-level test: the engine's errors against the
    oracle's own low-precision computation of the same nodes, node after
    node (harness/verdict/noise_floor.py). A model whose arithmetic is off
    (RoPE, a softmax scale) moves every node; its twin moves with it."""
    rule = p.rule
    if rule is None or not pairs:
        return
    summary.noise_drift = rule.drift(pairs)
    if summary.noise_drift > rule.drift_limit:
        summary.drift_exceeded = True
        summary.notes.append(f"noise drift {summary.noise_drift:.2f} over {len(pairs)} nodes")
        if summary.first is None:
            summary.first = FirstDivergence(-1, -1, -1, None, False, None, "drift", (
                f"the engine's errors sit {summary.noise_drift:.2f}x (median over {len(pairs)} nodes) above those of "
                f"the oracle's own {p.settings.dtype} computation of the same nodes, over the limit "
                f"{rule.drift_limit:g}: the model's arithmetic (RoPE, norms, the softmax scale, the loader) differs "
                f"from the reference's, on every node, not the tree's"))


def _check_excess(p: Prepared, summary: CheckSummary, ratios: list[tuple[float, int, int, int]]) -> None:
    """The noise-floor rule's excess test: more nodes above the rule's
    excess ratio than correct nodes put there (harness/verdict/noise_floor.py,
    test 3). A small leak that repeats on every step fails here although each
    of its rows stays within its own bound."""
    rule = p.rule
    found = rule.excess([r for r, *_ in ratios]) if rule is not None else None
    if found is None:
        return
    k, n, pvalue = found
    summary.noise_excess = dict(above=k, nodes=n, p=pvalue)
    if pvalue >= EXCESS_ALPHA:
        return
    summary.excess_exceeded = True
    worst = sorted(ratios, reverse=True)[:3]
    where = ", ".join(f"step {st} request {rq} node {nd} ({r:.2f})" for r, st, rq, nd in worst)
    summary.notes.append(f"noise excess: {k} of {n} nodes above {rule.excess_ratio:g}x their noise (p {pvalue:.1e})")
    if summary.first is None:
        summary.first = FirstDivergence(worst[0][1], worst[0][2], worst[0][3], None, False, None, "excess", (
            f"{k} of {n} nodes sit above {rule.excess_ratio:g}x their noise, where correct {p.settings.dtype} "
            f"nodes put {EXCESS_TAIL:.0%} (binomial p {pvalue:.1e} < {EXCESS_ALPHA:g}); each node is within its "
            f"own bound, so a small error repeats over the run; largest: {where}"))


def _check_against_reference(p: Prepared, rs: RequestStep, ref: torch.Tensor, summary: CheckSummary,
                             writer: RecordWriter) -> None:
    """The engine's tree (when its builder claims DDTree best-first and the
    drafts are known) and its walk against the oracle's own."""
    s = p.settings
    verdicts = []
    if p.engine.pipeline.tree_builder == DDTREE and rs.draft_logprobs is not None:
        verdicts.append(("tree", check_tree(rs, p.oracle, s.budget, s.topk, summary.setting)))
    tol = summary.max_node_bound if p.rule is not None else p.tolerance  # the nodes' own scale, not the ceiling
    verdicts.append(("accept-ref", check_acceptance(rs, ref, p.oracle, tol, summary.setting, s.eos_id)))
    for what, v in verdicts:
        if v is None:
            continue
        writer.write(v.record)
        if not v.diverged:
            summary.reference_near_ties += 1
            continue
        if what == "tree":
            summary.tree_mismatches += 1
        else:
            summary.accept_ref_mismatches += 1
        if summary.first is None:
            summary.first = FirstDivergence(rs.step, rs.rid, 0, None, rs.tree.num_padding > 0, None, what,
                                            v.sentence)


def _audit_port_step(p: Prepared, result, summary: CheckSummary, writer: RecordWriter) -> None:
    """The port's metadata against the rules, whatever the logits say (harness/ports/audit.py)."""
    reqs = result.requests
    finite = [torch.isfinite(rs.logits).all(-1).tolist() for rs in reqs]   # per request: [q_len] bool
    findings = p.port.audit(result.step, result.batch.to("cpu"), [rs.tree for rs in reqs],
                            [rs.acceptance for rs in reqs], [rs.logits.argmax(-1).tolist() for rs in reqs],
                            "prefix" in p.engine.backend.mask_regions, (p.engine.backend.name, finite),
                            getattr(getattr(p.engine, "serving", None), "last_served", None))
    for f in findings:
        writer.write(f.record(summary.setting))
        if f.severity == "error":
            summary.audit_errors += 1
        else:
            summary.audit_warnings += 1
        if summary.first_finding is None and (f.severity == "error" or summary.strict):
            where = f"step {f.step}" + (f", request {f.request}" if f.request >= 0 else "")
            summary.first_finding = f"{f.check} ({f.severity}) at {where}: {f.detail}"
    warnings = [f for f in findings if f.severity == "warning"]
    if warnings and not any(n.startswith("audit warning") for n in summary.notes):
        summary.notes.append(f"audit warning: {warnings[0].check}: {warnings[0].detail}")


def _ignored_prefix_keys(vb, backend) -> int:
    """Prefix keys the mask blocks (a False in a prefix column of a request's
    block) that the backend never reads, so they stay visible: the oracle,
    like SGLang's kernel under skip_prefix_custom_mask, shows every row the
    whole prefix, and the comparison judges against what the kernel does."""
    if "prefix" in backend.mask_regions or vb.attn.custom_mask is None:
        return 0
    mask, indptr, n = vb.attn.custom_mask.cpu() != 0, vb.attn.mask_indptr.tolist(), vb.q_len
    blocked = 0
    # the prefix each request's kernel reads (kv_indptr), not the batch's seq_lens: a stage that gets those
    # wrong is the comparison's to judge, never this note's to raise on; a block past the mask is not counted
    for b, prefix in enumerate(vb.attn.kv_indptr.diff().tolist()):
        size = n * (prefix + n)
        if indptr[b] < 0 or indptr[b] + size > mask.numel():
            continue
        block = mask[indptr[b]:indptr[b] + size].view(n, prefix + n)  # [q_len, prefix+q_len]
        blocked += int((~block[:, :prefix]).any(0).sum())
    return blocked


def _check_provenance(findings, requests, summary: CheckSummary, writer: RecordWriter) -> None:
    """The KV canary's findings (harness/engine/mem/provenance.py): each a `provenance` record and a divergence."""
    for f in findings:
        writer.write(f.record(summary.setting))
        summary.provenance_findings += 1
        if summary.first is None:
            rids = [rs.rid for rs in requests]
            rid = f.request if f.request in rids or not rids else rids[0]
            summary.first = FirstDivergence(f.step, rid, 0, None, False, None, "provenance", f.text)


def _check_ranks(result, summary: CheckSummary, writer: RecordWriter) -> None:
    """--tp: each rank whose metadata or KV heads disagree with rank 0's (harness/engine/tp/audit.py) is a
    `tp-rank` record and a divergence named by its class."""
    for f in result.rank_findings:
        writer.write(f.record(summary.setting))
        summary.rank_findings += 1
        if summary.first is None:
            rid = result.requests[0].rid if result.requests else 0
            summary.first = FirstDivergence(f.step, rid, 0, None, False, None, f.cls, f.text)


def _cross_check_acceptance(rs: RequestStep, accept: str, summary: CheckSummary, writer: RecordWriter) -> None:
    """The acceptor that did not drive the run must agree with the one that did."""
    if rs.cross_check is None or rs.cross_check == rs.acceptance:
        return
    walk, sglang = (rs.acceptance, rs.cross_check) if accept == "walk" else (rs.cross_check, rs.acceptance)
    summary.accept_mismatches += 1
    if summary.first is None:
        summary.first = FirstDivergence(rs.step, rs.rid, 0, None, rs.tree.num_padding > 0, None, "accept")
    writer.write({"kind": "accept", "setting": summary.setting, "step": rs.step, "request": rs.rid,
                  "walk_rows": list(walk.rows), "sglang_rows": list(sglang.rows),
                  "walk_bonus": walk.bonus, "sglang_bonus": sglang.bonus, "verdict": "diverge"})


def _add_notes(p: Prepared, summary: CheckSummary, ignored_prefix_keys: int) -> None:
    backend = p.engine.backend
    if ignored_prefix_keys:
        summary.notes.append(f"mask blocks {ignored_prefix_keys} prefix keys; {backend.name} does not read the "
                             "prefix columns (skip_prefix_custom_mask), so they stay visible")
    if summary.tree_mismatches or summary.accept_ref_mismatches:
        summary.notes.append(f"against the oracle's own build and walk: {summary.tree_mismatches} trees and "
                             f"{summary.accept_ref_mismatches} walks differ (see the tree / accept-ref records)")
    if summary.reference_near_ties:
        summary.notes.append(f"{summary.reference_near_ties} tree or walk differences are near ties, not divergences")
    if summary.accept_mismatches:
        summary.notes.append(f"acceptance: walk and SGLang's verify_tree_greedy disagree on "
                             f"{summary.accept_mismatches} (step, request) pairs (see the accept records)")
    if p.engine.cross_accept is None:
        summary.notes.append("acceptance cross-check skipped: SGLang's verify_tree_greedy_triton does not import")


def _check_streams(p: Prepared, summary: CheckSummary, writer: RecordWriter) -> None:
    n = p.settings.max_new_tokens   # a run stopped early (--stop-after) compares what it emitted
    # an engine within tol * scale of the oracle can flip a choice whose gap is below twice that
    tie = 2 * max(summary.max_node_bound, p.tolerance if p.rule is None else 0.0) * max(summary.max_ref_scale, 1.0)
    for r, spec, ids in zip(p.engine.requests, p.prompts, p.prompt_ids):
        got = r.emitted[:n]
        ref, gaps = p.oracle.greedy(ids, len(got) if summary.stopped_early else n)
        ref = cut_stream(ref, p.settings.eos_id)
        first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        verdict = "match"
        if first is not None:
            verdict = "near-tie" if gaps[first] <= tie else "diverge"
        elif len(got) != len(ref):   # one side went on past a stop the other made: no tie explains that
            first, verdict = min(len(got), len(ref)), "diverge"
        if verdict == "diverge":
            summary.stream_mismatches += 1
            if summary.first is None:
                summary.first = FirstDivergence(-1, r.rid, first, None, False, None, "stream")
        texts = decoded(p.loaded.tokenizer, ids, got, ref)
        writer.write(StreamRecord(r.rid, spec.name, tuple(got), tuple(ref), first, verdict, summary.setting,
                                  prompt_text=texts[0], engine_text=texts[1], reference_text=texts[2]))
        if texts[0] is not None:
            summary.streams.append({"request": r.rid, "prompt": spec.name, "verdict": verdict,
                                    "prompt_text": texts[0], "engine_text": texts[1], "reference_text": texts[2]})


def decoded(tokenizer, *streams: list[int]) -> tuple[str | None, ...]:
    """Each token stream as text (special tokens kept: an end-of-text or a run of one token shows);
    Nones without a tokenizer."""
    if tokenizer is None:
        return (None,) * len(streams)
    return tuple(tokenizer.decode(list(t), skip_special_tokens=False) for t in streams)


def cut_stream(tokens: list[int], eos_id: int | None) -> list[int]:
    """A greedy stream ended at its first end-of-sequence token (kept)."""
    if eos_id is None or eos_id not in tokens:
        return tokens
    return tokens[:tokens.index(eos_id) + 1]


def _check_round_label(label: int, rounds_before: int, summary: CheckSummary) -> None:
    """The engine labels each verify round with the count of rounds before it (its records, the localizer's
    reruns to a step and a user's `--stop-after` all read that label): another is the engine's divergence."""
    if label == rounds_before:
        return
    summary.round_mismatches += 1
    if summary.first is None:
        summary.first = FirstDivergence(rounds_before, -1, -1, None, False, None, "round",
                                        f"the engine labelled its verify round {rounds_before} (counted from 0) "
                                        f"as step {label}: its round counter is wrong")


def _check_batch_padding(p: Prepared, step: int, summary: CheckSummary) -> None:
    """Graph batch-padding (dummy) rows are discarded, but like padding rows
    they must come out finite: NaN there means their mask was not theirs."""
    replay = p.engine.graph.last if p.engine.graph is not None else None
    if replay is None:
        return
    t = replay.live.seq_lens.numel() * replay.live.q_len
    bad = (~torch.isfinite(replay.logits[t:]).all(-1)).nonzero().flatten().tolist()
    summary.nonfinite_padding_rows += len(bad)
    if bad and summary.first is None:
        n = replay.live.q_len
        summary.first = FirstDivergence(step, (t + bad[0]) // n, bad[0] % n, None, True, None, "batch-padding")


def _crashed_inputs(p: Prepared, summary: CheckSummary) -> None:
    """An engine crash: the crashed round's verify inputs that break SGLang's rules lead the explanation."""
    from harness.check.localize.crash_audit import audit_crashed_round
    from harness.check.localize.wrong import STAGE_WORDS, first_wrong
    try:
        w = first_wrong(audit_crashed_round(p))
    except Exception as e:  # noqa: BLE001  (the crash verdict stands without it)
        summary.notes.append(f"crash audit failed: {attribute(e).sentence()}")
        return
    if w is not None:
        summary.stage, summary.quantity = STAGE_WORDS[w.stage], w.quantity
        summary.explanation = (f"First wrong quantity: {w.quantity}, produced by the {summary.stage} stage, at step "
                               f"{w.step}: {w.text}; then {summary.explanation}")
    elif summary.crash is not None:   # inputs by the rules: the stage whose code raised is named
        _name_crash_stage(summary)


def _name_crash_stage(summary: CheckSummary) -> None:
    from harness.check.crash import Crash, crash_stage
    c = summary.crash
    stage = crash_stage(Crash(c["side"], c["where"], c["where"], c["error"], c["step"], ""))
    if stage is not None:
        summary.stage, summary.quantity = stage, "crash"
        summary.explanation = f"The {stage} stage crashed (its code raised; the verify inputs it was handed " \
                              f"break no rule): {summary.explanation}"


def _drift_by_replacement(p: Prepared, summary: CheckSummary) -> None:
    """A run-level drift, its stage proven by replacement: the attention backend's, when a float64 softmax of
    the same inputs in its place takes the drift away (harness/check/localize/replace.py)."""
    from harness.check.localize.replace import replace_attention
    if p.rule is None or summary.noise_drift is None:
        return
    try:
        r = replace_attention(p, summary.noise_drift, p.rule.drift_limit, check)
    except Exception as e:  # noqa: BLE001  (the drift verdict stands without it)
        summary.notes.append(f"attention replacement failed: {attribute(e).sentence()}")
        return
    if r is None:
        return
    summary.replacements.append({"stage": "attention", "replaced_by": "a float64 softmax of the same inputs",
                                 "step": None, "error_before": r.drift_before / r.limit,
                                 "error_after": None if r.drift_after is None else r.drift_after / r.limit,
                                 "correct": r.cause, "note": "the run's drift over its limit",
                                 "sentence": r.sentence()})
    summary.explanation = f"{summary.explanation}; {r.sentence()}"
    if r.cause:
        summary.fault_class, summary.stage, summary.quantity = "attention-arithmetic", "attention", "attention_output"


def _prove(p: Prepared, summary: CheckSummary, crash: bool) -> None:
    """The first divergent (or crashed) step rerun with one stage's output replaced at a time
    (harness/check/localize/stage_swap.py): what each replacement did joins the summary; the stage whose
    replacement made the step correct is named where the audits named none or only the model's outputs (a crash:
    where its file named it)."""
    from harness.check.localize.stage_swap import proven, prove_crash, prove_divergent_step
    first = summary.first
    try:
        if crash:
            c = summary.crash or {}
            if c.get("side") != "engine":
                return
            step = 0 if c.get("step") is None else c["step"] + (0 if c.get("in_step") else 1)
            found = prove_crash(p, step, c.get("refusal"))
        else:
            found = prove_divergent_step(p, first.step)
    except Exception as e:  # noqa: BLE001  (the verdict and the audits' story stand without it)
        summary.notes.append(f"stage replacement failed: {attribute(e).sentence()}")
        return
    summary.replacements += [r.to_record() for r in found]
    if not found:
        return
    cause = proven(found)
    tried = ", ".join(r.stage for r in found)
    if cause is None:
        summary.explanation = _with_proof(summary.explanation, f"by replacement at step {found[0].step}: no "
                                          f"replaced stage ({tried}) made the step correct")
        return
    summary.explanation = _with_proof(summary.explanation, f"proven by replacement (tried {tried}): "
                                                           f"{cause.sentence()}")
    if crash:
        _crash_proven(summary, cause)
        if summary.quantity in (None, "crash"):
            summary.explanation = _crash_renamed(summary.explanation, summary.stage, cause.stage)
            summary.stage, summary.quantity = cause.stage, "crash"
    elif proof_overrides(summary.stage, found):
        summary.stage, summary.quantity = cause.stage, "replacement"


def proof_overrides(audit_stage: str | None, found: list) -> bool:
    """Whether a proven stage replaces the one the audits named: where they named none; where they saw only the
    model's outputs wrong (logits, a cached K/V: a replaced engine stage made the step correct, so that stage
    fed the model); or where the audits' own stage was replaced without making the step correct (refuted)."""
    if audit_stage is None or audit_stage == "model":
        return True
    return any(r.stage == audit_stage and not r.correct for r in found)


def _crash_renamed(explanation: str | None, named: str | None, proven: str) -> str | None:
    """The explanation's lead where the file that raised named one stage (_name_crash_stage) and the proof
    another: the proven stage crashed, its fault reaching the named stage's code."""
    lead = f"The {named} stage crashed (its code raised; the verify inputs it was handed break no rule): "
    if named in (None, proven) or not (explanation or "").startswith(lead):
        return explanation
    return f"The {proven} stage crashed (proven by replacement; its fault reached the {named} stage's code, which " \
           f"raised): {explanation[len(lead):]}"


def _crash_proven(summary: CheckSummary, cause) -> None:
    """The crashed step is the run's first divergence: its stage proven by the replacement that made it run and
    match the oracle (a `crash` first divergence becomes a `proven-crash` one; the crash record stays)."""
    from harness.check.crash import PROVEN_CRASH, proven_crash_detail
    c = summary.crash or {}
    detail = proven_crash_detail(cause.step, c.get("error") or "?", c.get("where") or "?", cause.stage,
                                 cause.replaced_by, cause.error_after, cause.judged_at)
    summary.first = FirstDivergence(cause.step, -1, -1, None, False, None, PROVEN_CRASH, detail)


def _with_proof(explanation: str | None, proof: str) -> str:
    """The replacement's sentence before the closing "Catalog class: ..." (which stays last)."""
    head, sep, tail = (explanation or "").rpartition(" Catalog class: ")
    if not sep:
        return f"{explanation}; {proof}" if explanation else proof
    return f"{head} Proof: {proof}.{sep}{tail}"


def _localize(p: Prepared, summary: CheckSummary, writer: RecordWriter) -> None:
    """Name the first divergence: a `localize` record and the summary's explanation."""
    from harness.check.localize import localize
    first = summary.first
    if first.what == "drift":  # every node, not one row: nothing for the tree localizer to bisect
        summary.fault_class, summary.explanation = "model-arithmetic", first.detail
        summary.stage, summary.quantity = "model forward", "logits"
        _drift_by_replacement(p, summary)
        return
    if first.what in ("tree", "crash", "round") or first.what in RANK_CLASSES:  # decided before the verify forward
        summary.fault_class, summary.explanation = first.what, first.detail
        if first.what == "round":   # the loop's own counter: no stage's output is wrong, none is named
            return
        if first.what in RANK_CLASSES:   # the ranks' audit measured the first wrong quantity itself
            summary.stage, summary.quantity = RANK_WHERE[first.what]
        elif first.what == "tree":
            summary.stage, summary.quantity = "tree build", "tree"
        else:
            _crashed_inputs(p, summary)
            _prove(p, summary, crash=True)
        return
    try:
        # an excess names its largest node; the localizer probes it as it probes a divergent node
        probe = {"accept-ref": "accept", "excess": "node"}.get(first.what, first.what)
        loc = localize(p, replace(first, what=probe))
    except (MemoryError, torch.cuda.OutOfMemoryError) as e:   # the verdict stands; say what did not fit
        where = "GPU" if isinstance(e, torch.cuda.OutOfMemoryError) else "host"
        summary.notes.append(f"localizer: not enough {where} memory to re-run the engine up to step {first.step} "
                             "next to this run's; the verdict stands, unexplained")
        if first.detail:
            summary.fault_class, summary.explanation = first.what, first.detail
        return
    except Exception as e:  # noqa: BLE001  (a localizer bug must not hide the divergence it was naming)
        summary.notes.append(f"localizer failed: {attribute(e).sentence()}")
        if first.detail:
            summary.fault_class, summary.explanation = first.what, first.detail
        return
    writer.write({**asdict(loc), "setting": summary.setting})
    summary.fault_class, summary.explanation = loc.fault_class, loc.explanation
    summary.stage, summary.quantity = loc.stage, loc.quantity
    if first.what in ("node", "padding", "excess"):
        _prove(p, summary, crash=False)
    if first.what == "accept-ref" and loc.fault_class == "unknown":  # what was measured beats "unknown"
        summary.fault_class, summary.explanation = "accept-ref", first.detail
        summary.stage, summary.quantity = summary.stage or "accept", summary.quantity or "accepted_rows"
    if first.what == "excess":   # say what was counted before what the probe found
        summary.explanation = f"{first.detail}. {loc.explanation}"
    if first.what == "provenance" and loc.fault_class == "unknown":
        summary.fault_class, summary.explanation = "kv-provenance", first.detail
