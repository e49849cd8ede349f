"""harness/check/refusal.py: which validator refused, skipping it in-process and at a rerun's start."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from harness.check.refusal import REFUSAL_PREFIX, REPLACE_STAGE_ENV, refusal_stage, refused_by, validator_skipped
from harness.engine.ddtree.tree import DraftTree


def _bad_tree() -> DraftTree:
    return DraftTree(tokens=(1, 2), parents=(None, 0), depths=(0, 5), q_len=2)   # row 1's depth is not 0 + 1


def _raised(fn) -> BaseException:
    with pytest.raises(Exception) as info:
        fn()
    return info.value


def test_the_refusing_validator_is_named_by_its_class():
    assert refused_by(_raised(_bad_tree)) == "harness.engine.ddtree.tree:DraftTree"


def test_a_raise_outside_any_validator_is_no_refusal():
    def not_a_validator():
        DraftTree(tokens=(1,), parents=(None,), depths=(0,), q_len=1).ancestors(7)
    assert refused_by(_raised(not_a_validator)) is None


def test_a_validator_outside_the_engine_and_the_schema_is_no_refusal():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Local:   # this test file's own: not the engine under test
        x: int

        def __post_init__(self):
            raise ValueError("no")
    assert refused_by(_raised(lambda: Local(1))) is None


def test_the_stage_is_the_validators_module():
    assert refusal_stage("ddschema.config") == "shared schema"
    assert refusal_stage("harness.engine.ddtree.tree") == "tree build"
    assert refusal_stage("harness.engine.attn.base") == "attention"
    assert refusal_stage("harness.engine.ddtree.verify_inputs") == "verify inputs"


def test_skipped_within_the_block_and_put_back_after():
    with validator_skipped("harness.engine.ddtree.tree:DraftTree"):
        assert _bad_tree().depths == (0, 5)
    with pytest.raises(ValueError, match="parent's"):
        _bad_tree()


FIXTURE = textwrap.dedent('''
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Thing:
        x: int

        def __post_init__(self):
            raise ValueError("refused at import")

    MADE = Thing(1)   # built while the module is imported, as the presets build their configs
''')


def _import_fixture(tmp_path, env: dict) -> subprocess.CompletedProcess:
    (tmp_path / "refusing_fixture.py").write_text(FIXTURE)
    code = ("from harness.check.refusal import skip_from_env; print(skip_from_env()); "
            "import refusing_fixture; print(refusing_fixture.MADE)")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{tmp_path}", **env})


def test_a_rerun_skips_a_validator_that_refuses_while_its_own_module_is_imported(tmp_path):
    plain = _import_fixture(tmp_path, {REPLACE_STAGE_ENV: ""})
    assert plain.returncode != 0 and "refused at import" in plain.stderr
    skipped = _import_fixture(tmp_path, {REPLACE_STAGE_ENV: f"{REFUSAL_PREFIX}refusing_fixture:Thing"})
    assert skipped.returncode == 0, skipped.stderr
    assert skipped.stdout.split() == ["refusing_fixture:Thing", "Thing(x=1)"]


def test_a_rerun_of_another_stage_skips_nothing(tmp_path):
    r = _import_fixture(tmp_path, {REPLACE_STAGE_ENV: "attention"})
    assert r.returncode != 0 and "refused at import" in r.stderr
