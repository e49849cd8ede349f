"""dflash-worker-tree: the port's own worker method and verify input driven from a fake
checkout the test writes (tests/unit/port_worker_fixture.py), the lineage of what ran,
`ddcheck ports --probe`, and the adapter example of docs/ADAPTERS.md."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from harness.check.crash import attribute
from harness.cli import _register, app
from harness.engine.attn.sglang_triton import available
from harness.engine.ddtree.mask import kernel_visible
from harness.ports import registry
from harness.ports.audit import audit_acceptance, audit_mask, mask_encoding
from harness.ports.families.dflash_worker_tree import DFlashWorkerTree, fits, read_tree
from harness.ports.port_files import load_port_files
from harness.ports.probe import probe
from harness.ports.protocol import PortError
from harness.ports.stages import AuditLog, PortStages
from tests.unit.port_worker_fixture import SPEC, write_checkout

_register()
EXAMPLE = Path(__file__).resolve().parents[1] / "fixtures" / "ports" / "adapter_example"
VOCAB, DEPTH, BUDGET = 12, 3, 5            # q = budget + 1 = 6: a chain of 3, then 2 root children


def drafts(bs: int = 1, seed: int = 0) -> torch.Tensor:
    """[bs, DEPTH, VOCAB] per-depth draft log-probs."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(bs, DEPTH, VOCAB, generator=g).log_softmax(-1)


def built(adapter, bs=1, roots=None):
    lp = drafts(bs)
    top_lp, top_ids = lp.topk(2, dim=-1)
    return lp, adapter.build(top_lp, top_ids, roots or [7] * bs, BUDGET, lp).trees


def test_build_reads_back_the_workers_own_tree(tmp_path):
    adapter = DFlashWorkerTree(write_checkout(tmp_path))
    lp, (tree,) = built(adapter)
    ids = lp[0].argmax(-1).tolist()
    runners_up = lp[0, 0].topk(3).indices.tolist()[1:]
    assert tree.tokens == (7, *ids, *runners_up)
    assert tree.parents == (None, 0, 1, 2, 0, 0) and tree.depths == (0, 1, 2, 3, 1, 1) and tree.q_len == BUDGET + 1


def test_compile_hands_the_workers_mask_over_untouched(tmp_path):
    adapter = DFlashWorkerTree(write_checkout(tmp_path))
    _, trees = built(adapter, bs=2, roots=[3, 4])
    c = adapter.compile(list(trees), [4, 9])
    vi = c.native["verify_input"]
    assert c.mask.data is vi.custom_mask and c.mask.layout == "flat" and c.mask.data.dtype == torch.bool
    q = BUDGET + 1
    assert c.mask.data.numel() == q * (4 + q) + q * (9 + q)
    assert c.positions.view(2, q)[1].tolist() == [9 + d for d in trees[1].depths]


def test_an_additive_mask_handed_over_raw_reads_inverted(tmp_path):
    adapter = DFlashWorkerTree(write_checkout(tmp_path, "additive_mask"))
    _, (tree,) = built(adapter)
    c = adapter.compile([tree], [3])
    assert c.mask.data.dtype == torch.bfloat16            # as the worker hands it to custom_mask
    block = kernel_visible(c.mask.data).view(tree.q_len, 3 + tree.q_len)
    found = audit_mask(0, 0, tree, 3, block, True, mask_encoding(c.mask.data))
    assert "mask-inverted" in {f.check for f in found}


def test_the_clean_workers_mask_passes_the_audit(tmp_path):
    adapter = DFlashWorkerTree(write_checkout(tmp_path))
    _, (tree,) = built(adapter)
    c = adapter.compile([tree], [3])
    block = kernel_visible(c.mask.data).view(tree.q_len, 3 + tree.q_len)
    assert audit_mask(0, 0, tree, 3, block, True, mask_encoding(c.mask.data)) == []


def test_compile_without_the_ports_build_is_a_usage_error(tmp_path):
    adapter = DFlashWorkerTree(write_checkout(tmp_path))
    with pytest.raises(PortError, match="add build to --port-stages"):
        PortStages(adapter, ("compile",), AuditLog())
    from harness.engine.ddtree.tree import DraftTree
    with pytest.raises(PortError, match="its own build chose"):
        adapter.compile([DraftTree((1, 2), (None, 0), (0, 1), q_len=BUDGET + 1)], [0])


def test_accept_runs_tree_verify_and_reads_rows_and_bonus(tmp_path):
    adapter = DFlashWorkerTree(write_checkout(tmp_path))
    _, (tree,) = built(adapter)
    adapter.compile([tree], [5])
    target = [tree.tokens[1], tree.tokens[2], 11, 0, 0, 0]      # chain rows 1, 2 accepted, then 11
    acc = adapter.accept([tree], torch.tensor([target]))[0]
    assert (acc.rows, acc.bonus) == ((0, 1, 2), 11)
    assert audit_acceptance(0, 0, tree, target, acc) == []


def test_an_accept_comparing_the_target_with_itself_is_caught(tmp_path):
    adapter = DFlashWorkerTree(write_checkout(tmp_path, "self_compare"))
    _, (tree,) = built(adapter)
    adapter.compile([tree], [5])
    target = [10, 10, 10, 10, 10, 10]
    acc = adapter.accept([tree], torch.tensor([target]))[0]
    assert acc.rows == (0, 1, 2, 3)                           # unverified drafts emitted
    assert [f.check for f in audit_acceptance(0, 0, tree, target, acc)] == ["accept"]


def test_a_raise_inside_the_ports_verify_input_is_the_ports(tmp_path):
    adapter = DFlashWorkerTree(write_checkout(tmp_path, "raises"))
    _, (tree,) = built(adapter)
    adapter.compile([tree], [5])
    with pytest.raises(KeyError) as e:
        adapter.accept([tree], torch.zeros(1, BUDGET + 1, dtype=torch.long))
    crash = attribute(e.value)
    assert crash.side == "port" and "dflash_info.py" in crash.where


def test_server_doubles_are_put_back_after_each_call(tmp_path):
    adapter = DFlashWorkerTree(write_checkout(tmp_path))
    own_group, own_assign = adapter.worker_mod.get_tp_group, adapter.info_mod.assign_req_to_token_pool_func
    _, (tree,) = built(adapter)
    adapter.compile([tree], [2])
    adapter.accept([tree], torch.zeros(1, BUDGET + 1, dtype=torch.long))
    assert adapter.worker_mod.get_tp_group is own_group
    assert adapter.info_mod.assign_req_to_token_pool_func is own_assign


def test_siblings_come_from_the_checkout_and_leave_no_alias(tmp_path):
    root = write_checkout(tmp_path)
    before = sys.modules.get("sglang.srt.speculative.dflash_info")
    files = load_port_files(root / SPEC / "dflash_worker.py", "dflash")
    assert [s for s, _ in files.modules] == ["dflash_info", "dflash_utils", "dflash_worker"]
    vi_cls = files["dflash_worker"].module.DFlashVerifyInput
    assert Path(sys.modules[vi_cls.__module__].__file__) == root / SPEC / "dflash_info.py"
    assert sys.modules.get("sglang.srt.speculative.dflash_info") is before


def test_only_the_lineages_files_are_loaded(tmp_path):
    root = write_checkout(tmp_path)
    (root / SPEC / "spec_helpers.py").write_text("raise RuntimeError('the fork copy of an SGLang file')\n")
    worker = root / SPEC / "dflash_worker.py"
    worker.write_text("from vllm.spec_helpers import helper\n" + worker.read_text())   # not installed: stubbed
    files = load_port_files(worker, "dflash")
    assert "spec_helpers" not in [s for s, _ in files.modules]
    assert "vllm.spec_helpers" in files.stubbed


def test_lineage_names_what_ran_and_the_commit(tmp_path):
    sha = "514ea1f3ec39e006b2556bfed6c0c77c8fa0c531"
    adapter = DFlashWorkerTree(write_checkout(tmp_path, git_commit=sha))
    _, (tree,) = built(adapter)
    adapter.compile([tree], [2])
    adapter.accept([tree], torch.zeros(1, BUDGET + 1, dtype=torch.long))
    d = adapter.lineage.describe()
    assert d["commit"] == sha and d["files"] == ["dflash_info.py", "dflash_utils.py", "dflash_worker.py"]
    ran = {r.split(" ", 1)[1] for r in d["reached"]}
    assert {"DFlashWorker._tree_and_mask", "build_tree_one_req", "DFlashVerifyInput.tree_verify"} <= ran
    assert "assign_req_to_token_pool_func" not in ran          # the server double ran, not the port's stand-in
    assert sha[:12] in adapter.lineage.sentence()


def test_lineage_without_git_says_commit_unknown(tmp_path):
    adapter = DFlashWorkerTree(write_checkout(tmp_path))
    assert adapter.lineage.commit is None and "commit unknown" in adapter.lineage.sentence()


@pytest.mark.parametrize("variant,why", [("no_links", "no tree links"), ("mask_later", "no custom_mask"),
                                         ("other_params", "parameters this adapter fills")])
def test_fits_says_why_a_worker_cannot_be_driven(tmp_path, variant, why):
    root = write_checkout(tmp_path, variant)
    assert why in fits(root)
    with pytest.raises(PortError, match="does not fit"):
        DFlashWorkerTree(root)


def test_read_tree_refuses_links_that_are_no_tree():
    links = torch.tensor([1, 0, -1]), torch.tensor([-1, -1, -1])       # row 1's child is the root
    with pytest.raises(PortError, match="not a tree"):
        read_tree(torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2]), *links, 3)


def test_probe_exit_codes_and_reasons(tmp_path):
    root = write_checkout(tmp_path / "port")
    r = CliRunner().invoke(app, ["ports", "--probe", str(root)])
    assert r.exit_code == 0 and "dflash-worker-tree: fits" in r.output, r.output
    bare = write_checkout(tmp_path / "bare", "no_links")
    r = CliRunner().invoke(app, ["ports", "--probe", str(bare)])
    assert r.exit_code == 1 and "docs/ADAPTERS.md" in r.output, r.output
    assert all(f"{name}: does not fit" in r.output for name in registry.families())
    r = CliRunner().invoke(app, ["ports", "--probe", str(tmp_path / "missing")])
    assert r.exit_code == 2


def test_the_adapter_example_registers_and_fits(monkeypatch):
    sys.path.insert(0, str(EXAMPLE))
    try:
        import ddcheck_adapter_example as ex
    finally:
        sys.path.remove(str(EXAMPLE))

    class EP:
        name = "example-chain"

        def load(self):
            return ex.FAMILY

    monkeypatch.setattr(registry, "entry_points", lambda group: [EP()] if group == registry.ENTRY_POINT_GROUP else [])
    port = EXAMPLE / "my_port.py"
    assert [p.family for p in probe(port) if p.fits] == ["example-chain"]
    adapter = registry.load_adapter(registry.parse_impl(f"example-chain:{port}"))
    lp = drafts()
    top_lp, top_ids = lp.topk(2, dim=-1)
    (tree,) = adapter.build(top_lp, top_ids, [7], BUDGET).trees
    c = adapter.compile([tree], [3])
    block = kernel_visible(c.mask.data).view(tree.q_len, 3 + tree.q_len)
    assert audit_mask(0, 0, tree, 3, block, True, mask_encoding(c.mask.data)) == []


@pytest.mark.parametrize("variant,exit_code", [(None, 0), ("self_compare", 1), ("additive_mask", 1), ("raises", 4)])
def test_a_run_judges_the_workers_code_and_names_what_ran(tmp_path, variant, exit_code):
    import json
    root = write_checkout(tmp_path / "port", *([variant] if variant else []))
    out = tmp_path / "run.jsonl"
    r = CliRunner().invoke(app, ["run", "--impl", f"dflash-worker-tree:{root}", "--budget", "4", "--topk", "1",
                                 "--max-new-tokens", "3", "--backend", "torch", "--no-cuda-graph", "--drafter", "self",
                                 "--draft-layers", "1", "--out", str(out)])   # a weak drafter: drafts get rejected
    assert r.exit_code == exit_code, r.output
    summary = [json.loads(x) for x in out.read_text().splitlines() if json.loads(x)["kind"] == "summary"][-1]
    reached = " ".join(summary["port"]["lineage"]["reached"])
    assert "DFlashWorker._tree_and_mask" in reached and "DFlashVerifyInput.tree_verify" in reached
    if variant == "self_compare":
        assert summary["audit_errors"] > 0 and "accept" in str(summary["first_finding"])
    if variant == "additive_mask":   # handed over raw, read as the kernel reads it: inverted, and named so
        assert "mask-inverted" in str(summary["first_finding"])


def test_ports_shows_mask_shapes_as_text():
    r = CliRunner().invoke(app, ["ports"], env={"COLUMNS": "1000"})
    assert r.exit_code == 0 and "flat per-request [q, prefix + q] blocks" in r.output, r.output


def _serving_run(tmp_path, *variants, extra=()):
    import json
    root = write_checkout(tmp_path / "port", *variants)
    out = tmp_path / "run.jsonl"
    r = CliRunner().invoke(app, ["run", "--impl", f"dflash-worker-tree:{root}", "--budget", "4", "--topk", "1",
                                 "--max-new-tokens", "2", "--backend", "sglang-serving-dflash", *extra,
                                 "--out", str(out)])
    records = [json.loads(x) for x in out.read_text().splitlines()]
    return r, next(x for x in records if x["kind"] == "summary"), records


@pytest.mark.skipif(not available(), reason="no SGLang")
def test_the_ports_own_verify_input_is_what_sglangs_backend_receives(tmp_path):
    """A verify input of SGLang's DFLASH_VERIFY type goes to TritonAttnBackend as the port's worker built
    it, here at graph replay (eagerly: the served-width test below, whose width only the port's own object
    can carry), and the width it served is the tree's (no served-width finding).
    (A plain class of the port's gets the backend's own, built from its mask: the other runs of this file.)"""
    r, summary, records = _serving_run(tmp_path, "spec_input", extra=("--cuda-graph",))
    assert r.exit_code in (0, 1), r.output     # under graphs SGLang's DFlash capture has no mask (graph-causal-mask)
    assert summary["port"]["served_verify_input"] == ["the port's own DFlashVerifyInput (dflash_info.py)"]
    assert not [x for x in records if x["kind"] == "audit" and x["check"] == "served-width"]


@pytest.mark.skipif(not available(), reason="no SGLang")
def test_a_verify_input_naming_another_width_than_its_tree_is_caught_as_served_width(tmp_path):
    """The port's own object, eagerly: SGLang serves the width it names (the backend's own would name 5)."""
    r, summary, records = _serving_run(tmp_path, "spec_input", "short_width", extra=("--no-cuda-graph",))
    assert r.exit_code == 1, r.output
    found = [x for x in records if x["kind"] == "audit" and x["check"] == "served-width"]
    assert found and "served 4 rows per request" in found[0]["detail"] and "5 rows wide" in found[0]["detail"]


def test_tree_verify_runs_sglangs_greedy_kernel_off_cuda(tmp_path):
    """The fixture's tree_verify calls SGLang's verify_tree_greedy_func, which 0.5.23 has no CPU path for:
    SGLang's own Triton kernel runs in its place, and its walk is the fixture's."""
    if torch.cuda.is_available():
        pytest.skip("on CUDA SGLang's own kernel runs")
    a = DFlashWorkerTree(write_checkout(tmp_path / "port", "sglang_greedy"))
    lp, trees = built(a)
    a.compile(trees, [3])
    target = torch.tensor([[int(t) for t in trees[0].tokens[1:]] + [5]])   # accepts the chain
    (acc,) = a.accept(trees, target)
    assert acc.rows[:2] == (0, 1)


def test_the_commit_inside_tree_verify_is_audited(tmp_path):
    """A tree_verify that writes the accepted slots one position late: commit-slot, with the slots."""
    for variant, bad in ((None, False), ("commit_late", True)):
        a = DFlashWorkerTree(write_checkout(tmp_path / str(variant), *([variant] if variant else [])))
        lp, trees = built(a)
        a.compile(trees, [3])
        a.accept(trees, torch.tensor([[int(t) for t in trees[0].tokens[1:]] + [5]]))
        checks = [f.check for f in a.findings]
        assert ("commit-slot" in checks) == bad, a.findings
        if bad:
            assert "position 3" in a.findings[0].detail
