"""A crash never hides a verdict: divergences recorded before an exception
stay reported and explained, and the exception is attributed to the side
that raised it: the engine under test (exit 1, a divergence named "crash"),
the oracle (its own verdict) or ddcheck itself (an internal error, exit 3)."""
import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

import harness.cli as cli
from harness.check.crash import attribute, side_of
from harness.engine.ddtree.commit import commit_kv
from harness.faults.fault import Fault, has_padding
from harness.faults.registry import catalog

cli._register()

RUN = ["run", "--budget", "16", "--topk", "1", "--backend", "torch", "--max-new-tokens", "4", "--stop-after", "0"]


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _double_free_at_the_end(after: int):
    """A commit stage that frees a rejected row's slot a second time on its
    `after`-th call: the allocator refuses the double free."""
    calls = []

    def commit(req_to_token, allocator, req_pool_idx, seq_len, row_slots, acceptance):
        n = commit_kv(req_to_token, allocator, req_pool_idx, seq_len, row_slots, acceptance)
        calls.append(1)
        if len(calls) == after:
            rejected = [s for i, s in enumerate(row_slots.tolist()) if i not in acceptance.rows]
            allocator.free(row_slots.new_tensor(rejected[:1]))   # already freed by commit_kv
        return n
    return commit


@pytest.fixture
def leak_then_double_free(monkeypatch):
    """padded-kv-visible (diverges at step 0) plus a double free on the third
    and last commit (--max-new-tokens 4: three verify steps of one token)."""
    leak = catalog()["padded-kv-visible"]
    fault = Fault("test-leak-then-double-free", "leaks padding, then frees a slot twice", "padding rows",
                  "padding-leak", lambda p: replace(leak.apply(p), commit=_double_free_at_the_end(3)), has_padding)
    monkeypatch.setitem(catalog(), fault.name, fault)
    return fault.name


def test_a_crash_at_the_end_keeps_the_divergences_before_it(tmp_path, leak_then_double_free):
    out = tmp_path / "r.jsonl"
    result = CliRunner().invoke(cli.app, [*RUN, "--fault", leak_then_double_free, "--out", str(out)])
    assert result.exit_code == 1, result.output
    records = _records(out)
    summary = records[-1]
    assert summary["kind"] == "summary" and summary["verdict"] == "diverge" and not summary["passed"]
    # the node divergence from step 0 is the one reported, and it is explained
    assert summary["first"]["what"] == "node" and summary["first"]["step"] == 0
    assert summary["divergent_nodes"] > 0 and summary["fault_class"] == "padding-leak"
    assert any(r["kind"] == "node" and r["verdict"] == "diverge" and r["step"] == 0 for r in records)
    # ... and the crash after it is recorded, attributed to the engine, at the allocator's line
    (crash,) = [r for r in records if r["kind"] == "crash"]
    assert crash["side"] == "engine" and crash["where"].startswith("harness/engine/mem/allocator.py:")
    assert "not allocated" in crash["error"] and crash["step"] == 1 and not crash["in_step"]  # in the last round
    assert summary["crash"]["side"] == "engine"
    assert "the engine under test raised ValueError" in result.output


def test_an_engine_crash_with_nothing_before_it_is_a_divergence_named_crash(tmp_path, monkeypatch):
    from harness.engine import loop as engine_mod

    def crash(self, step, active):
        raise RuntimeError("illegal memory access")
    monkeypatch.setattr(engine_mod.Engine, "_round", crash)
    out = tmp_path / "r.jsonl"
    result = CliRunner().invoke(cli.app, [*RUN, "--out", str(out)])
    assert result.exit_code == 1, result.output
    summary = _records(out)[-1]
    assert summary["first"]["what"] == "crash" and summary["fault_class"] == "crash"
    assert summary["crash"]["side"] == "engine" and summary["crash"]["where"].startswith("harness/engine/loop.py:")
    assert "illegal memory access" in summary["error"]


def test_an_exception_in_ddchecks_comparison_is_an_internal_error_exit_3(tmp_path, monkeypatch):
    import harness.check.twin_step as check_mod   # where the check calls its step table

    def broken_compare(requests, device=None):
        raise IndexError("index 7 is out of bounds")
    monkeypatch.setattr(check_mod, "step_table", broken_compare)
    out = tmp_path / "r.jsonl"
    result = CliRunner().invoke(cli.app, [*RUN, "--out", str(out)])
    assert result.exit_code == 3, result.output
    line = [ln for ln in result.output.splitlines() if ln.startswith("ddcheck:")]
    assert len(line) == 1 and line[0].startswith("ddcheck: internal error")
    assert "harness/check/twin_step.py:" in line[0] and "IndexError" in line[0]
    records = _records(out)
    (crash,) = [r for r in records if r["kind"] == "crash"]
    assert crash["side"] == "ddcheck" and crash["where"].startswith("harness/check/twin_step.py:")
    assert records[-1]["verdict"] == "internal-error" and not records[-1]["passed"]
    assert "the engine under test" not in result.output


def test_an_exception_in_the_oracle_is_the_oracles(tmp_path, monkeypatch):
    import reference.oracle as oracle_mod

    def broken(tokens, parents):
        raise ZeroDivisionError("float division by zero")
    monkeypatch.setattr(oracle_mod, "validate_tree", broken)
    out = tmp_path / "r.jsonl"
    result = CliRunner().invoke(cli.app, [*RUN, "--out", str(out)])
    assert result.exit_code == 3, result.output
    assert "ddcheck: the oracle raised ZeroDivisionError" in result.output
    records = _records(out)
    (crash,) = [r for r in records if r["kind"] == "crash"]
    assert crash["side"] == "oracle" and crash["where"].startswith("reference/oracle.py:")
    assert records[-1]["verdict"] == "oracle-crash"
    assert "the engine under test" not in result.output and "internal error" not in result.output


def test_sides_by_folder():
    import harness
    from pathlib import Path
    root = Path(harness.__file__).resolve().parent.parent
    assert side_of(str(root / "reference/model.py")) == "oracle"
    assert side_of(str(root / "harness/engine/mem/pool.py")) == "engine"
    assert side_of(str(root / "harness/ports/families/ddtree_utils.py")) == "engine"
    assert side_of(str(root / "harness/check/compare/metrics.py")) == "ddcheck"
    assert side_of(str(root / "harness/engine/mem/provenance.py")) == "ddcheck"   # the canary is ddcheck's instrument
    assert side_of(str(root / "ddschema/config.py")) is None
    assert side_of("/somewhere/else/ddtree_utils.py") is None              # a port's file: its caller decides


def test_a_library_frame_is_passed_over_for_the_side_that_called_it():
    import torch
    from harness.check.compare.metrics import compare_node
    try:
        compare_node(torch.zeros(3), torch.zeros(4))
    except Exception as e:  # noqa: BLE001
        crash = attribute(e, step=1, in_step=True)
    assert crash.side == "ddcheck" and crash.where.startswith("harness/check/compare/metrics.py:")
    assert "while verify step 1 was checked" in crash.sentence()


def test_a_sweep_setting_with_an_internal_error_is_not_judged(monkeypatch):
    import harness.check.twin_step as check_mod   # where the check calls its step table
    from harness.engine.settings import RunSettings
    from harness.workflows.sweep import SettingJob, run_jobs, unjudged_lines, verdict

    def broken_compare(requests, device=None):
        raise IndexError("index 7 is out of bounds")
    monkeypatch.setattr(check_mod, "step_table", broken_compare)
    job = SettingJob(0, RunSettings(budget=8, backend="torch", max_new_tokens=2))
    (r,) = run_jobs([job], 1)
    assert r.summary["verdict"] == "internal-error" and verdict(job, r) == "internal-error"
    (line,) = unjudged_lines([r])
    assert line.startswith("ddcheck: internal error") and "harness/check/twin_step.py:" in line


def _port_raising(tmp_path, body: str):
    """A port file ddcheck loads as it loads any port, with one function `build` that runs `body`."""
    from harness.ports.loading import load_port_module
    f = tmp_path / "port_utils.py"
    f.write_text("def helper(x):\n    return x['missing']\n\n\ndef build():\n" + body + "\n")
    return f, load_port_module(f).module


@pytest.mark.parametrize("body, error", [
    ("    import os\n    return int(os.environ['DDCHECK_TEST_NO_SUCH_VARIABLE'])", "KeyError"),
    ("    from sglang.srt.no_such_module_moved_away import thing\n    return thing", "ModuleNotFoundError"),
    ("    return helper({})", "KeyError"),
])
def test_a_raise_in_the_ports_own_code_is_the_ports_with_its_line_and_sglang(tmp_path, body, error):
    """A missing environment variable, a moved import, a raise in a helper of the port: the
    port's side, at the port's file:line (not the adapter's), naming the installed SGLang."""
    from harness.check.crash import installed_sglang
    f, mod = _port_raising(tmp_path, body)
    try:
        mod.build()
    except Exception as e:  # noqa: BLE001
        crash = attribute(e, step=None)
    assert crash.side == "port" and crash.error.startswith(error)
    assert crash.where.startswith(f"{f}:") and crash.sglang == installed_sglang()
    assert f"under SGLang {installed_sglang()}" in crash.sentence()


def test_a_port_error_is_its_own_verdict_not_a_divergence_nor_a_pass(tmp_path):
    from harness.check.summary import CheckSummary
    from harness.workflows.sweep import exit_code
    f, mod = _port_raising(tmp_path, "    return helper({})")
    try:
        mod.build()
    except Exception as e:  # noqa: BLE001
        crash = attribute(e)
    s = CheckSummary(setting="x", crash=crash.brief(), error=crash.error)
    assert s.verdict == "port-error" and not s.passed
    s.divergent_nodes, s.nodes_checked = 1, 3          # a divergence before the raise stays the verdict
    assert s.verdict == "diverge"
    assert cli.run_cmd.EXIT_CODES["port-error"] == 4 and list(cli.run_cmd.EXIT_CODES.values()).count(4) == 1

    class R:   # a sweep's result row, as exit_code reads it
        def __init__(self, verdict):
            self.summary, self.setting = {"verdict": verdict, "crash": crash.brief()}, "s"
    assert exit_code([R("pass"), R("port-error")], failed=True) == 4
    assert exit_code([R("internal-error"), R("port-error")], failed=True) == 3
    assert exit_code([R("pass"), R("diverge")], failed=True) == 1
