"""A port's stages as ddcheck pipeline stages.

`port_pipeline` swaps in the stages the port provides (or those the user
picked), keeps ddcheck's for the rest, and audits the port's metadata as it
flows: every finding lands in the run's AuditLog, which the check drains
after each verify step.


Layer: ports. Imports the engine and below; never faults, check, report, workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from harness.ports.audit import (Finding, audit_acceptance, audit_commit, audit_inputs, audit_layout,
                                 audit_mask, audit_padding_inputs, mask_encoding)
from harness.ports.mask_reading import kernel_mask
from harness.ports.protocol import STAGES, PortAdapter, PortError
from harness.ports.serving_state import ServingState
from harness.engine.pipeline import Pipeline
from harness.engine.ddtree.accept import Acceptance
from harness.engine.ddtree.tree import DraftTree
from harness.engine.ddtree.verify_inputs import AttnMetadata, VerifyBatch
from harness.engine.ddtree.mask import kernel_visible


@dataclass
class AuditLog:
    """Findings of the current step (mutable, one per run)."""

    findings: list[Finding] = field(default_factory=list)
    step: int = 0

    def add(self, found: list[Finding]) -> None:
        self.findings.extend(found)

    def drain(self) -> list[Finding]:
        out, self.findings = self.findings, []
        return out


def draft_topk(draft_logprobs: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter in the ports' language: per-depth top-K.
    draft_logprobs  # [L, vocab] -> topk_logprobs, topk_ids  # [L, K] (K = min(topk, vocab))"""
    k = min(topk, draft_logprobs.shape[-1])
    lp, ids = torch.topk(draft_logprobs.float(), k, dim=-1)
    return lp, ids


@dataclass
class PortStages:
    adapter: PortAdapter
    stages: tuple[str, ...]                 # the port's stages in this run
    log: AuditLog
    reads_prefix_mask: bool = True          # does the run's kernel read the prefix columns

    def __post_init__(self) -> None:
        missing = [s for s in self.stages if s not in self.adapter.conventions.stages]
        if missing:
            raise PortError(f"{self.adapter.conventions.family} provides no {', '.join(missing)} stage "
                            f"(it provides {', '.join(self.adapter.conventions.stages)})")
        if self.adapter.conventions.compile_needs_build and "compile" in self.stages and "build" not in self.stages:
            raise PortError(f"{self.adapter.conventions.family} builds and compiles in one worker call: its compile "
                            "runs only on the trees its own build chose (add build to --port-stages)")

    # -- build ---------------------------------------------------------------------
    def build_tree(self, root: int, draft_logprobs: torch.Tensor, budget: int, topk: int) -> DraftTree:
        lp, ids = draft_topk(draft_logprobs, topk)
        built = self.adapter.build(lp[None], ids[None], [root], budget, draft_logprobs[None].float())
        return built.trees[0]

    # -- compile ---------------------------------------------------------------------
    def build_verify_batch(self, trees, seq_lens, req_pool_indices, req_to_token, out_cache_loc, mask_builder):
        """SGLang's server side (indptrs, kv_indices, slots) around the port's own
        ids, positions and mask."""
        q = trees[0].q_len
        compiled = self.adapter.compile(list(trees), list(seq_lens))
        km = kernel_mask(compiled.mask, q, list(seq_lens))
        bs = len(trees)
        kv_indices = torch.cat([req_to_token[r, :s] for r, s in zip(req_pool_indices, seq_lens)])
        attn = AttnMetadata(
            qo_indptr=torch.arange(0, (bs + 1) * q, q, dtype=torch.int64),
            kv_indptr=torch.cumsum(torch.tensor([0] + list(seq_lens), dtype=torch.int64), 0),
            kv_indices=kv_indices.to(torch.int64), out_cache_loc=out_cache_loc,
            custom_mask=km.custom_mask, mask_indptr=km.mask_indptr, max_len_extend=q)
        ids = compiled.input_ids.reshape(-1).to(torch.int64).cpu()
        pos = compiled.positions.reshape(-1).to(torch.int64).cpu()
        if ids.numel() != bs * q or pos.numel() != bs * q:
            raise PortError(f"{self.adapter.conventions.family}: compile gave {ids.numel()} ids and {pos.numel()} "
                            f"positions for {bs} requests of width {q}")
        vb = VerifyBatch(ids, pos, torch.tensor(seq_lens, dtype=torch.int64),
                         torch.tensor(req_pool_indices, dtype=torch.int64), attn, q,
                         compiled.native.get("verify_input"))   # the port's object: what a serving backend hands SGLang
        self.log.add(audit_layout(self.log.step, compiled.mask.layout, list(seq_lens), km.port_numel,
                                  km.expected_numel))
        return vb

    # -- accept ----------------------------------------------------------------------
    def accept(self, tree: DraftTree, predicts: list[int]) -> Acceptance:
        acc = self.adapter.accept([tree], torch.tensor([predicts], dtype=torch.int64))[0]
        found = getattr(self.adapter, "findings", None)   # a commit the port's accept makes (tree_verify)
        if found:
            self.log.add([replace(f, step=self.log.step, request=-1) for f in found])
            found.clear()
        return acc

    # -- commit ----------------------------------------------------------------------
    def adapter_commit(self, req_pool, kv_pool, req_pool_indices, seq_lens, out_cache_loc, trees, accs):
        """The port's commit on a ServingState; then each accepted row's K/V must
        sit at position prefix + r of its request (the KV audit's rule)."""
        q = trees[0].q_len
        loc = out_cache_loc.reshape(-1).long().cpu()
        before = [(k[loc.to(k.device)].clone(), v[loc.to(v.device)].clone())
                  for k, v in zip(kv_pool.k_buffer, kv_pool.v_buffer)]  # per layer: [bs*q, kv_heads, head_dim]
        state = ServingState.of(req_pool, kv_pool, list(req_pool_indices), list(seq_lens), out_cache_loc)
        result = self.adapter.commit(list(trees), list(accs), state)
        self.log.add(audit_commit(self.log.step, req_pool, kv_pool, list(req_pool_indices), list(seq_lens),
                                  loc, q, accs, before, result.seq_lens, set(state.freed)))
        return list(result.seq_lens)


def audit_step(log: AuditLog, step: int, vb: VerifyBatch, trees: list[DraftTree],
               acceptances: list[Acceptance], predicts: list[list[int]], reads_prefix: bool,
               conventions=None, produced: tuple[str, list[list[bool]]] | None = None) -> None:
    """Mask, inputs and acceptance of one verify step, whoever built them; padding
    inputs against the port's declared convention when its compile ran; produced:
    (backend name, per request and row whether the logits came out finite)."""
    mask, indptr, q = kernel_visible(vb.attn.custom_mask.cpu()), vb.attn.mask_indptr.tolist(), vb.q_len
    encoding = mask_encoding(vb.attn.custom_mask)
    ids, pos = vb.input_ids.tolist(), vb.positions.tolist()
    for b, (tree, prefix) in enumerate(zip(trees, vb.seq_lens.tolist())):
        block = mask[indptr[b]:indptr[b] + q * (prefix + q)].view(q, prefix + q)  # [q_len, prefix+q_len]
        rows = None if produced is None else (produced[0], produced[1][b])
        log.add(audit_mask(step, b, tree, prefix, block, reads_prefix, encoding, rows))
        log.add(audit_inputs(step, b, tree, prefix, ids[b * q:(b + 1) * q], pos[b * q:(b + 1) * q]))
        log.add(audit_acceptance(step, b, tree, predicts[b], acceptances[b]))
        if conventions is not None:
            log.add(audit_padding_inputs(step, b, tree, prefix, ids[b * q:(b + 1) * q], pos[b * q:(b + 1) * q],
                                         conventions.padding_inputs(tree.tokens[0], prefix)))


# the Pipeline fields each port stage stands in for (the port's compile builds the mask itself)
STAGE_FIELDS = {"build": ("build_tree", "tree_builder"), "compile": ("build_mask", "build_verify_batch"),
                "accept": ("accept",), "commit": ("commit", "commit_batch")}


def port_pipeline(base: Pipeline, ps: PortStages) -> Pipeline:
    """`base` with the port's stages swapped in."""
    swaps = {}
    if "build" in ps.stages:   # the port's own tree: whatever heuristics chose it, not checked as DDTree's
        swaps["build_tree"] = ps.build_tree
        swaps["tree_builder"] = None
    if "compile" in ps.stages:
        swaps["build_verify_batch"] = ps.build_verify_batch
    if "accept" in ps.stages:
        swaps["accept"] = ps.accept
    if "commit" in ps.stages:
        swaps["commit_batch"] = ps.adapter_commit
    width = ps.adapter.conventions.q_len if "build" in ps.stages else base.width
    return replace(base, width=width, **swaps)


def parse_stages(text: str | None, provided: tuple[str, ...]) -> tuple[str, ...]:
    """--port-stages build,compile,...; default: every stage the port provides."""
    if not text:
        return provided
    stages = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [s for s in stages if s not in STAGES]
    if bad or not stages:
        raise PortError(f"--port-stages takes a comma list of {', '.join(STAGES)}, got {text!r}")
    return stages
