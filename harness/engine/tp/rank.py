"""One tensor-parallel rank: the engine's own loop over the rank's shard of
the model, building its own verify metadata each round as a server rank
does; rank 0 audits every rank's metadata (audit.py) before the verify.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ddschema import ModelConfig
from harness.engine.loop import Engine, StepResult
from harness.engine.pipeline import Pipeline
from harness.engine.settings import PromptSpec, RunSettings
from harness.engine.tp.audit import RankFinding, RankMeta, audit_kv_heads, audit_ranks
from harness.engine.tp.group import Group
from harness.engine.tp.parallel_model import TPLlamaModel
from harness.engine.tp.sharding import RankShard, kv_heads_read, rank_config


@dataclass(frozen=True)
class RankJob:
    """What every rank is handed (pickled to the spawned processes)."""

    settings: RunSettings
    cfg: ModelConfig                    # the whole model's
    weights: dict                       # the whole model's tensors on the CPU; each rank keeps its shard
    prompts: tuple[PromptSpec, ...]
    prompt_ids: tuple[tuple[int, ...], ...]
    pipeline: Pipeline
    init_file: str                      # the group's rendezvous file
    timeout_s: float


class RankEngine(Engine):
    """The engine of one rank; `rounds()` as Engine's, rank 0's StepResults carrying the audit's findings."""

    def __init__(self, job: RankJob, settings: RunSettings, shard: RankShard, group: Group, backend,
                 pipeline: Pipeline):
        self.full_cfg, self.shard, self.group = job.cfg, shard, group
        self._previous: list[RankMeta] | None = None   # every rank's metadata of the round before
        self._verifies = 0
        self.step_findings: list[RankFinding] = []
        super().__init__(settings, rank_config(job.cfg, shard), job.weights, backend, list(job.prompts),
                         [list(x) for x in job.prompt_ids], pipeline)

    def _build_model(self, cfg: ModelConfig, weights) -> TPLlamaModel:
        return TPLlamaModel(self.full_cfg, weights, self.shard, self.group, self.s.torch_dtype, self.s.device)

    def _acceptors(self, accept: str, walk):
        """Every rank accepts alike (the logits are gathered); the launcher cross-checks rank 0's rounds."""
        if accept == "walk":
            return walk, None
        return super()._acceptors(accept, walk)

    def verify(self, vb) -> torch.Tensor:
        """Every rank's metadata and heads to rank 0, audited there; then the sharded forward."""
        step, self._verifies = self._verifies, self._verifies + 1
        mine = (RankMeta.of(vb), self.shard.q_heads, self.shard.kv_heads)
        everyone = self.group.gather_objects(mine)
        if everyone is not None:
            metas = [m for m, _, _ in everyone]
            found = audit_ranks(step, metas, self._previous)
            if step == 0:
                found = [f for r, (_, q, kv) in enumerate(everyone)
                         if (f := audit_kv_heads(r, q, kv, kv_heads_read(self.full_cfg, q))) is not None] + found
            self.step_findings = found
            self._previous = metas
        return super().verify(vb)

    def rounds(self):
        for result in super().rounds():
            yield replace(result, rank_findings=tuple(self.step_findings))
            self.step_findings = []


def on_cpu(result: StepResult) -> StepResult:
    """A StepResult that pickles without a device: the verify batch on the CPU."""
    return replace(result, batch=result.batch.to("cpu"))
