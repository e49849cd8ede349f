"""A crash before any verify step proven by replacement, through the CLI on a patched copy of the tree. A validator that refuses valid values (harness/check/refusal.py) is caught as a divergence with its stage
named, by the run without it: at the engine's import (the shared schema's MLA check, proven by a rerun in a new
process, harness/workflows/reruns.py) and at a verify step (DraftTree's check, proven in-process by the crash rungs'
last rung). Patches of tests/mutations/ applied to a copy of the tree, run through the CLI."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from done_when_21 import CORPUS, run_targeted  # noqa: E402
from mutation_common import copy_tree  # noqa: E402
from mutation_score import load_corpus  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("git") is None, reason="needs git")]

CASES = {"schema-validator-refuses-valid-config": ("shared schema", "in a new process"),
         "tree-validator-refuses-valid-tree": ("tree build", "")}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_refusal_proven_false_is_a_divergence_of_the_validators_stage(name):
    (m,) = [x for x in load_corpus() if x["name"] == name]
    stage, note = CASES[name]
    with tempfile.TemporaryDirectory(prefix="ddcheck-refusal-") as d:
        tree = Path(d)
        copy_tree(tree)
        subprocess.run(["git", "apply", str(CORPUS / m["patch"])], cwd=tree, check=True)
        t = run_targeted(tree, {**m, "settings": ["torch"]})
    assert t["exit"] == 1 and t["proven_crash"], t
    assert (t["stage"], t["quantity"]) == (stage, "crash"), t
    last = t["replacements"][-1]
    assert last["correct"] and last["stage"] == stage, t
    assert all(not r["correct"] for r in t["replacements"][:-1]), t   # the stage rungs before it did not help
    assert "validator" in t["explanation"] and note in t["explanation"], t["explanation"]


def test_a_sweep_setting_whose_engine_raised_while_built_is_proven_by_reruns_of_its_command(tmp_path):
    """The request table two rows short: the engine raises while it is built, in a sweep's worker too; the
    setting's own `ddcheck run` command again with the engine's memory replaced from the start ends and matches
    (harness/workflows/sweep.py, harness/workflows/reruns.py)."""
    (m,) = [x for x in load_corpus() if x["name"] == "req-pool-two-rows-short"]
    with tempfile.TemporaryDirectory(prefix="ddcheck-refusal-") as d:
        tree = Path(d)
        copy_tree(tree)
        subprocess.run(["git", "apply", str(CORPUS / m["patch"])], cwd=tree, check=True)
        out = tmp_path / "sweep.jsonl"
        r = subprocess.run([sys.executable, "-m", "harness", "sweep", "--budget", "8", "--topk", "2",
                            "--max-new-tokens", "6", "--jobs", "1", "--out", str(out)],
                           cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True,
                           timeout=600)
    rows = [json.loads(x) for x in out.read_text().splitlines() if x.strip()]
    (summary,) = [x for x in rows if x.get("kind") == "summary"]
    assert r.returncode == 1, r.stderr[-2000:]
    assert summary["first"]["what"] == "proven-crash" and summary["stage"] == "KV allocation", summary
    assert [x["stage"] for x in summary["replacements"] if x["correct"]] == ["KV allocation"], summary
