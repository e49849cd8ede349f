"""The mutation-engine benchmark end to end on two mutants cosmic-ray makes
of the tree (benchmarks/mutation_engine.py), over one setting of its quick
matrix: a mask mutant is caught and its explanation names the mask stage; a
mutant that changes only the records' schema number changes no output of the
engine and is judged equivalent. Skipped where cosmic-ray 8.x is not
installed (the [mutate] extra; $COSMIC_RAY names its executable)."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from mutation_engine import MATRIX, baseline_fingerprints, cosmic_ray_apply, cosmic_ray_mutants, judge  # noqa: E402
from mutation_judging import Truth  # noqa: E402

COSMIC_RAY = os.environ.get("COSMIC_RAY") or shutil.which("cosmic-ray")
pytestmark = pytest.mark.skipif(not COSMIC_RAY or shutil.which("git") is None,
                                reason="needs cosmic-ray 8.x (the [mutate] extra) and git")
ONE = (MATRIX[0],)   # topk 1, batch 1, page size 1, eager, the walk, the torch backend


def test_two_cosmic_ray_mutants_judged(tmp_path):
    full = Truth.load(ROOT / "benchmarks" / "mutation_truth.toml")
    truth = Truth(full.stages, {k: v for k, v in full.modules.items()
                                if k in ("harness/engine/ddtree/mask.py", "ddschema/records.py")})
    mutants = cosmic_ray_mutants(COSMIC_RAY, truth, tmp_path)
    # a real row no longer sees itself (`vis[i, i] = True` -> False in tree_visibility)
    # (the first such site, a real row's; the second, a padding row's, is equivalent without padding)
    mask = min((m for m in mutants if m.module.endswith("mask.py") and m.definition == "tree_visibility"
                and m.operator == "core/ReplaceTrueWithFalse"), key=lambda m: m.line)
    schema = next(m for m in mutants if m.module == "ddschema/records.py" and m.operator == "core/NumberReplacer")
    baseline = baseline_fingerprints(120, 0, ONE)
    caught = judge(mask, truth, baseline, cosmic_ray_apply(COSMIC_RAY, mask), 120, 0, ONE)
    assert caught["outcome"] == "caught", caught["runs"]
    assert "+        vis[i, i] = False" in caught["diff"]
    assert caught["expected_stage"] == "mask" and caught["stage"] == "mask"
    assert caught["explanation_score"] == "right"
    equivalent = judge(schema, truth, baseline, cosmic_ray_apply(COSMIC_RAY, schema), 120, 0, ONE)
    assert equivalent["outcome"] == "equivalent", equivalent["runs"]
