"""harness/check/from_start.py and harness/workflows/reruns.py: which replacements a crash before the first verify step
is rerun with, and the ladder's proof written into the crashed run's summary."""
from __future__ import annotations

import pytest

from harness.check.from_start import REGISTRY, FromStart, engine_frames, ladder, replaced_from_env
from harness.check.refusal import REPLACE_STAGE_ENV
from harness.workflows.reruns import prove_by_reruns, without_outputs
from harness.engine.ddtree.tree import DraftTree
from harness.engine.pipeline import Pipeline
from harness.engine.settings import RunSettings


def _noop(s, pipeline, prompt_ids):
    return s, pipeline, None


def test_a_replacement_reaches_the_frames_of_the_code_it_stands_in_for():
    fs = FromStart("KV allocation", "x", ("harness/engine/mem/", "harness/engine/loop.py::__init__"), _noop)
    assert fs.reaches([("harness/engine/mem/pool.py", "alloc")])
    assert fs.reaches([("harness/engine/loop.py", "__init__")])
    assert not fs.reaches([("harness/engine/loop.py", "prefill")])
    assert not fs.reaches([("harness/engine/memo.py", "f")])   # a prefix is a folder, not a name's start
    with pytest.raises(ValueError):
        FromStart("x", "y", (), _noop)


def test_the_ladder_keeps_the_registry_order_and_puts_a_refusal_last():
    frames = [("harness/engine/attn/torch_backend.py", "forward")]
    assert ladder(frames, "refusal:m:C") == ["attention", "refusal:m:C"]
    assert ladder([("harness/engine/model/presets.py", "<module>")], None) == [
        k for k, fs in REGISTRY.items() if fs.reaches([("harness/engine/model/presets.py", "<module>")])]


def test_engine_frames_are_the_engine_and_schema_frames_of_the_traceback():
    with pytest.raises(ValueError) as info:
        DraftTree(tokens=(1, 2), parents=(None, 0), depths=(0, 5), q_len=2)
    assert engine_frames(info.value)[-1] == ("harness/engine/ddtree/tree.py", "__post_init__")
    assert all(not p.startswith("tests/") for p, _ in engine_frames(info.value))


def test_the_environment_names_the_replacement(monkeypatch):
    p = Pipeline()
    monkeypatch.delenv(REPLACE_STAGE_ENV, raising=False)
    assert replaced_from_env("s", p, [[1]]) == ("s", p, None)
    monkeypatch.setenv(REPLACE_STAGE_ENV, "attention")
    s, q, built = replaced_from_env(RunSettings(budget=8, topk=2, backend="sglang-triton"), p, [[1]])
    assert q.attention is not None and p.attention is None and built is None
    assert s.backend == "torch"   # the backend under test is not even made: its attention is float64 throughout
    monkeypatch.setenv(REPLACE_STAGE_ENV, "refusal:ddschema.config:MlaConfig")   # applied at start-up instead
    assert replaced_from_env("s", p, [[1]]) == ("s", p, None)
    monkeypatch.setenv(REPLACE_STAGE_ENV, "no such stage")
    with pytest.raises(ValueError, match="no such stage"):
        replaced_from_env("s", p, [[1]])


def test_outputs_are_left_out_of_a_rerun():
    assert without_outputs(["run", "--out", "a.jsonl", "--budget", "8", "--html=r.html"]) == ["run", "--budget", "8"]


def _crashed() -> dict:
    return {"kind": "summary", "verdict": "diverge", "explanation": "the engine raised",
            "crash": {"side": "engine", "error": "ValueError: x", "where": "harness/engine/mem/pool.py:1 (f)"},
            "first": {"step": -1, "what": "crash"}}


def test_the_ladder_stops_at_the_first_rerun_that_ends_and_matches(monkeypatch):
    monkeypatch.delenv(REPLACE_STAGE_ENV, raising=False)
    asked = []

    def rerun(argv, key):   # the reruns' summaries as their processes would write them
        asked.append(key)
        return {"verdict": "pass", "max_rel_err": 1e-7, "tolerance": 1e-5} if key.startswith("refusal:") else \
            {"verdict": "diverge", "crash": {"side": "engine"}}
    s = _crashed()
    prove_by_reruns(s, ["run", "--budget", "8"], ["attention", "refusal:ddschema.config:MlaConfig"], rerun)
    assert asked == ["attention", "refusal:ddschema.config:MlaConfig"]
    assert [(r["stage"], r["correct"]) for r in s["replacements"]] == [("attention", False), ("shared schema", True)]
    assert s["first"]["what"] == "proven-crash" and s["stage"] == "shared schema" and s["quantity"] == "crash"
    assert "before its first verify step" in s["first"]["detail"]


def test_no_rerun_that_matches_leaves_the_crash_unproven(monkeypatch):
    monkeypatch.delenv(REPLACE_STAGE_ENV, raising=False)
    s = _crashed()
    prove_by_reruns(s, ["run"], ["attention"], lambda argv, key: None)
    assert s["first"]["what"] == "crash" and "no replaced stage (attention)" in s["explanation"]


def test_a_rerun_never_reruns(monkeypatch):
    monkeypatch.setenv(REPLACE_STAGE_ENV, "attention")
    s = _crashed()
    prove_by_reruns(s, ["run"], ["attention"], lambda argv, key: pytest.fail("a rerun reran"))
    assert "replacements" not in s


def test_a_settings_rerun_is_its_own_command_and_only_where_that_runs_the_same_prompts():
    from harness.engine.settings import DEFAULT_PROMPTS, PromptSpec
    from harness.workflows.reruns import run_argv
    from harness.workflows.sweep import SettingJob, reproduced_by_its_command
    s = RunSettings(budget=8, topk=2, backend="torch", page_size=16)
    argv = run_argv(s.command())
    assert argv[0] == "run" and argv[argv.index("--page-size") + 1] == "16" and "ddcheck" not in argv
    assert run_argv("ddcheck gate --jobs 2") == []
    assert reproduced_by_its_command(SettingJob(0, s, DEFAULT_PROMPTS))
    assert reproduced_by_its_command(SettingJob(0, s, None))
    assert not reproduced_by_its_command(SettingJob(0, s, (PromptSpec("other", 7, 0.5),)))
