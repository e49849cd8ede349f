"""What a port's `tree_verify` (accept and commit in one verify-input method) needs
to run off CUDA, and the audit of the commit it makes.

SGLang 0.5.23's `verify_tree_greedy_func` dispatches by platform: CUDA/HIP/MUSA/NPU
kernels, `sgl_kernel`'s CPU op, or the XPU path, which is SGLang's own Triton kernel
`verify_tree_greedy_triton`. On a machine with none of these it raises (no
out-of-tree path). `greedy_verify_on_interpreter` is that same Triton kernel of
SGLang's, run under the Triton interpreter: SGLang's code, not a re-creation, so
the port's own `tree_verify` runs end to end here.

The commit inside `tree_verify` runs on a batch double (slots 0.. of the verify
rows, a req_to_token of its own, an allocator that records frees);
`audit_tree_verify_commit` holds what it left there to the commit's rules.


Layer: ports. Imports the engine and below; never faults, check, report, workflows or cli."""
from __future__ import annotations

import torch

from harness.engine.attn.base import BackendUnavailable
from harness.engine.ddtree.accept import Acceptance
from harness.engine.ddtree.accept_sglang import import_verify_tree_greedy
from harness.ports.audit import Finding
from harness.ports.protocol import PortError


def on_cuda() -> bool:
    return torch.cuda.is_available()


def greedy_verify_on_interpreter(predicts, accept_index, accept_token_num, candidates, retrieve_index,
                                 retrieve_next_token, retrieve_next_sibling, target_predict, topk: int = -1):
    """SGLang's verify_tree_greedy_func signature, run by SGLang's verify_tree_greedy_triton under the
    Triton interpreter (off CUDA). Returns (predicts, accept_index, accept_token_num), as SGLang's."""
    try:
        verify_tree_greedy_triton = import_verify_tree_greedy()
    except BackendUnavailable as e:
        raise PortError(f"the port's tree_verify needs SGLang's verify_tree_greedy kernel: {e}") from None
    verify_tree_greedy_triton(predicts=predicts, accept_index=accept_index, accept_token_num=accept_token_num,
                              candidates=candidates, retrieve_index=retrieve_index,
                              retrieve_next_token=retrieve_next_token, retrieve_next_sibling=retrieve_next_sibling,
                              target_predict=target_predict)
    return predicts, accept_index, accept_token_num


def audit_tree_verify_commit(step: int, req_to_token: torch.Tensor, prefix: list[int], seq_lens_after,
                             q: int, accs: list[Acceptance], freed: list[int]) -> list[Finding]:
    """After the port's tree_verify on the batch double (request b in req_to_token row b, its verify
    rows in slots b*q .. b*q + q-1): positions prefix_b + r point at accepted row r's slot, the
    length grew by the accepted rows (when the port moves seq_lens at all; some leave it to their
    caller), every other verify slot was freed and no kept one."""
    out: list[Finding] = []
    if seq_lens_after is not None and [int(x) for x in seq_lens_after] == list(prefix):
        seq_lens_after = None   # untouched: the worker's caller advances it
    kept_all: set[int] = set()
    for b, (p, acc) in enumerate(zip(prefix, accs)):
        n = len(acc.rows)
        want = [b * q + row for row in acc.rows]
        kept_all.update(want)
        got = req_to_token[b, p:p + n].tolist()
        if got != want:
            r = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
            out.append(Finding("commit-slot", "error", step, b,
                               f"the port's tree_verify pointed position {p + r} at slot {got[r]}; accepted row "
                               f"{acc.rows[r]} sits in slot {want[r]} ({n} accepted rows, req_to_token "
                               f"{p}..{p + n - 1} = {got}, expected {want})", tuple(acc.rows)))
        if seq_lens_after is not None and int(seq_lens_after[b]) != p + n:
            out.append(Finding("commit-length", "error", step, b,
                               f"the port's tree_verify left seq_len {int(seq_lens_after[b])}; expected prefix "
                               f"{p} + {n} accepted rows"))
    rows = set(range(len(accs) * q))
    freed_kept = sorted(kept_all & set(freed))
    if freed_kept:
        out.append(Finding("commit-slot", "error", step, -1,
                           f"the port's tree_verify freed slots {freed_kept[:8]} that hold accepted rows"))
    leaked = sorted(rows - kept_all - set(freed))
    if leaked:
        out.append(Finding("slot-leak", "warning", step, -1,
                           f"the port's tree_verify neither kept nor freed verify slots {leaked[:8]} (a KV leak)"))
    return out
