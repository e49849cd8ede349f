"""The mutation corpus (benchmarks/mutations/) does not rot: every patch
still applies cleanly to the current tree, and each names a stage and a
quantity the localizer can report."""
from __future__ import annotations

import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from harness.localize.wrong import QUANTITIES, STAGES

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "benchmarks" / "mutations"
MUTATIONS = tomllib.loads((CORPUS / "mutations.toml").read_text())["mutation"]


def test_the_corpus_is_large_enough_and_well_formed():
    assert len(MUTATIONS) >= 25
    assert len({m["name"] for m in MUTATIONS}) == len(MUTATIONS)
    assert sorted(m["patch"] for m in MUTATIONS) == sorted(p.name for p in CORPUS.glob("*.patch"))
    for m in MUTATIONS:
        assert m["stage"] in STAGES + ("load",) and m["quantity"] in QUANTITIES + ("config", "weights"), m["name"]


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@pytest.mark.parametrize("patch", [m["patch"] for m in MUTATIONS])
def test_patch_applies_to_the_current_tree(patch):
    r = subprocess.run(["git", "apply", "--check", str(CORPUS / patch)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
