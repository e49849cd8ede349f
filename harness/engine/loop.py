"""The engine loop: prefill, then per round draft, build tree, verify
inputs, verify, accept, commit. It yields what each round did and leaves
comparison, timing and tracing to its caller.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch

from ddschema import ModelConfig
from harness.engine.attn.base import AttentionBackend, ServerBatch, ServingPool, ServingSession, serving_of
from harness.engine.mem.paged import pool_slots
from harness.engine.mem.pool import KVPool, ReqToTokenPool
from harness.engine.mem.provenance import BATCH_PADDING, ProvenanceFinding
from harness.engine.model.llama import LlamaModel
from harness.engine.graph import GraphOptions, GraphRunner
from harness.engine.serving_graph import ServingGraphRunner
from harness.engine.pipeline import Pipeline
from harness.engine.round_stages import choose_accept, choose_row_slots, choose_window
from harness.engine.settings import NotRunnableHere, PromptSpec, RunSettings, UsageError
from harness.engine.ddtree.accept import Acceptance, cut_at_stop
from harness.engine.ddtree.accept_sglang import pick_acceptors
from harness.engine.ddtree.drafter import make_drafter
from harness.engine.ddtree.tree import DraftTree
from harness.engine.ddtree.verify_inputs import VerifyBatch


@dataclass
class Request:
    """Live state of one request (engine-internal, mutable)."""

    rid: int
    prompt: list[int]
    spec: PromptSpec
    req_pool_idx: int
    seq_len: int = 0                                   # committed (cached) positions
    finished: bool = False
    emitted: list[int] = field(default_factory=list)  # generated tokens; the last is the next root
    continuation: list[int] = field(default_factory=list)  # target's greedy, for the drafter

    def committed_tokens(self) -> list[int]:
        """Token ids at cache positions 0..seq_len-1."""
        return self.prompt + self.emitted[:-1]


@dataclass(frozen=True)
class RequestStep:
    """What one verify round did for one request."""

    step: int
    rid: int
    prefix: tuple[int, ...]     # committed token ids before this round
    tree: DraftTree
    logits: torch.Tensor        # [q_len, vocab] float32 on CPU, every verify row
    row_slots: tuple[int, ...]  # [q_len] out_cache_loc of the rows
    acceptance: Acceptance
    cross_check: Acceptance | None = None  # the other acceptor's answer (None: SGLang absent)
    draft_logprobs: torch.Tensor | None = None  # [L, vocab] the drafts the tree was built from (None: unknown)
    # the verify rows' routing in the MoE layers: (experts [q_len, L, k] sorted, gap [q_len, L]) (None: no MoE)
    routing: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(frozen=True)
class StepResult:
    step: int
    requests: tuple[RequestStep, ...]
    batch: VerifyBatch
    provenance: tuple[ProvenanceFinding, ...] = ()  # the KV canary's findings on this round's reads and writes
    rank_findings: tuple = ()   # tensor parallelism: where a rank's metadata or shard disagrees (engine/tp/audit.py)


def request_routing(routing: list | None, b: int, q: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Request b's rows of one forward's per-layer routings: (experts [q, L, k], gap [q, L]), None without any."""
    if not routing:
        return None
    rows = slice(b * q, (b + 1) * q)
    return (torch.stack([r.experts[rows].cpu() for r in routing], 1),
            torch.stack([r.gap[rows].cpu() for r in routing], 1))


class Engine:
    def __init__(self, settings: RunSettings, cfg: ModelConfig, weights: dict[str, torch.Tensor],
                 backend: AttentionBackend, prompts: list[PromptSpec], prompt_ids: list[list[int]],
                 pipeline: Pipeline = Pipeline()):
        self.s, self.cfg, self._pipeline = settings, cfg, pipeline
        self.kernel = backend   # the backend as made; the verify runs through the pipeline's wrapping of it
        if cfg.mla is not None and not getattr(backend, "runs_mla", False):
            raise NotRunnableHere(f"--backend {settings.backend} does not run multi-head latent attention (K and V "
                                  "of different widths over a latent pool): use --backend torch or sglang-triton")
        self.backend = pipeline.attention(backend) if pipeline.attention is not None else backend
        dev, q_len = settings.device, pipeline.width(settings.budget)
        self.q_len = q_len
        self.model = self._build_model(cfg, weights)
        self.max_context = max(map(len, prompt_ids)) + settings.max_new_tokens + q_len + 2
        if self.max_context > cfg.max_position:
            raise UsageError(f"prompts + --max-new-tokens + q_len need {self.max_context} positions; "
                             f"the model has {cfg.max_position}")
        num_slots = pool_slots(len(prompts), self.max_context, q_len, settings.page_size)
        self.pool = KVPool(cfg, num_slots, settings.torch_dtype, dev, poison=settings.kv_poison,
                           page_size=settings.page_size)
        self.finish_findings: list[ProvenanceFinding] = []  # committed slots already free when a request retired
        self.req_pool = ReqToTokenPool(len(prompts) + 1, self.max_context, dev)
        # settings.accept drives the run; the other acceptor is cross-checked every step
        self.accept, self.cross_accept = self._acceptors(settings.accept, pipeline.accept)
        self._choose_stages()
        self.drafter = make_drafter(settings.drafter_config(cfg.num_layers), self.model, settings.seed)
        self.requests = [Request(i, ids, spec, self.req_pool.alloc())
                         for i, (spec, ids) in enumerate(zip(prompts, prompt_ids))]
        # SGLang's own backend, handed whole batches: this engine's session of it (None: per-layer metadata)
        self.serving = self._bind_serving(serving_of(backend), len(prompts))
        self.served_meta = None   # the metadata the serving backend built for the last served forward
        self.graph = self._graph_runner(len(prompts)) if settings.cuda_graph else None
        self._graph_routing: dict[int, list] = {}   # bucket -> its capture's routing tensors (_round_routing)

    def _build_model(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> LlamaModel:
        """The target model (a tensor-parallel rank builds its shard instead: harness/engine/tp)."""
        return LlamaModel(cfg, weights, self.s.torch_dtype, self.s.device, self._pipeline.model_stages)

    def _acceptors(self, accept: str, walk):
        """(the acceptor that drives the run, the one cross-checked against it, or None)."""
        return pick_acceptors(accept, walk)

    def _bind_serving(self, backend, max_bs: int) -> ServingSession | None:
        if backend is None:
            return None
        s = self.s
        if s.page_size != 1 or self.cfg.sliding_window is not None:
            raise NotRunnableHere(f"--backend {s.backend} runs SGLang's own metadata over a token-slot pool "
                                  "without a sliding window: use --page-size 1 and a model without one")
        if self._pipeline.graph != GraphOptions():
            raise UsageError(f"a graph fault needs ddcheck's own graph runner; --backend {s.backend} runs SGLang's "
                             "own graph state")
        layers = tuple(self.model.layer_attn)
        return backend.bind(ServingPool(self.pool.k_buffer, self.pool.v_buffer, self.req_pool.req_to_token,
                                        self.cfg.num_heads, layers, self.q_len, 2 * max_bs))

    def _graph_runner(self, max_bs: int):
        """ddcheck's graph runner, or SGLang's own graph state for a serving backend."""
        if self.serving is not None:
            return ServingGraphRunner(self._verify_forward, self.serving, self.q_len, max_bs, self.s.device,
                                      self.s.topk)
        return GraphRunner(self._verify_forward, self.q_len, max_bs, self.max_context, self.req_pool.req_to_token,
                           self.s.device, self._pipeline.graph)

    # -- stages ---------------------------------------------------------------
    @property
    def pipeline(self) -> Pipeline:
        return self._pipeline

    @pipeline.setter
    def pipeline(self, pipeline: Pipeline) -> None:
        """A pipeline swapped in after the build (a test's or a study's planted stage) brings its stages."""
        self._pipeline = pipeline
        self.model.stages = pipeline.model_stages
        self._choose_stages()

    def _choose_stages(self) -> None:
        """The round's variable parts, chosen once per pipeline (harness/engine/round_stages.py)."""
        p, q = self._pipeline, self.q_len
        self.rows = choose_row_slots(p, self.pool, self.req_pool, q, self.s.device, self.s.page_size)
        self.fold_window = choose_window(p, self.cfg.sliding_window)
        self.accept_request = choose_accept(self.accept, p, q)

    def _verify_forward(self, input_ids, positions, meta) -> torch.Tensor:
        return self.model.forward(input_ids, positions, meta, self.pool, self.backend)

    def _served_forward(self, batch: ServerBatch, meta) -> torch.Tensor:
        """The model over `batch`; a serving backend gets the batch whole first and builds its own metadata."""
        if self.serving is None:
            return self._verify_forward(batch.input_ids, batch.positions, meta)
        with self.serving.served(batch) as served_meta:
            self.served_meta = served_meta   # what SGLang built: the canary checks the reads it made
            return self._verify_forward(batch.input_ids, batch.positions, served_meta)

    def prefill(self) -> None:
        """Causal extend of every prompt; the last logits give the first root."""
        lens = [len(r.prompt) for r in self.requests]
        # page size > 1: each prompt on pages of its own (alloc takes fresh pages)
        loc = torch.cat([self.pool.allocator.alloc(n) for n in lens] if self.s.page_size > 1
                        else [self.pool.allocator.alloc(sum(lens))]).to(self.s.device)
        ids = torch.tensor([t for r in self.requests for t in r.prompt], device=self.s.device)
        pos = torch.cat([torch.arange(n) for n in lens]).to(self.s.device)
        meta = self._pipeline.prefill_metadata(lens, loc).to(self.s.device)
        zeros = torch.zeros(len(lens), dtype=torch.int64, device=self.s.device)
        batch = ServerBatch("extend", ids, pos, torch.tensor([r.req_pool_idx for r in self.requests],
                                                             device=self.s.device), zeros, tuple(lens), loc)
        logits = self._served_forward(batch, meta)
        owners = torch.cat([torch.full((n,), r.rid) for r, n in zip(self.requests, lens)])
        self.pool.provenance.stamp(loc.cpu(), owners, pos.cpu(), ids.cpu())
        ends = torch.cumsum(torch.tensor(lens), 0) - 1
        for r, n, end, start in zip(self.requests, lens, ends.tolist(), (ends - torch.tensor(lens) + 1).tolist()):
            self.req_pool.req_to_token[r.req_pool_idx, :n] = loc[start:start + n]
            r.seq_len = n
            r.emitted = [int(logits[end].argmax())]
            r.continuation = self._greedy_continuation(r)

    def _greedy_continuation(self, r: Request) -> list[int]:
        """The target's own greedy stream (what a perfect drafter would say),
        from the same weights through the plain torch backend: the drafter is
        not under test, so a broken backend cannot also break the drafts."""
        from harness.engine.dense import dense_greedy
        return dense_greedy(self.model, r.prompt, self.s.max_new_tokens + self.s.block_size)

    def verify(self, vb: VerifyBatch) -> torch.Tensor:
        if self.graph is not None:
            return self.graph.verify(vb)
        batch = ServerBatch("target-verify", vb.input_ids, vb.positions, vb.req_pool_indices.to(vb.input_ids.device),
                            vb.seq_lens.to(vb.input_ids.device), (vb.q_len,) * vb.seq_lens.numel(),
                            vb.attn.out_cache_loc, vb.attn.custom_mask, self.s.topk, vb.spec_info)
        return self._served_forward(batch, vb.attn)

    # -- the loop -------------------------------------------------------------
    def rounds(self) -> Iterator[StepResult]:
        self.prefill()
        step = 0
        while active := self._retire_finished():
            yield self._round(step, active)
            step += 1

    def _retire_finished(self) -> list[Request]:
        """Free the memory of requests that have all their tokens or emitted the
        end-of-sequence token; return the rest."""
        for r in self.requests:
            stopped = self.s.eos_id is not None and self.s.eos_id in r.emitted
            if not r.finished and (len(r.emitted) >= self.s.max_new_tokens or stopped):
                self._finish(r)
        return [r for r in self.requests if not r.finished]

    def _round(self, step: int, active: list[Request]) -> StepResult:
        """Draft, build trees, place rows, verify inputs, verify, accept, commit."""
        s, p, q = self.s, self.pipeline, self.q_len
        drafts = [self.drafter.propose(r, step) for r in active]
        trees = [p.build_tree(r.emitted[-1], lp, s.budget, s.topk) for r, lp in zip(active, drafts)]
        if any(t.q_len != q for t in trees):
            raise ValueError(f"the tree stage built widths {sorted({t.q_len for t in trees})}; the run's verify "
                             f"width is {q}")
        rows = self.rows.place(active, trees)
        vb = p.build_verify_batch(trees, [r.seq_len for r in active], [r.req_pool_idx for r in active],
                                  self.req_pool.req_to_token, rows.loc, p.build_mask)
        vb = self.fold_window(vb).to(s.device)
        self.model.routing_out = [] if self.cfg.moe is not None else None
        logits = self.verify(vb).float().cpu()  # [bs*q_len, vocab]
        routing = self._round_routing(self.model.routing_out)
        self.model.routing_out = None
        findings = self._canary(step, active, vb)
        predicts = logits.argmax(-1).tolist()   # [bs*q_len]
        loc = rows.loc.tolist()
        out = []
        for b, (r, tree) in enumerate(zip(active, trees)):
            acc = p.stop(tree, self.accept_request(tree, predicts, b, trees), s.eos_id)
            cross = self.cross_accept(tree, predicts[b * q:(b + 1) * q]) if self.cross_accept else None
            cross = cut_at_stop(tree, cross, s.eos_id) if cross is not None else None
            out.append(RequestStep(step, r.rid, tuple(r.committed_tokens()), tree, logits[b * q:(b + 1) * q],
                                   tuple(loc[b * q:(b + 1) * q]), acc, cross, drafts[b],
                                   request_routing(routing, b, q)))
        self.rows.commit(active, trees, [rs.acceptance for rs in out], rows)
        for r, tree, rs in zip(active, trees, out):
            r.emitted += [tree.tokens[i] for i in rs.acceptance.rows[1:]] + [rs.acceptance.bonus]
        return StepResult(step, tuple(out), vb, tuple(findings))

    def _round_routing(self, recorded: list | None) -> list | None:
        """The verify forward's per-layer routings: the last forward's (eager, or a graph replayed on the CPU by
        running it); a CUDA graph's replay runs no Python, so its bucket's captured routing tensors, which the
        replay rewrites in the graph's memory, are kept at capture and read back."""
        if recorded is None:
            return None
        layers = sum(self.cfg.moe.is_moe_layer(i) for i in range(self.cfg.num_layers))
        bucket = self.graph.last.bucket if self.graph is not None and self.graph.last is not None else None
        if len(recorded) >= layers:
            recorded = recorded[-layers:]
            if bucket is not None:
                self._graph_routing[bucket] = recorded
            return recorded
        return self._graph_routing.get(bucket)

    def _canary(self, step: int, active: list[Request], vb: VerifyBatch) -> list[ProvenanceFinding]:
        """What the kernel wrote and read this round (a graph replay's static
        buffers, batch padding included) against each slot's provenance."""
        prov, q = self.pool.provenance, self.q_len
        replay = self.graph.last if self.graph is not None else None
        meta = replay.meta if replay is not None else (self.served_meta or vb.attn)
        ids = (replay.input_ids if replay is not None else vb.input_ids).cpu()      # [rows]
        pos = (replay.positions if replay is not None else vb.positions).cpu()      # [rows]
        loc = meta.out_cache_loc.cpu()                                               # [rows]
        owners = torch.full((loc.numel(),), BATCH_PADDING, dtype=torch.int64)
        for b, r in enumerate(active):
            owners[b * q:(b + 1) * q] = r.rid
        r2t = self.req_pool.req_to_token.cpu()
        committed = {int(sl): (r.rid, j) for r in self.requests if not r.finished
                     for j, sl in enumerate(r2t[r.req_pool_idx, :r.seq_len].tolist())}
        owned = frozenset(self.pool.allocator.owned)   # the allocator's slots as a set: its own raise if not one
        found = prov.check_writes(step, loc, owners, pos, owned, committed)
        prov.stamp(loc, owners, pos, ids)
        kvp, kv = meta.kv_indptr.tolist(), meta.kv_indices.cpu()
        for b, r in enumerate(active):
            found += prov.check_reads(step, r.rid, kv[kvp[b]:kvp[b + 1]], r.committed_tokens())
        return found

    def _finish(self, r: Request) -> None:
        del r.emitted[self.s.max_new_tokens:]
        slots = self.req_pool.req_to_token[r.req_pool_idx, :r.seq_len].cpu()
        owned = self.pool.allocator.owned
        held = torch.tensor([s in owned for s in slots.tolist()], dtype=torch.bool)
        if not bool(held.all()):  # a commit freed slots the request still points at: report, free the rest
            j = int((~held).nonzero()[0])
            self.finish_findings.append(ProvenanceFinding(
                -1, r.rid, "freed-committed", int(slots[j]), j, f"request {r.rid} retires with {int((~held).sum())} "
                f"committed positions (first {j}) on KV slots already free (first {int(slots[j])})"))
        self.pool.allocator.free(slots[held])
        self.req_pool.free(r.req_pool_idx)
        r.finished = True

