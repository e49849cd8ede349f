"""`dflash-worker-tree`: lineages whose DFlash worker builds the tree, the
positions and the mask in a worker method (DB-Guo/sglang-ddtree-dev's
`DFlashWorker._ddtree_sample_and_generate_mask`), and accept and commit in
their verify input class (`DFlashVerifyInput.tree_verify`).

Nothing of the port is re-created: the adapter loads the checkout's worker
file with the siblings it imports (harness/ports/port_files.py) and calls the
worker's own method and the verify input's own method, each on the minimum
state it reads:
- the worker method: `self` with `num_draft_tokens` and the two block buffers
  `[bs, q]`; `batch.seq_lens_cpu` (the prefixes); `draft_input.bonus_tokens`
  (the roots); `draft_hidden [bs, L+1, V]` whose rows 1.. are the drafter's
  log-probs; an `lm_head` whose weight is the identity `[V, V]` (so the
  worker's own matmul gives back those log-probs) on a single vocab shard;
  its module's `get_tp_group` answers a group of one rank;
- `tree_verify`: a batch double (requests that never finish, no sampling
  info, no grammar, slots 0.. of an allocator that records frees) and logits
  that are one-hot at the target's argmax; its module's
  `assign_req_to_token_pool_func` (SGLang's Triton kernel) is a CPU twin; off
  CUDA its `verify_tree_greedy_func` (which SGLang 0.5.23 has no path for
  there) is SGLang's own `verify_tree_greedy_triton` under the Triton
  interpreter (harness/ports/tree_verify_run.py). The commit it makes on the
  double (req_to_token, frees, seq_lens) is audited every step.

The worker's verify input object is what the serving backends hand SGLang's
TritonAttnBackend (CompiledVerify.native["verify_input"]).

The worker builds and compiles in one method: its compile runs only on trees
its own build chose (`--port-stages compile` without build is a usage error).
Accepted rows are read back from the slots the port kept, the bonus from what
it returns.


Layer: ports. Imports the engine and below; never faults, check, report, workflows or cli."""
from __future__ import annotations

import ast
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch

from harness.ports.port_files import load_port_files, sibling_imports
from harness.ports.protocol import BuiltTrees, CompiledVerify, Conventions, PortError, PortMask
from harness.ports.registry import Family
from harness.ports.tree_verify_run import (audit_tree_verify_commit, greedy_verify_on_interpreter,
                                             on_cuda)
from harness.ports.worker_lineage import WorkerLineage, checkout_commit
from harness.engine.attn.base import BackendUnavailable
from harness.engine.attn.sglang_triton import prepare_interpreter
from harness.engine.ddtree.accept import Acceptance
from harness.engine.ddtree.tree import DraftTree

IN_CHECKOUT = tuple(f"{d}{name}" for name in ("dflash_worker.py", "dflash_ddtree_worker.py")
                    for d in ("python/sglang/srt/speculative/", "sglang/srt/speculative/", ""))
# the worker method's parameters this adapter knows how to fill
METHOD_PARAMS = ("batch", "draft_input", "draft_hidden", "lm_head")
TREE_LINKS = ("retrieve_next_token", "retrieve_next_sibling")
LINEAGE = "dflash"         # the port's own files: dflash_worker, dflash_info, dflash_utils
MAX_VOCAB = 32768          # the identity head double is [V, V] float32

CONVENTIONS = Conventions(
    family="dflash-worker-tree",
    summary="a DFlash worker that builds tree, positions and mask in its own method and accepts/commits in its "
            "verify input's tree_verify (DB-Guo/sglang-ddtree-dev)",
    budget_counts_root=False,
    topk_rule="K = min(budget, vocab) per depth, chosen inside the worker (the run's --topk is not read)",
    padding="none: the worker's best-first tree fills the budget (a short tree raises in the worker's copy)",
    mask="allow-bool, flat per-request [q, prefix + q] blocks (prefix columns all True)",
    stages=("build", "compile", "accept"),
    functions=("DFlashWorker._ddtree_sample_and_generate_mask", "DFlashVerifyInput.tree_verify"),
    compile_needs_build=True,
)


def _verify_inputs_built(fn: ast.FunctionDef) -> list[tuple[str, set[str]]]:
    """(class name, keywords given a value other than None) of each *VerifyInput the method constructs."""
    out = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("VerifyInput"):
            kws = {k.arg for k in node.keywords
                   if k.arg and not (isinstance(k.value, ast.Constant) and k.value.value is None)}
            out.append((ast.unparse(node.func), kws))
    return out


def find_worker_method(worker_file: Path) -> tuple[str, str, tuple[str, ...]] | str:
    """(class, method, its parameters) of the worker method that builds the tree and mask;
    a one-line reason when there is none this adapter can drive."""
    try:
        tree = ast.parse(worker_file.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError, OSError) as e:
        return f"{worker_file.name} cannot be parsed ({type(e).__name__})"
    near = None     # the closest miss, said when nothing fits
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
            params = tuple(a.arg for a in fn.args.args[1:] + fn.args.kwonlyargs)
            for vi, kws in _verify_inputs_built(fn):
                where = f"{cls.name}.{fn.name}"
                if "custom_mask" in kws and set(TREE_LINKS) <= kws:
                    if not set(METHOD_PARAMS) <= set(params):
                        return (f"{where}({', '.join(params)}) builds the tree, but takes none of the "
                                f"parameters this adapter fills ({', '.join(METHOD_PARAMS)})")
                    return cls.name, fn.name, params
                if "custom_mask" in kws:
                    near = (f"{where} hands {vi} a custom mask but no tree links ({', '.join(TREE_LINKS)}): the "
                            "tree could only be read back from the port's own mask, which is what is under test")
                elif set(TREE_LINKS) <= kws and near is None:
                    near = (f"{where} hands {vi} the tree links but no custom_mask: the mask is built later, "
                            "outside the worker method (by the verify input), which this family does not drive")
    return near or (f"no worker method of {worker_file.name} constructs a *VerifyInput(custom_mask=..., "
                    f"{', '.join(TREE_LINKS)}=...)")


def locate(path: Path) -> Path:
    path = Path(path)
    if path.is_file():
        return path
    for rel in IN_CHECKOUT:
        if (path / rel).is_file():
            return path / rel
    raise PortError(f"{path}: no DFlash worker file ({', '.join(IN_CHECKOUT)})")


def fits(path: Path) -> str | None:
    """None when this family can drive the checkout (parsed only), else why not."""
    try:
        worker = locate(path)
    except PortError as e:
        return str(e)
    found = find_worker_method(worker)
    return found if isinstance(found, str) else None


@contextmanager
def _double(module, name: str, value):
    """The module's global `name` answers `value` inside the block (a server double), restored after."""
    had, before = hasattr(module, name), getattr(module, name, None)
    setattr(module, name, value)
    try:
        yield
    finally:
        if had:
            setattr(module, name, before)
        else:
            delattr(module, name)


def _assign_req_to_token(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, batch_size):
    """CPU twin of SGLang's assign_req_to_token_pool: request i's slots [start, end) take the next
    end - start entries of out_cache_loc."""
    off = 0
    for i in range(int(batch_size)):
        s, e = int(start_offset[i]), int(end_offset[i])
        req_to_token[int(req_pool_indices[i]), s:e] = out_cache_loc[off:off + e - s]
        off += e - s


class _Req:
    """A request that never finishes and has no grammar: what tree_verify reads of one."""

    def __init__(self) -> None:
        self.output_ids: list[int] = []
        self.require_reasoning, self.grammar = False, None
        self.kv_committed_len = self.kv_allocated_len = self.spec_verify_ct = self.spec_num_correct_drafts = 0

    def update_finish_state(self) -> None:
        pass

    def finished(self) -> bool:
        return False

    def update_spec_correct_drafts_histogram(self, n) -> None:
        pass


def read_tree(draft_token: torch.Tensor, positions: torch.Tensor, next_token: torch.Tensor,
              next_sibling: torch.Tensor, q: int) -> DraftTree:
    """One request's tree from the port's own outputs: draft_token, positions  # [q];
    next_token, next_sibling  # [q] first-child / next-sibling links (-1 none)."""
    parents: list[int | None] = [None] + [-1] * (q - 1)
    for node in range(q):
        child = int(next_token[node])
        while child != -1:
            if not 0 < child < q or parents[child] != -1:
                raise PortError(f"dflash-worker-tree: the worker's tree links are not a tree (row {child})")
            parents[child] = node
            child = int(next_sibling[child])
    n = next((i for i in range(1, q) if parents[i] == -1), q)
    depths = [int(p) - int(positions[0]) for p in positions[:n]]
    return DraftTree(tuple(int(t) for t in draft_token[:n]), tuple(parents[:n]), tuple(depths), q_len=q)


class DFlashWorkerTree:
    def __init__(self, path: Path) -> None:
        worker_file = locate(path)
        found = find_worker_method(worker_file)
        if isinstance(found, str):
            raise PortError(f"{worker_file}: dflash-worker-tree does not fit: {found} (see docs/ADAPTERS.md)")
        self.cls_name, self.method_name, _ = found
        try:   # off CUDA, before the port's imports reach triton: SGLang's greedy kernel in tree_verify
            prepare_interpreter()
        except BackendUnavailable:
            pass   # triton came first: tree_verify's greedy kernel says so when it runs
        self.files = load_port_files(worker_file, LINEAGE)
        self.path, self.stubbed = worker_file, self.files.stubbed
        self.worker_mod = self.files[worker_file.stem].module
        cls = getattr(self.worker_mod, self.cls_name, None)
        if cls is None or self.method_name not in vars(cls):
            raise PortError(f"{worker_file}: {self.cls_name}.{self.method_name} is gone once the file runs")
        self.method = vars(cls)[self.method_name]
        self.verify_cls, self.info_mod = self._verify_input_class(worker_file)
        has_accept = self.verify_cls is not None and callable(vars(self.verify_cls).get("tree_verify"))
        self.conventions = replace(
            CONVENTIONS, stages=("build", "compile", "accept") if has_accept else ("build", "compile"),
            functions=(f"{self.cls_name}.{self.method_name}",)
            + ((f"{self.verify_cls.__name__}.tree_verify",) if has_accept else ()))
        self.lineage = WorkerLineage(str(path), checkout_commit(worker_file.parent),
                                     tuple(str(m.path.name) for _, m in self.files.modules))
        self._inputs: dict[tuple, tuple[torch.Tensor, int]] = {}   # tree -> (draft log-probs [L, V], root)
        self._prefix: dict[tuple, int] = {}                          # tree -> the prefix it was compiled at
        self.findings: list = []   # the audit of the commit inside tree_verify, drained by the stages

    def _verify_input_class(self, worker_file: Path):
        """The verify input class the worker imports from its sibling, and that sibling's module."""
        for stem, dotted in sibling_imports(worker_file, LINEAGE).items():
            mod = self.files[stem].module
            for name, obj in vars(mod).items():
                if name.endswith("VerifyInput") and isinstance(obj, type) and obj.__module__ == mod.__name__:
                    return obj, mod
        return None, None

    # -- the worker's method -------------------------------------------------------------------
    def _run_worker(self, logprobs: torch.Tensor, roots: list[int], prefix_lens: list[int], q: int):
        """logprobs  # [bs, L, V] the drafter's per-depth log-probs -> the port's verify input."""
        bs, _, vocab = logprobs.shape
        if vocab > MAX_VOCAB:
            raise PortError(f"dflash-worker-tree: vocab {vocab} > {MAX_VOCAB}: the identity head double is [V, V]")
        worker = SimpleNamespace(num_draft_tokens=q, _draft_block_tokens_buf=torch.zeros(bs, q, dtype=torch.long),
                                 _draft_block_positions_buf=torch.zeros(bs, q, dtype=torch.long))
        hidden = torch.cat([torch.zeros(bs, 1, vocab), logprobs.float()], dim=1)   # [bs, L+1, V]
        head = SimpleNamespace(weight=torch.eye(vocab), shard_indices=SimpleNamespace(
            num_org_elements=vocab, org_vocab_start_index=0, num_added_elements=0))
        batch = SimpleNamespace(seq_lens_cpu=torch.tensor(prefix_lens, dtype=torch.int64),
                                seq_lens=torch.tensor(prefix_lens, dtype=torch.int64), batch_size=lambda: bs)
        draft_input = SimpleNamespace(bonus_tokens=torch.tensor(roots, dtype=torch.long))
        with self.lineage.recording(), _double(self.worker_mod, "get_tp_group", lambda: SimpleNamespace(world_size=1)):
            return self.method(worker, batch=batch, draft_input=draft_input, draft_hidden=hidden, lm_head=head)

    def _trees(self, vi, bs: int, q: int) -> list[DraftTree]:
        links = [getattr(vi, k, None) for k in TREE_LINKS]
        if any(t is None for t in links):
            raise PortError(f"dflash-worker-tree: the worker's verify input has no {', '.join(TREE_LINKS)}")
        ids, pos = vi.draft_token.view(bs, q), vi.positions.view(bs, q)
        nxt, sib = (t.view(bs, q) for t in links)
        return [read_tree(ids[b], pos[b], nxt[b], sib[b], q) for b in range(bs)]

    # -- stages --------------------------------------------------------------------------------
    def build(self, topk_logprobs, topk_ids, roots, budget, draft_logprobs=None) -> BuiltTrees:
        if draft_logprobs is None:   # the worker reads whole logits: the top-K, -inf elsewhere
            draft_logprobs = torch.full((*topk_ids.shape[:2], int(topk_ids.max()) + 1), float("-inf"))
            draft_logprobs.scatter_(-1, topk_ids.long(), topk_logprobs.float())
        q = self.conventions.q_len(budget)
        vi = self._run_worker(draft_logprobs, list(roots), [0] * len(roots), q)
        trees = self._trees(vi, len(roots), q)
        for b, t in enumerate(trees):
            self._inputs[_key(t)] = (draft_logprobs[b], int(roots[b]))
        return BuiltTrees(tuple(trees), native={"verify_input": vi})

    def _rerun(self, trees, prefix_lens):
        missing = [i for i, t in enumerate(trees) if _key(t) not in self._inputs]
        if missing:
            raise PortError("dflash-worker-tree: the worker builds and compiles in one method; its compile runs "
                            "only on a tree its own build chose (add build to --port-stages)")
        inputs = [self._inputs[_key(t)] for t in trees]
        q = trees[0].q_len
        vi = self._run_worker(torch.stack([lp for lp, _ in inputs]), [r for _, r in inputs], list(prefix_lens), q)
        again = self._trees(vi, len(trees), q)
        if [_key(t) for t in again] != [_key(t) for t in trees]:
            raise PortError("dflash-worker-tree: the worker built another tree from the same drafts "
                            "(its build is not deterministic)")
        return vi

    def compile(self, trees, prefix_lens) -> CompiledVerify:
        vi = self._rerun(list(trees), list(prefix_lens))
        for t, p in zip(trees, prefix_lens):
            self._prefix[_key(t)] = int(p)
        return CompiledVerify(vi.draft_token.reshape(-1), vi.positions.reshape(-1),
                              PortMask(vi.custom_mask, "flat"), native={"verify_input": vi})

    def accept(self, trees, target_argmax) -> list[Acceptance]:
        """target_argmax  # [bs, q] -> the port's tree_verify on one-hot logits."""
        trees = list(trees)
        prefix = [self._prefix.get(_key(t), 0) for t in trees]
        vi = self._rerun(trees, prefix)
        bs, q = len(trees), trees[0].q_len
        vocab = self._inputs[_key(trees[0])][0].shape[-1]
        batch = _verify_batch(bs, q, prefix)
        logits = SimpleNamespace(
            next_token_logits=torch.nn.functional.one_hot(target_argmax.reshape(-1).long(), vocab).float(),
            hidden_states=torch.zeros(bs * q, 1))                               # [bs*q, V], [bs*q, 1]
        greedy = {} if on_cuda() else {"verify_tree_greedy_func": greedy_verify_on_interpreter}
        with self.lineage.recording(), _doubles(self.info_mod, assign_req_to_token_pool_func=_assign_req_to_token,
                                                **greedy):
            bonus, commit_lens = vi.tree_verify(batch=batch, logits_output=logits, page_size=1)[:2]
        kept, out, off = batch.out_cache_loc.tolist(), [], 0
        for b, n in enumerate(int(n) for n in commit_lens):
            out.append(Acceptance(tuple(int(s) - b * q for s in kept[off:off + n]), int(bonus[b])))
            off += n
        self.findings += audit_tree_verify_commit(0, batch.req_to_token_pool.req_to_token, prefix,
                                                  batch.seq_lens, q, out, batch.token_to_kv_pool_allocator.freed)
        return out


@contextmanager
def _doubles(module, **values):
    """Several module globals doubled at once (see _double)."""
    if not values:
        yield
        return
    name, value = next(iter(values.items()))
    rest = {k: v for k, v in values.items() if k != name}
    with _double(module, name, value), _doubles(module, **rest):
        yield


def _verify_batch(bs: int, q: int, prefix: list[int]) -> SimpleNamespace:
    freed: list[int] = []
    return SimpleNamespace(
        forward_mode=SimpleNamespace(is_idle=lambda: False), sampling_info=None, batch_size=lambda: bs,
        device="cpu", reqs=[_Req() for _ in range(bs)], model_config=SimpleNamespace(think_end_id=None),
        token_to_kv_pool_allocator=SimpleNamespace(free=lambda slots: freed.extend(slots.tolist()), freed=freed),
        out_cache_loc=torch.arange(bs * q), req_pool_indices=torch.arange(bs),
        req_to_token_pool=SimpleNamespace(req_to_token=torch.full((bs, max(prefix) + q + 1), -1, dtype=torch.long)),
        seq_lens=torch.tensor(prefix, dtype=torch.int64), seq_lens_cpu=torch.tensor(prefix, dtype=torch.int64),
        seq_lens_sum=sum(prefix))


def _key(t: DraftTree) -> tuple:
    return (t.tokens, t.parents, t.q_len)


FAMILY = Family("dflash-worker-tree", lambda path: DFlashWorkerTree(path), describe=lambda: CONVENTIONS, fits=fits)
