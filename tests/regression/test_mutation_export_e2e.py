"""Mutants judged from an export, without cosmic-ray (benchmarks/mutation_engine.py --from): a tiny list of
one mask mutant, its diff applied in plain Python to a private copy of the tree, judged by ddcheck over one
setting of the quick matrix on CPU: caught, its explanation naming the mask stage."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from mutation_engine import MATRIX, TRUTH, baseline_fingerprints, judge  # noqa: E402
from mutation_export import read_export, sha256, write_export  # noqa: E402
from mutation_judging import Truth  # noqa: E402
from tests.unit.test_mutation_export import MASK, _mask_mutant  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git (the tree's file list)")
ONE = (MATRIX[0],)


def test_an_exported_mutant_is_judged_without_cosmic_ray(tmp_path):
    path = tmp_path / "mutants.json"
    write_export(path, {"tree": "here"}, [_mask_mutant()], {MASK: sha256((ROOT / MASK).read_text())})
    _, (m,) = read_export(path, ROOT)
    baseline = baseline_fingerprints(120, 0, ONE)
    row = judge(m.mutant, Truth.load(TRUTH), baseline, m.apply, 120, 0, ONE)
    assert row["outcome"] == "caught" and row["caught_by"] == "divergence", row["runs"]
    assert "+        vis[i, i] = False" in row["diff"]
    assert row["stage"] == "mask" and row["explanation_score"] == "right"
