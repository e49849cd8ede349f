"""Issue 21's "Done when" cases end to end, a few of them (the rest, and the
default gate over each, in benchmarks/done_when_21.py): each patch applied
to a copy of the tree, its targeted setting run through the CLI, caught with
the right stage named: a loop that emits the root twice (accept, emitted),
a wrong weight name in the shared schema (load, weights), a kernel call that
kills its process (attention, a crash; proven by the run again with a
float64 attention in its place)."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from done_when_21 import cases, run_case  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("git") is None, reason="needs git")]

EXPECTED = {"a": ("accept", "emitted"), "g": ("load", "weights"), "i": ("attention", "crash")}


def test_every_case_of_the_issue_has_a_fixture():
    assert sorted(m["done_when"] for m in cases(set())) == list("abcdefghi")


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_the_case_is_caught_with_its_stage_named(case):
    (m,) = cases({case})
    row = run_case(m, gate=False, jobs=1)
    t = row["targeted"]
    assert row["applied"] and row["caught"] and row["stage_named"], t
    assert (t["stage"], t["quantity"]) == EXPECTED[case], t
    if case == "i":   # the killed run again with a float64 attention in a new process: it runs and matches
        assert [(x["stage"], x["correct"]) for x in t["replacements"]] == [("attention", True)], t
