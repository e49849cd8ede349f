"""Ports under test: each family's faithful fixture passes the fault-free slice,
and every planted bug is caught (exit 1) and named by the audit."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from harness.check.differential import check

from harness.check.prepare import prepare
from harness.cli import _register, app
from harness.ports.attach import SettingSkipped
from harness.check.records import RecordWriter
from harness.engine.settings import RunSettings

_register()
FIX = Path(__file__).resolve().parents[1] / "fixtures" / "ports"
FAITHFUL = {"ddtree-utils": FIX / "ddtree_utils" / "faithful.py", "dflash-tree": FIX / "dflash_tree" / "faithful.py",
            "dflash-tree-utils": FIX / "dflash_tree_utils" / "faithful.py"}
SLICE = [dict(budget=16, topk=1, batch=1), dict(budget=16, topk=1, batch=3, cuda_graph=True),
         dict(budget=8, topk=2, batch=3), dict(budget=16, topk=4, batch=2, cuda_graph=True),
         dict(budget=4, topk=1, batch=2)]


def _run(impl: str, **kw):
    s = RunSettings(backend="torch", max_new_tokens=kw.pop("max_new_tokens", 10), impl=impl, **kw)
    writer = RecordWriter(None)
    summary = check(prepare(s), writer)
    return summary, [json.loads(x) for x in writer.lines]


@pytest.mark.parametrize("family", sorted(FAITHFUL))
@pytest.mark.parametrize("setting", SLICE, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_faithful_port_passes(family, setting):
    summary, records = _run(f"{family}:{FAITHFUL[family]}", **setting)
    assert summary.passed, (summary.first, summary.first_finding, summary.explanation)
    assert summary.nodes_checked > 0 and summary.audit_errors == summary.audit_warnings == 0
    assert summary.port["port_stages"] == ["build", "compile", "accept"] + (["commit"] if family == "ddtree-utils" else [])


# (fixture, settings, the audit check that must name it)
PLANTED = [
    ("padding_visible", dict(budget=16, topk=1, batch=2), "mask-padding-visible"),
    ("rectangle_mask", dict(budget=16, topk=2, batch=2), "mask-layout"),
    ("count_nonzero_tokens", dict(budget=16, topk=1, batch=2, max_new_tokens=12), "mask-missing-key"),
    ("chain_accept", dict(budget=16, topk=2, batch=2, max_new_tokens=12), "accept"),
    ("commit_request0_slots", dict(budget=8, topk=2, batch=3, max_new_tokens=12), "commit-kv"),
    ("padding_rows_masked", dict(budget=16, topk=1, batch=1), "padding-row-empty"),
]


@pytest.mark.parametrize("fixture, setting, named", PLANTED, ids=[p[0] for p in PLANTED])
def test_planted_bug_caught_and_named(fixture, setting, named):
    summary, records = _run(f"ddtree-utils:{FIX / 'ddtree_utils' / (fixture + '.py')}", **setting)
    assert not summary.passed
    found = {r["check"] for r in records if r["kind"] == "audit"}
    assert named in found, found


def test_count_nonzero_bug_needs_a_real_token_zero():
    """The planted count bug is silent until a draft of token 0 is real: its
    faithful twin at the same setting passes, so the finding is the bug's."""
    summary, _ = _run(f"ddtree-utils:{FAITHFUL['ddtree-utils']}", budget=16, topk=1, batch=2, max_new_tokens=12)
    assert summary.passed


def test_fully_masked_padding_rows_are_a_warning_on_sglang_and_strict_fails():
    pytest.importorskip("sglang")
    impl = f"ddtree-utils:{FIX / 'ddtree_utils' / 'padding_rows_masked.py'}"
    base = dict(budget=16, topk=1, batch=1, max_new_tokens=4, backend="sglang-triton", impl=impl)
    writer = RecordWriter(None)
    lenient = check(prepare(RunSettings(**base)), writer, localize=False)
    assert lenient.passed and lenient.audit_warnings > 0 and lenient.audit_errors == 0
    strict = check(prepare(RunSettings(**base, strict=True)), RecordWriter(None), localize=False)
    assert not strict.passed and strict.first_finding.startswith("padding-row-empty")


def test_seed_command_on_a_port_exits_with_verdicts_not_a_traceback(tmp_path):
    """The issue's command: per-node verdicts and the audit, exit 0 or 1."""
    out = tmp_path / "r.jsonl"
    for fixture, code in (("faithful", 0), ("padding_visible", 1)):
        r = CliRunner().invoke(app, ["run", "--impl", f"ddtree-utils:{FIX / 'ddtree_utils' / (fixture + '.py')}",
                                     "--budget", "16", "--topk", "1", "--no-cuda-graph", "--backend", "torch",
                                     "--max-new-tokens", "8", "--out", str(out)], env={"COLUMNS": "200"})
        assert r.exit_code == code, r.output
        records = [json.loads(x) for x in out.read_text().splitlines()]
        kinds = {r["kind"] for r in records}
        assert "node" in kinds and "summary" in kinds
        assert ("audit" in kinds) == (code == 1)
        if code == 1:   # the localizer ran on the port's pipeline: its mask probe saw the port's mask
            loc = next(r for r in records if r["kind"] == "localize")
            assert loc["fault_class"] == "padding-leak" and loc["mask_probe"]
        assert "audit" in r.output and "Traceback" not in r.output


def test_port_stages_mix_ddcheck_and_port_stages():
    """ddcheck's tree handed to the port's compile: --topk 1 reaches a port whose
    own builder would choose its own K (the first public version of the lineage)."""
    summary, _ = _run(f"ddtree-utils:{FIX / 'ddtree_utils' / 'padding_visible.py'}", budget=16, topk=1,
                      port_stages="compile")
    assert summary.port["port_stages"] == ["compile"] and summary.port["ddcheck_stages"] == ["build", "accept", "commit"]
    assert not summary.passed and summary.first_finding.startswith("mask-padding-visible")


def test_port_without_padding_path_skips_padded_settings():
    pytest.importorskip("sglang")
    with pytest.raises(SettingSkipped, match="no padding rows"):
        prepare(RunSettings(backend="torch", budget=16, topk=1, impl="sglang-eagle"))


def test_bad_impl_is_a_one_line_usage_error(tmp_path):
    bad = tmp_path / "no_build.py"
    bad.write_text("def compile_ddtree_tree():\n    pass\n")
    for impl, msg in ((f"ddtree-utils:{bad}", "no function build_ddtree_tree()"), ("nosuch:x", "unknown family"),
                      (f"ddtree-utils:{tmp_path / 'missing.py'}", "does not exist"), ("ddtree-utils", "needs a path")):
        r = CliRunner().invoke(app, ["run", "--impl", impl, "--backend", "torch"])
        assert r.exit_code == 2 and msg in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1


def test_fully_masked_padding_rows_are_an_error_where_the_backend_produces_nan():
    """The same port on the torch backend: 0/0 there is NaN, so the finding is an error."""
    summary, records = _run(f"ddtree-utils:{FIX / 'ddtree_utils' / 'padding_rows_masked.py'}", budget=16, topk=1,
                            batch=1, max_new_tokens=4)
    empty = [r for r in records if r["kind"] == "audit" and r["check"] == "padding-row-empty"]
    assert not summary.passed and empty and all(r["severity"] == "error" for r in empty)
    assert summary.nonfinite_padding_rows > 0 and summary.divergent_nodes <= summary.nodes_checked
