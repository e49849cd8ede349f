"""One differential run: the engine under test next to the oracle, compared
per (step, request, node), then the emitted streams against the oracle's
greedy continuation."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from harness.attn import make_backend
from harness.compare.metrics import compare_node
from harness.compare.tolerance import rel_tolerance
from harness.faults import apply_fault
from harness.model.presets import load_model
from harness.oracle_lookup import load_oracle_class
from harness.records import NodeRecord, RecordWriter, StreamRecord
from harness.runner.engine import Engine, RequestStep
from harness.runner.settings import PromptSpec, RunSettings, prompt_tokens, prompts_for_batch, DEFAULT_PROMPTS



@dataclass(frozen=True)
class FirstDivergence:
    step: int
    request: int
    node: int
    depth: int | None
    padding_present: bool
    rel_err: float | None
    what: str = "node"   # node | stream


@dataclass
class CheckSummary:
    setting: str
    nodes_checked: int = 0
    divergent_nodes: int = 0
    near_ties: int = 0
    padding_rows: int = 0
    steps: int = 0
    stream_mismatches: int = 0
    max_rel_err: float = 0.0
    max_ref_scale: float = 0.0
    first: FirstDivergence | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.divergent_nodes == 0 and self.stream_mismatches == 0


@dataclass(frozen=True)
class Prepared:
    """Everything validated before anything runs or is written."""

    settings: RunSettings
    engine: Engine
    oracle: object
    prompts: list[PromptSpec]
    prompt_ids: list[list[int]]


def prepare(s: RunSettings, prompts: tuple[PromptSpec, ...] = DEFAULT_PROMPTS) -> Prepared:
    """Raises UsageError / ModelLoadError / BackendUnavailable on bad input."""
    cfg, weights = load_model(s.model, s.seed)
    backend = make_backend(s.backend, s.device, s.torch_dtype)
    pipeline = apply_fault(s.fault, s, cfg.vocab_size)
    specs = prompts_for_batch(s.batch, prompts)
    ids = [prompt_tokens(p, i, cfg.vocab_size, s.seed) for i, p in enumerate(specs)]
    engine = Engine(s, cfg, weights, backend, specs, ids, pipeline)
    oracle = load_oracle_class()(cfg, weights)
    return Prepared(s, engine, oracle, specs, ids)


def check(p: Prepared, writer: RecordWriter, on_step: Callable[[int, int], None] | None = None) -> CheckSummary:
    s = p.settings
    summary = CheckSummary(setting=s.command())
    tol = rel_tolerance(s.dtype)
    for result in p.engine.rounds():
        summary.steps += 1
        for rs in result.requests:
            _check_request_step(rs, p.oracle, tol, summary, writer)
        if on_step:
            on_step(result.step, sum(len(r.emitted) for r in p.engine.requests))
    _check_streams(p, summary, writer)
    writer.write(summary_record(s, summary))
    return summary


def summary_record(s: RunSettings, summary: CheckSummary) -> dict:
    from dataclasses import asdict
    d = {k: v for k, v in asdict(summary).items() if k != "setting"}
    return {"kind": "summary", "setting": summary.setting, "passed": summary.passed,
            "settings": s.to_dict(), **d}


def _check_request_step(rs: RequestStep, oracle, tol: float, summary: CheckSummary, writer: RecordWriter) -> None:
    tree = rs.tree
    parents = [-1] + [int(x) for x in tree.parents[1:]]
    ref = oracle.tree_logits(list(rs.prefix), list(tree.tokens), parents)  # [num_rows, vocab] float64
    accepted = set(rs.acceptance.rows)
    for row in range(tree.q_len):
        padding = row >= tree.num_rows
        if padding:
            finite = bool(torch.isfinite(rs.logits[row]).all())
            summary.padding_rows += 1
            writer.write(NodeRecord(rs.step, rs.rid, row, None, None, None, True, False, None, None, None,
                                    None, finite, "padding", summary.setting))
            continue
        m = compare_node(rs.logits[row], ref[row])
        verdict = m.verdict(tol)
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
                                verdict, summary.setting))


def _check_streams(p: Prepared, summary: CheckSummary, writer: RecordWriter) -> None:
    n = p.settings.max_new_tokens
    # an engine within tol * scale of the oracle can flip a choice whose gap is below twice that
    tie = 2 * rel_tolerance(p.settings.dtype) * max(summary.max_ref_scale, 1.0)
    for r, spec, ids in zip(p.engine.requests, p.prompts, p.prompt_ids):
        ref, gaps = p.oracle.greedy(ids, n)
        got = r.emitted[:n]
        first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        verdict = "match"
        if first is not None:
            verdict = "near-tie" if gaps[first] <= tie else "diverge"
        if verdict == "diverge":
            summary.stream_mismatches += 1
            if summary.first is None:
                summary.first = FirstDivergence(-1, r.rid, first, None, False, None, "stream")
        writer.write(StreamRecord(r.rid, spec.name, tuple(got), tuple(ref), first, verdict, summary.setting))
