"""Each backend declares the mask regions it reads. A mask that blocks a
prefix key is honoured by the torch backend (so it diverges from the tree's
semantics) and ignored by SGLang's kernel (skip_prefix_custom_mask): that run
passes, and its summary says the blocked keys stayed visible."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from harness.engine.attn import make_backend
from harness.check.differential import check
from harness.check.prepare import prepare
from harness.engine.model.presets import load_model
from harness.check.records import RecordWriter
from harness.engine.loop import Engine
from harness.engine.pipeline import Pipeline
from harness.engine.settings import RunSettings
from harness.engine.ddtree.mask import flat_custom_mask
from harness.engine.ddtree.tree import DraftTree

pytestmark = pytest.mark.sglang


def block_first_prefix_key(trees: list[DraftTree], prefix_lens: list[int]):
    """The correct mask, except that no row may attend prefix position 0."""
    mask, indptr = flat_custom_mask(trees, prefix_lens)
    for t, p, start in zip(trees, prefix_lens, indptr.tolist()):
        mask[start:start + t.q_len * (p + t.q_len)].view(t.q_len, p + t.q_len)[:, 0] = False
    return mask, indptr


def run_with_mask(backend: str):
    s = RunSettings(budget=4, topk=2, backend=backend, batch=2, max_new_tokens=4)
    p = prepare(s)
    cfg, weights = load_model(s.model, s.seed)
    engine = Engine(s, cfg, weights, p.engine.backend, p.prompts, p.prompt_ids,
                    Pipeline(build_mask=block_first_prefix_key))
    return check(replace(p, engine=engine), RecordWriter(None), localize=False)  # localization is not under test


def test_backends_declare_the_regions_they_read():
    assert make_backend("torch", "cpu", torch.float32).mask_regions == {"prefix", "draft"}
    assert make_backend("sglang-triton", "cpu", torch.float32).mask_regions == {"draft"}
    assert make_backend("sglang-unified", "cpu", torch.float32).mask_regions == {"prefix", "draft"}


def test_torch_backend_honours_the_blocked_prefix_key_and_diverges():
    summary = run_with_mask("torch")
    assert not summary.passed and summary.divergent_nodes > 0
    assert not any("prefix" in n for n in summary.notes)


def test_sglang_kernel_ignores_prefix_columns_and_the_summary_says_so():
    summary = run_with_mask("sglang-triton")
    assert summary.passed and summary.divergent_nodes == 0
    request_steps = (summary.nodes_checked + summary.padding_rows) // 5  # q_len = 5
    note = next(n for n in summary.notes if "prefix keys" in n)
    assert note.startswith(f"mask blocks {request_steps} prefix keys;")  # one blocked column per block
    assert "sglang-triton does not read the prefix columns (skip_prefix_custom_mask)" in note


def test_correct_mask_gives_no_prefix_note():
    summary = check(prepare(RunSettings(budget=4, topk=2, backend="sglang-triton", max_new_tokens=4)),
                    RecordWriter(None))
    assert summary.passed and not any("prefix keys" in n for n in summary.notes)
