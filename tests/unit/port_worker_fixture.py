"""A fake SGLang checkout shaped like a DFlash worker lineage that builds its tree and mask
in a worker method and accepts in its verify input class (our own code, written per test).

`write_checkout(root, **variants)`: each variant replaces one line of the clean port with a
known defect. The tree: a greedy chain over the first min(budget, L) depths, then the
depth-1 runners-up as root children."""
from __future__ import annotations

from pathlib import Path

SPEC = Path("python/sglang/srt/speculative")

UTILS = '''
import torch


def build_tree_one_req(top_ids, top_lp, budget):
    """top_ids, top_lp  # [L, K] -> tokens [budget], depths [budget], visibility [n, n], links [n]"""
    depth_limit = top_ids.shape[0]
    tokens, depths, parents = [], [], [-1]
    for d in range(min(budget, depth_limit)):
        tokens.append(int(top_ids[d, 0]))
        depths.append(d + 1)
        parents.append(d)
    rank = 1
    while len(tokens) < budget:
        tokens.append(int(top_ids[0, rank]))
        depths.append(1)
        parents.append(0)
        rank += 1
    n = budget + 1
    vis = torch.zeros(n, n, dtype=torch.bool)
    nxt = torch.full((n,), -1, dtype=torch.long)
    sib = torch.full((n,), -1, dtype=torch.long)
    for i in range(n):
        p = parents[i]
        if p >= 0:
            vis[i] = vis[p]
            if nxt[p] == -1:
                nxt[p] = i
            else:
                c = int(nxt[p])
                while sib[c] != -1:
                    c = int(sib[c])
                sib[c] = i
        vis[i, i] = True
    return torch.tensor(tokens), torch.tensor(depths), vis, nxt, sib
'''

INFO = '''
from dataclasses import dataclass

import torch


def assign_req_to_token_pool_func(*args, **kwargs):
    raise RuntimeError("stands for SGLang's Triton kernel: needs CUDA")


@dataclass
class DFlashVerifyInput:
    draft_token: torch.Tensor
    positions: torch.Tensor
    draft_token_num: int
    custom_mask: torch.Tensor = None
    retrieve_next_token: torch.Tensor = None
    retrieve_next_sibling: torch.Tensor = None

    def tree_verify(self, *, batch, logits_output, page_size):
        bs, q = batch.batch_size(), self.draft_token_num
        target = torch.argmax(logits_output.next_token_logits, dim=-1).view(bs, q)
        cand = self.draft_token.view(bs, q)
        keep, lens, bonus = [], [], []
        for b in range(bs):
            node, rows = 0, [0]
            while True:
                child = int(self.retrieve_next_token[b, node])
                while child != -1 and int(cand[b, child]) != int(target[b, node]):
                    child = int(self.retrieve_next_sibling[b, child])
                if child == -1:
                    break
                rows.append(child)
                node = child
            keep += [b * q + r for r in rows]
            lens.append(len(rows))
            bonus.append(int(target[b, node]))
        kept = torch.tensor(keep)
        evict = torch.ones(bs * q, dtype=torch.bool)
        evict[kept] = False
        batch.token_to_kv_pool_allocator.free(batch.out_cache_loc[evict])
        batch.out_cache_loc = batch.out_cache_loc[kept]
        end = batch.seq_lens + torch.tensor(lens)
        assign_req_to_token_pool_func(batch.req_pool_indices, batch.req_to_token_pool.req_to_token,
                                      batch.seq_lens, end, batch.out_cache_loc, bs)
        return torch.tensor(bonus), torch.tensor(lens), None, [n - 1 for n in lens]
'''

WORKER = '''
import torch

from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from sglang.srt.speculative.dflash_utils import build_tree_one_req


def get_tp_group():
    raise RuntimeError("no process group outside a server")


class DFlashWorker:
    def _tree_and_mask(self, batch, draft_input, draft_hidden, lm_head):
        if get_tp_group().world_size != 1:
            raise NotImplementedError("one rank only")
        logits = draft_hidden[:, 1:, :] @ lm_head.weight.T
        lp = torch.log_softmax(logits.float(), dim=-1)
        top_lp, top_ids = torch.topk(lp, min(self.num_draft_tokens - 1, lp.shape[-1]), dim=-1)
        bs, q = draft_hidden.shape[0], self.num_draft_tokens
        ids, pos = self._draft_block_tokens_buf[:bs], self._draft_block_positions_buf[:bs]
        nxt_all = torch.full((bs, q), -1, dtype=torch.long)
        sib_all = nxt_all.clone()
        blocks = []
        for b in range(bs):
            tok, dep, vis, nxt, sib = build_tree_one_req(top_ids[b], top_lp[b], q - 1)
            start = int(batch.seq_lens_cpu[b])
            ids[b, 0] = draft_input.bonus_tokens[b]
            ids[b, 1:] = tok
            pos[b, 0] = start
            pos[b, 1:] = dep + start
            mask = torch.ones(q, start + q, dtype=torch.bool)
            mask[:, start:] = vis
            blocks.append(mask.flatten())
            nxt_all[b], sib_all[b] = nxt, sib
        custom_mask = torch.cat(blocks)
        return DFlashVerifyInput(draft_token=ids.reshape(-1), positions=pos.reshape(-1), draft_token_num=q,
                                 custom_mask=custom_mask, retrieve_next_token=nxt_all, retrieve_next_sibling=sib_all)
'''

# one line of the clean port -> the defect (file, old, new)
VARIANTS = {
    # an additive bf16 mask (0.0 visible, the dtype's minimum hidden) handed over raw
    "additive_mask": ("worker", "        custom_mask = torch.cat(blocks)\n",
                      "        custom_mask = torch.where(torch.cat(blocks), 0.0, torch.finfo(torch.bfloat16).min)"
                      ".to(torch.bfloat16)\n"),
    # the accept compares the target's prediction with itself: every first child is accepted
    "self_compare": ("info", "int(cand[b, child]) != int(target[b, node])", "int(cand[b, child]) != int(cand[b, child])"),
    # a variable its code reads is gone under the installed SGLang
    "raises": ("info", "        bs, q = batch.batch_size(), self.draft_token_num\n",
               "        import os\n        os.environ['SGLANG_DDTREE_GONE_VARIABLE']\n"),
    # the a34ac5338 shape: a mask but no tree links
    "no_links": ("worker", ", retrieve_next_token=nxt_all, retrieve_next_sibling=sib_all)", ")"),
    # the SyJarvis shape: tree links handed over, the mask built later by the verify input
    "mask_later": ("worker", "custom_mask=custom_mask, ", ""),
    # a method the adapter cannot call: other parameters
    "other_params": ("worker", "def _tree_and_mask(self, batch, draft_input, draft_hidden, lm_head):",
                     "def _tree_and_mask(self, *, draft_hidden, start_positions, block_ids, lm_head):\n"
                     "        batch = draft_input = None"),
    # DB-Guo's shape: the verify input is an SGLang SpecInput of type DFLASH_VERIFY (the installed SGLang's
    # base class; its width, num_tokens_per_req, left to the server), so a serving backend hands SGLang this
    # object itself
    "spec_input": ("info", "@dataclass\nclass DFlashVerifyInput:\n",
                   "from sglang.srt.speculative.spec_info import SpecInput, SpecInputType\n\n\n"
                   "@dataclass\nclass DFlashVerifyInput(SpecInput):\n"
                   "    def __post_init__(self):\n"
                   "        super().__init__(spec_input_type=SpecInputType.DFLASH_VERIFY)\n\n"),
    # (after spec_input) the verify input names a width one row short of its tree: SGLang serves that width
    "short_width": ("info", "        super().__init__(spec_input_type=SpecInputType.DFLASH_VERIFY)\n",
                    "        super().__init__(spec_input_type=SpecInputType.DFLASH_VERIFY)\n"
                    "        self.num_tokens_per_req = int(self.draft_token_num) - 1\n"),
    # the greedy walk through SGLang's verify_tree_greedy_func (as DB-Guo's tree_verify calls it)
    "sglang_greedy": [("info", "import torch\n\n\ndef assign_req_to_token_pool_func",
                       "import torch\nfrom sglang.srt.speculative.eagle_utils import verify_tree_greedy_func\n\n\n"
                       "def assign_req_to_token_pool_func"),
                      ("info", "        keep, lens, bonus = [], [], []\n        for b in range(bs):\n",
                      "        g = verify_tree_greedy_func(predicts=torch.full((bs * q,), -1, dtype=torch.int32), "
                      "accept_index=torch.full((bs, q), -1, dtype=torch.int32), "
                      "accept_token_num=torch.zeros(bs, dtype=torch.int32), candidates=cand, "
                      "retrieve_index=torch.arange(bs * q).view(bs, q), retrieve_next_token=self.retrieve_next_token, "
                      "retrieve_next_sibling=self.retrieve_next_sibling, target_predict=target, topk=1)\n"
                      "        keep, lens, bonus = [], [], []\n        for b in range(bs):\n"),
                      # ... and its result is what the port accepts (a stand-in that does not walk fails here)
                      ("info", "        kept = torch.tensor(keep)\n",
                       "        acc, pred = torch.as_tensor(g[1]).view(bs, -1), torch.as_tensor(g[0])\n"
                       "        keep = [int(i) for b in range(bs) for i in acc[b] if int(i) != -1]\n"
                       "        lens = [int((acc[b] != -1).sum()) for b in range(bs)]\n"
                       "        bonus = [int(pred[int(acc[b][lens[b] - 1])]) for b in range(bs)]\n"
                       "        kept = torch.tensor(keep)\n")],
    # the commit inside tree_verify writes the accepted slots one position late
    "commit_late": ("info", "                                      batch.seq_lens, end, batch.out_cache_loc, bs)",
                    "                                      batch.seq_lens + 1, end + 1, batch.out_cache_loc, bs)"),
}


def write_checkout(root: Path, *variants: str, git_commit: str | None = None) -> Path:
    files = {"worker": WORKER, "info": INFO, "utils": UTILS}
    for v in variants:
        for which, old, new in (VARIANTS[v] if isinstance(VARIANTS[v], list) else [VARIANTS[v]]):
            assert old in files[which], v
            files[which] = files[which].replace(old, new)
    spec = root / SPEC
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "dflash_worker.py").write_text(files["worker"])
    (spec / "dflash_info.py").write_text(files["info"])
    (spec / "dflash_utils.py").write_text(files["utils"])
    if git_commit:
        (root / ".git" / "refs" / "heads").mkdir(parents=True)
        (root / ".git" / "HEAD").write_text("ref: refs/heads/feature\n")
        (root / ".git" / "packed-refs").write_text(f"# pack-refs\n{git_commit} refs/heads/feature\n")
    return root
