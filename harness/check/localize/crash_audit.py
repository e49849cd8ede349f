"""An engine that raised inside a verify round: that round's verify inputs,
audited against SGLang's rules (metadata_audit.verify_inputs) as the batch
the forward was handed, so a crash still names its first wrong quantity.

A fresh engine over the run's weights and pipeline re-runs the rounds with
the verify-input stage wrapped to keep what it built; nothing else of the
pipeline changes.

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from harness.check.localize.metadata_audit import verify_inputs
from harness.check.localize.wrong import Wrong


@dataclass(frozen=True)
class _Request:          # the parts of a RequestStep the verify-input audit reads
    rid: int
    tree: object
    prefix: range        # only its length is read
    row_slots: tuple[int, ...]


@dataclass(frozen=True)
class _Round:            # the parts of a StepResult the verify-input audit reads
    step: int
    batch: object
    requests: tuple[_Request, ...]


def audit_crashed_round(p) -> list[Wrong]:
    """The wrong verify inputs of the round during which the engine raised
    ([] when the re-run does not raise, or its inputs break no rule)."""
    from harness.check.prepare import derive
    built: dict = {}
    inner = p.engine.pipeline.build_verify_batch

    def keep(trees, seq_lens, req_pool_indices, req_to_token, out_cache_loc, mask_builder):
        vb = inner(trees, seq_lens, req_pool_indices, req_to_token, out_cache_loc, mask_builder)
        built.update(trees=trees, seq=list(seq_lens), idx=list(req_pool_indices), loc=out_cache_loc, vb=vb)
        return vb

    engine = derive(p, pipeline=replace(p.engine.pipeline, build_verify_batch=keep)).engine
    step = 0
    try:
        for step, _ in enumerate(engine.rounds(), start=1):
            built.clear()
        return []
    except Exception:  # noqa: BLE001  (the engine's own crash, met again: audit what it was handed)
        if not built:
            return []
    rid_of = {r.req_pool_idx: r.rid for r in engine.requests if not r.finished}
    loc = torch.as_tensor(built["loc"]).cpu().tolist()    # [bs*q_len] slots handed to the round
    q = built["vb"].q_len
    requests = tuple(_Request(rid_of[i], t, range(s), tuple(loc[b * q:(b + 1) * q]))
                     for b, (t, s, i) in enumerate(zip(built["trees"], built["seq"], built["idx"])))
    return verify_inputs(engine, _Round(step, built["vb"], requests))
