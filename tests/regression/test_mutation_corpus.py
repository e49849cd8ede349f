"""The mutation corpus (tests/mutations/) does not rot: every patch
still applies cleanly to the current tree, and each names a stage and a
stage the scorer maps to the localizer's words (benchmarks/mutation_score.py)."""
from __future__ import annotations

import shutil
import subprocess
import tomllib
from pathlib import Path

import sys

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from mutation_score import STAGE_WORDS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "mutations"
MUTATIONS = tomllib.loads((CORPUS / "mutations.toml").read_text())["mutation"]


def test_the_corpus_is_large_enough_and_well_formed():
    assert len(MUTATIONS) >= 25
    assert len({m["name"] for m in MUTATIONS}) == len(MUTATIONS)
    assert sorted(m["patch"] for m in MUTATIONS) == sorted(p.name for p in CORPUS.glob("*.patch"))
    for m in MUTATIONS:
        assert m["stage"] in STAGE_WORDS and m["quantity"] and m["description"], m["name"]


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@pytest.mark.parametrize("patch", [m["patch"] for m in MUTATIONS])
def test_patch_applies_to_the_current_tree(patch):
    r = subprocess.run(["git", "apply", "--check", str(CORPUS / patch)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
