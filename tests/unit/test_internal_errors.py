"""Internal errors of ddcheck that mutants of the engine found (issue 21,
point 7; benchmarks/mutation_engine.py): each was an exception in ddcheck's
own code (exit 3, "could not judge") where the engine under test was wrong,
and is now a verdict."""
from __future__ import annotations

from dataclasses import replace

from harness.check.compare.metrics import engine_block
from harness.check.differential import check
from harness.check.prepare import prepare
from harness.check.records import RecordWriter
from harness.engine.settings import RunSettings

import pytest
import torch

SETTING = dict(backend="torch", budget=8, topk=2, max_new_tokens=6, stop_after=1)


def _engine_with_logits_blocks(cut):
    """The engine under test, its every request handed CUT(logits) as its logits block (a wrong slice
    of the batch's logits in the loop, as the mutant `logits[b * q:(b - 1) * q]` makes)."""
    p = prepare(RunSettings(**SETTING))
    rounds = p.engine.rounds

    def cut_rounds():
        for result in rounds():
            yield replace(result, requests=tuple(replace(rs, logits=cut(rs.logits)) for rs in result.requests))
    p.engine.rounds = cut_rounds
    return p


def test_an_empty_logits_block_is_a_divergence_not_an_internal_error():
    p = _engine_with_logits_blocks(lambda x: x[:0])
    summary = check(p, RecordWriter(None))
    assert summary.verdict == "diverge", summary.crash
    assert summary.crash is None
    assert summary.first.what == "node" and summary.first.step == 0 and summary.first.node == 0
    assert any("logits block of shape [0, " in n for n in summary.notes), summary.notes


def test_a_short_logits_block_keeps_the_rows_it_has():
    p = _engine_with_logits_blocks(lambda x: x[:2])
    summary = check(p, RecordWriter(None))
    assert summary.verdict == "diverge" and summary.crash is None
    # rows 0 and 1 are the engine's own, and right; row 2 is missing
    assert summary.first.what == "node" and summary.first.node == 2


def test_engine_block_shapes():
    x = torch.randn(3, 5)
    same, why = engine_block(x, 3, 5)
    assert same is x and why is None
    short, why = engine_block(x[:1], 3, 5)
    assert torch.equal(short[0], x[0]) and short[1:].isnan().all() and "[1, 5]" in why
    long, why = engine_block(torch.randn(4, 5), 3, 5)
    assert long.shape == (3, 5) and long.isnan().all() and why
    other_vocab, why = engine_block(torch.randn(3, 6), 3, 5)
    assert other_vocab.shape == (3, 5) and other_vocab.isnan().all() and why


def _tree_with(tmp_path, module: str, line: str):
    """A copy of ddcheck's packages with LINE appended to MODULE (a planted bug that raises at import)."""
    import shutil
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    for pkg in ("harness", "reference", "ddschema"):
        shutil.copytree(root / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / module, "a") as f:
        f.write("\n" + line + "\n")
    return tmp_path


def _tree_replacing(tmp_path, module: str, old: str, new: str):
    """A copy of ddcheck's packages with OLD replaced by NEW in MODULE (a mutant; OLD must be there)."""
    tree = _tree_with(tmp_path, module, "")
    f = tree / module
    src = f.read_text()
    assert old in src, f"{module} no longer holds {old!r}"
    f.write_text(src.replace(old, new))
    return tree


def _run_cli(tree, *args):
    import os
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "harness", "run", "--backend", "torch", "--max-new-tokens", "2",
                           *args], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True,
                          text=True, timeout=300)


def test_an_engine_module_that_raises_at_import_is_an_engine_crash_with_a_summary(tmp_path):
    import json
    tree = _tree_with(tmp_path, "harness/engine/ddtree/mask.py", 'raise IndexError("planted at import")')
    out = tree / "r.jsonl"
    r = _run_cli(tree, "--out", str(out))
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("ddcheck: the engine under test raised IndexError: planted at import at "
                           "harness/engine/ddtree/mask.py:"), line
    crash, summary = [json.loads(x) for x in out.read_text().splitlines()]
    assert crash["kind"] == "crash" and crash["side"] == "engine"
    assert summary["kind"] == "summary" and summary["verdict"] == "diverge" and not summary["passed"]
    assert summary["first"]["what"] == "crash" and summary["while"] == "importing"


def test_a_ddcheck_module_that_raises_at_import_is_an_internal_error(tmp_path):
    tree = _tree_with(tmp_path, "harness/check/records.py", 'raise KeyError("planted")')
    r = _run_cli(tree)
    assert r.returncode == 3, r.stderr
    assert "Traceback" not in r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("ddcheck: internal error (a bug in ddcheck, not a verdict on the engine): KeyError: "
                           "'planted' at harness/check/records.py:"), line


def _first_batch():
    p = prepare(RunSettings(**{**SETTING, "batch": 2}))
    result = next(p.engine.rounds())
    return result.batch.attn, result.batch.input_ids.numel(), p.engine.pool.k_buffer[0].shape[0]


def test_metadata_the_interpreted_kernel_could_follow_outside_its_buffers_is_raised():
    from harness.engine.attn.bounds import KernelBoundsError, check_kernel_reads
    meta, rows, slots = _first_batch()
    check_kernel_reads(meta, rows, slots)   # the engine's own metadata: every read inside its buffer
    bad = {
        "kv_indptr must hold 3 entries": replace(meta, kv_indptr=meta.kv_indptr[:-1].clone()),
        "qo_indptr .* is not a non-decreasing": replace(meta, qo_indptr=meta.qo_indptr + rows),
        "kv_indices hold slot": replace(meta, kv_indices=meta.kv_indices + slots),
        "out_cache_loc": replace(meta, out_cache_loc=meta.out_cache_loc[:1].clone()),
        "mask_indptr .* is not a non-decreasing": replace(meta, custom_mask=meta.custom_mask[:-1].clone()),
        "request 1's mask block": replace(meta, mask_indptr=meta.mask_indptr + torch.tensor([0, 1, 0])),
        "mask_indptr must hold": replace(meta, mask_indptr=meta.mask_indptr[:1].clone()),
    }
    for message, m in bad.items():
        with pytest.raises(KernelBoundsError, match=message):
            check_kernel_reads(m, rows, slots)
    # a buffer declared shorter over the same storage (the graph runner's) is read past its end harmlessly:
    # a wrong value the check judges, not a dead process
    check_kernel_reads(replace(meta, custom_mask=meta.custom_mask[:-1]), rows, slots)


def test_a_graph_kv_indptr_one_short_under_the_interpreter_is_an_engine_crash_not_a_dead_process(tmp_path):
    """The graph runner's static kv_indptr two entries short (a cosmic-ray mutant, `bucket + 1` -> `bucket - 1`):
    SGLang's interpreted kernel read past it and the run died by signal 11 with no records."""
    import json
    tree = _tree_replacing(tmp_path, "harness/engine/graph.py", "kv_indptr=torch.arange(bucket + 1, **i64)",
                           "kv_indptr=torch.arange(bucket - 1, **i64)")
    out = tree / "r.jsonl"
    import os
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "harness", "run", "--backend", "sglang-triton", "--cuda-graph",
                        "--budget", "8", "--topk", "4", "--batch", "3", "--max-new-tokens", "4", "--stop-after", "1",
                        "--out", str(out)], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    summary = json.loads(out.read_text().splitlines()[-1])
    # the eager forward in the graph runner's place runs the step and matches: a divergence of the graph stage
    assert summary["kind"] == "summary" and summary["first"]["what"] == "proven-crash", summary["first"]
    assert summary["stage"] == "graph", summary["replacements"]
    assert summary["crash"]["side"] == "engine" and "kv_indptr" in summary["crash"]["error"]


def test_the_attention_audit_on_a_probe_that_saw_no_key_is_no_match_not_an_error():
    """A torch-backend mutant summing the softmax denominator over the wrong dimension (`p.sum(-1)` ->
    `p.sum(-0)`): the probe measured no visible key on any row, and amax over no row raised in the
    localizer (a caught run with no explanation and 'localizer failed: ddcheck itself ...')."""
    from harness.check.localize.attention_audit import _explains
    from harness.engine.attn.base import PLAIN
    rows, keys, heads, d = 3, 5, 2, 4
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, heads, d, generator=g, dtype=torch.float64) for n in (rows, keys, keys))
    nothing = torch.zeros(rows, keys, dtype=torch.bool)
    assert _explains(torch.randn(rows, heads, d, dtype=torch.float64), q, k, v, nothing, PLAIN) is False
    causal = torch.ones(rows, keys, dtype=torch.bool)
    probs = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5, -1)
    right = torch.einsum("hqk,khd->qhd", probs, v)   # [rows, heads, d]
    assert _explains(right, q, k, v, causal, PLAIN) is True


def test_a_qo_indptr_the_probe_cannot_follow_is_named_by_the_metadata_audit_not_an_index_error():
    """The verify inputs' qo_indptr empty (a mutant `(bs + 1) * q_len` -> `(bs + 1) >> q_len`): the torch
    backend still ran and the run diverged, then the localizer's mask probe indexed qo_indptr[-1] and raised
    (a caught run with no explanation)."""
    from harness.check.prepare import derive

    def empty_qo(build):
        def build_verify_batch(*args, **kw):
            vb = build(*args, **kw)
            return replace(vb, attn=replace(vb.attn, qo_indptr=vb.attn.qo_indptr[:0].clone()))
        return build_verify_batch

    p = prepare(RunSettings(**{**SETTING, "topk": 1}))
    p = derive(p, pipeline=replace(p.engine.pipeline, build_verify_batch=empty_qo(p.engine.pipeline.build_verify_batch)))
    w = RecordWriter(None)
    summary = check(p, w)
    assert summary.verdict == "diverge" and summary.crash is None
    assert not any("localizer failed" in n for n in summary.notes), summary.notes
    assert (summary.stage, summary.quantity) == ("verify inputs", "qo_indptr"), summary.explanation


def test_a_kernel_call_that_kills_its_process_is_an_engine_crash_with_a_summary(tmp_path):
    """The unified adapter hands SGLang's build_unified_kv_indices a batch size past the metadata's
    (a cosmic-ray mutant, `numel() - 1` -> `numel() ^ 1`): the interpreted kernel reads outside its
    buffers and the process dies by signal 11 (no exception to catch). The command's parent process
    reads the fault handler's stack and gives the verdict (harness/cli/watchdog.py)."""
    import json
    tree = _tree_replacing(tmp_path, "harness/engine/attn/sglang_unified.py", "bs = meta.qo_indptr.numel() - 1",
                           "bs = meta.qo_indptr.numel() ^ 1")
    out = tree / "r.jsonl"
    r = _run_cli(tree, "--backend", "sglang-unified", "--budget", "16", "--out", str(out))
    if r.returncode == 0:
        pytest.skip("this machine's process survived the out-of-bounds read (nothing to judge)")
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    (line,) = r.stderr.strip().splitlines()[-1:]
    assert line.startswith("ddcheck: the engine under test: the process died by SIG"), line
    assert "harness/engine/attn/sglang_unified.py:" in line
    crash, summary = [json.loads(x) for x in out.read_text().splitlines()]
    assert crash["side"] == "engine" and summary["verdict"] == "diverge"
    # a divergence of the step it died in where the run again with a float64 attention runs and matches
    proven = any(x["correct"] for x in summary.get("replacements") or ())
    assert summary["first"]["what"] == ("proven-crash" if proven else "crash"), summary["first"]
    assert summary["while"] == "running"


def test_a_syntax_error_in_an_engine_module_is_the_engines_not_its_importers(tmp_path):
    """cosmic-ray's `while active := ...` -> `while not active := ...` in the engine loop does not compile:
    the SyntaxError's frames end in the importer (harness/check/prepare.py), which made it ddcheck's
    internal error (exit 3); the error is in the file being compiled."""
    tree = _tree_replacing(tmp_path, "harness/engine/loop.py", "while active := self._retire_finished():",
                           "while not active := self._retire_finished():")
    r = _run_cli(tree)
    assert r.returncode == 1, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("ddcheck: the engine under test raised SyntaxError: ") and \
        " at harness/engine/loop.py:" in line, line


def test_a_pool_sized_with_no_slot_is_the_engines_crash_not_the_canarys():
    """A paged pool sized `(2 + requests * pages) & page_size` (a cosmic-ray mutant) has no slot: the KV
    canary indexed its padding slot and raised (ddcheck's instrument: an internal error). Now the canary
    builds, and the engine's allocator refuses the first allocation."""
    from harness.check.crash import attribute
    from harness.engine.mem.allocator import OutOfSlots
    from harness.engine.mem.pool import KVPool
    from harness.engine.model.presets import model_config
    from harness.engine.mem.provenance import SlotProvenance
    assert SlotProvenance(0).owner.numel() == 0
    pool = KVPool(model_config("tiny"), 0, torch.float32, "cpu")
    with pytest.raises(OutOfSlots) as e:
        pool.allocator.alloc(1)
    assert attribute(e.value).side == "engine"


def test_an_allocator_whose_owned_is_no_set_is_the_engines_crash_not_the_canarys(tmp_path):
    """cosmic-ray's RemoveDecorator on the allocator's `owned` (a property) leaves a method where a set of slots
    was: the KV canary tested membership in it (`s not in allocated`, provenance.py) and raised, an internal
    error (exit 3). The engine's loop hands the canary the allocator's slots as a set: its own raise."""
    import json
    tree = _tree_replacing(tmp_path, "harness/engine/mem/allocator.py", "    @property\n    def owned(self)",
                           "    def owned(self)")
    out = tree / "r.jsonl"
    r = _run_cli(tree, "--budget", "8", "--topk", "1", "--no-cuda-graph", "--out", str(out))
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    crash, summary = next(x for x in rows if x["kind"] == "crash"), rows[-1]
    assert crash["side"] == "engine" and crash["where"].startswith("harness/engine/"), crash["where"]
    assert summary["verdict"] == "diverge"
    assert not any("(an internal error)" in n for n in summary["notes"]), summary["notes"]


def test_a_graph_mask_indptr_shorter_than_the_live_mask_is_named_not_an_audit_crash(tmp_path):
    """The graph runner's static mask block sizes `n + (seq_lens + n)` for `n * (seq_lens + n)` (a cosmic-ray
    mutant): its mask_indptr ends before the live requests' mask, and the graph audit built a tensor of
    negative size (the localizer failed: an internal error beside a caught divergence). Now it names it."""
    import json
    tree = _tree_replacing(tmp_path, "harness/engine/graph.py", "mask_sizes = n * (seq_lens + n)",
                           "mask_sizes = n + (seq_lens + n)")
    out = tree / "r.jsonl"
    r = _run_cli(tree, "--backend", "torch", "--cuda-graph", "--budget", "8", "--topk", "4", "--batch", "3",
                 "--stop-after", "1", "--out", str(out))
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    summary = json.loads(out.read_text().splitlines()[-1])
    assert not any("(an internal error)" in n for n in summary["notes"]), summary["notes"]
    assert summary["stage"] == "graph" and summary["quantity"] == "mask_indptr", summary["explanation"]


@pytest.mark.parametrize("slots", [torch.arange(1.0, 4.0), torch.tensor([2, 99])])
def test_slots_the_engine_hands_the_kv_canary_wrong_are_the_engines_crash_not_ddchecks(slots):
    """A pool that frees float slots (`PADDING_SLOT / 1`) or one past its end: the canary (a ddcheck instrument
    inside the engine's folder) refuses them, and the raise is the engine's, at the pool's code that handed them
    (it was an IndexError inside the canary: an internal error)."""
    from harness.check.crash import attribute
    from harness.engine.mem.pool import KVPool
    from ddschema import ModelConfig
    cfg = ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=4)
    pool = KVPool(cfg, 8, torch.float32, "cpu")
    with pytest.raises(ValueError) as info:
        pool._on_free(slots)
    crash = attribute(info.value)
    assert crash.side == "engine" and crash.where.startswith("harness/engine/mem/pool.py"), crash
    pool._on_free(torch.tensor([1, 2]))   # integer slots of the pool: no refusal
    assert pool.provenance.owner[1] == -1
