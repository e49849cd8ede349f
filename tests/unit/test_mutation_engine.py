"""The pure parts of the mutation-engine benchmark (benchmarks/mutation_judging.py,
benchmarks/mutation_common.py): a mutant's outcome from its runs, the truth
table and the explanation's score, the annotation filter, the stratified
sample, the tallies, and the engine-output fingerprint that decides
"equivalent"."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from mutation_common import fingerprint  # noqa: E402
from mutation_judging import (Mutant, SettingRun, Truth, annotation_spans, caught_by, in_annotation,  # noqa: E402
                              mutant_outcome,
                              operator_family, score_explanation, setting_outcome, stratified_sample, tally, totals)

TRUTH = Truth.load(ROOT / "benchmarks" / "mutation_truth.toml")


def run(exit=0, what=None, summary=True, internal=False, fp="a"):
    return SettingRun(exit, what, summary, internal, fp)


@pytest.mark.parametrize("r, outcome", [
    (run(), "pass"),
    (run(1, "node"), "caught"),
    (run(1, "stream"), "caught"),
    (run(1, "crash"), "crash-only"),          # the engine under test raised: a divergence, but no wrong value shown
    (run(1, "proven-crash"), "caught"),       # it raised at a step a stage's replacement makes run and match
    (run(1, None, summary=False), "crash-only"),  # exit 1 with no summary (a bare traceback) is no verdict
    (run(2, None), "crash-only"),             # the engine refused its own input
    (run(-11, None, summary=False), "crash-only"),
    (run(3, None), "no-judge"),
    (run(3, None, internal=True), "no-judge"),
    (run(124, None, summary=False), "timeout"),
])
def test_setting_outcome(r, outcome):
    assert setting_outcome(r) == outcome


def test_mutant_outcome_ranks_a_divergence_over_a_crash_and_compares_outputs_for_equivalence():
    base = ["a", "b"]
    assert mutant_outcome([run(1, "crash"), run(1, "node")], base) == "caught"
    assert mutant_outcome([run(1, "crash"), run(3)], base) == "crash-only"
    assert mutant_outcome([run(3), run(124)], base) == "no-judge"
    assert mutant_outcome([run(fp="a"), run(fp="b")], base) == "equivalent"
    assert mutant_outcome([run(fp="a"), run(fp="c")], base) == "survived"   # passed, but the engine's outputs moved
    assert mutant_outcome([run(fp="a")], base) == "survived"                # not run over the whole matrix
    with pytest.raises(ValueError):
        mutant_outcome([], base)


def test_a_proven_crash_is_caught_and_said_apart_from_a_value_divergence():
    base = ["a", "b"]
    assert mutant_outcome([run(1, "crash"), run(1, "proven-crash")], base) == "caught"
    assert caught_by([run(1, "crash"), run(1, "proven-crash")]) == "proven-crash"
    assert caught_by([run(1, "node"), run(1, "proven-crash")]) == "divergence"
    assert caught_by([run(1, "crash"), run(0)]) is None
    rows = [{"module": "a", "family": "AddNot", "outcome": "caught", "caught_by": "proven-crash",
             "explanation_score": "right", "internal_error": False},
            {"module": "a", "family": "AddNot", "outcome": "caught", "caught_by": "divergence",
             "explanation_score": "right", "internal_error": False},
            {"module": "a", "family": "AddNot", "outcome": "crash-only", "caught_by": None,
             "explanation_score": None, "internal_error": False}]
    t = totals(rows)
    assert (t["caught"], t["caught_by_proven_crash"], t["caught_by_value_divergence"]) == (2, 1, 1)
    assert t["caught_by_proven_crash_share"] == round(1 / 3, 4) and t["caught_share"] == round(2 / 3, 4)
    assert tally(rows, "module")["a"]["caught_by_proven_crash"] == 1


def test_the_fingerprint_sees_a_logit_change_and_ignores_timings():
    node = {"kind": "node", "step": 0, "request": 0, "node": 1, "token": 5, "rel_err": 1e-7, "rel_l2": 2e-8}
    summary = {"kind": "summary", "verdict": "pass", "engine_s_per_step": 0.1, "time": "10:00"}
    base = fingerprint([node, summary])
    assert fingerprint([node, {**summary, "engine_s_per_step": 0.3, "time": "11:00"}]) == base
    assert fingerprint([{**node, "rel_err": 1.5e-7}, summary]) != base
    assert fingerprint([node, {"kind": "stream", "request": 0, "engine_tokens": [1, 2]}, summary]) != base


def test_every_truth_stage_is_one_of_the_issues_and_every_module_exists():
    assert set(TRUTH.stages) == {"tree", "mask", "verify inputs", "attention backend", "accept", "commit",
                                 "KV allocation", "graph replay", "model arithmetic", "checkpoint reading",
                                 "shared schema"}
    for path in TRUTH.modules:
        assert (ROOT / path).is_file(), path
    localizer_words = {"tree build", "mask", "verify inputs", "graph", "attention", "model", "accept", "commit", "load",
                       "KV allocation", "shared schema"}
    assert {w for words in TRUTH.stages.values() for w in words} <= localizer_words
    from harness.check.localize.wrong import STAGE_WORDS
    from harness.check.refusal import refusal_stage
    # "shared schema": named only by a validator's refusal proven false (harness/check/refusal.py)
    assert refusal_stage("ddschema.config") == "shared schema"
    assert localizer_words == set(STAGE_WORDS.values()) | {"load", "shared schema"}


def test_truth_by_module_and_function():
    m = Mutant("harness/engine/loop.py", "core/NumberReplacer", 0, 10, 0, "prefill")
    assert TRUTH.stage_of(m) == "model arithmetic"
    assert TRUTH.stage_of(Mutant("harness/engine/loop.py", "core/NumberReplacer", 1, 10, 0, "_round")) == "accept"
    assert TRUTH.stage_of(Mutant("harness/engine/ddtree/mask.py", "core/AddNot", 0, 3, 0, None)) == "mask"
    assert not TRUTH.in_scope(Mutant("harness/engine/loop.py", "core/AddNot", 0, 3, 0, "_canary"))
    assert not TRUTH.in_scope(Mutant("harness/engine/model/presets.py", "core/AddNot", 0, 3, 0, None))
    assert not TRUTH.in_scope(Mutant("harness/check/differential.py", "core/AddNot", 0, 3, 0, "check"))
    with pytest.raises(ValueError, match="not one of"):
        Truth(TRUTH.stages, {"x.py": type(TRUTH.modules["ddschema/config.py"])("x.py", "engine loop")})


def test_score_explanation():
    assert score_explanation(TRUTH, "mask", "mask") == "right"
    assert score_explanation(TRUTH, "mask", None) == "unknown"
    assert score_explanation(TRUTH, "mask", "model") == "wrong"
    assert score_explanation(TRUTH, "KV allocation", "commit") == "right"
    assert score_explanation(TRUTH, "KV allocation", "verify inputs") == "right"
    assert score_explanation(TRUTH, "KV allocation", "KV allocation") == "right"   # a crash's proof by replacement
    assert score_explanation(TRUTH, "commit", "KV allocation") == "wrong"
    assert score_explanation(TRUTH, "checkpoint reading", "load") == "right"
    assert score_explanation(TRUTH, "shared schema", "load") == "wrong"   # no localizer word names it


def test_mutants_inside_annotations_are_found():
    src = "from __future__ import annotations\ndef f(x: int | None) -> list[int]:\n    y: int | None = x | 1\n"
    spans = annotation_spans(src)
    at = lambda line, col: Mutant("m.py", "core/ReplaceBinaryOperator_BitOr_Sub", 0, line, col, "f")  # noqa: E731
    assert in_annotation(at(2, 13), spans)          # x: int | None
    assert in_annotation(at(3, 11), spans)          # y: int | None
    assert not in_annotation(at(3, 22), spans)      # x | 1: code
    assert in_annotation(at(2, 29), spans)          # -> list[int]


def test_the_sample_covers_every_module_before_any_twice_and_is_seeded():
    ms = [Mutant(f"m{i % 3}.py", "core/AddNot", j, 1 + j, 0, "f") for i in range(3) for j in range(5 + 5 * i)]
    s = stratified_sample(ms, 4, seed=1)
    assert sorted({m.module for m in s[:3]}) == ["m0.py", "m1.py", "m2.py"]
    assert len(s) == 4 and len({m.key for m in s}) == 4
    assert stratified_sample(ms, 4, seed=1) == s
    assert stratified_sample(ms, 4, seed=2) != s
    assert len(stratified_sample(ms, 1000, seed=0)) == len({m.key for m in ms})


def test_mutant_from_a_cosmic_ray_dump_line():
    item = {"job_id": "x", "mutations": [{"module_path": "ddschema/config.py", "operator_name": "core/AddNot",
                                          "occurrence": 3, "start_pos": [80, 57], "end_pos": [80, 58],
                                          "operator_args": {}, "definition_name": "__post_init__"}]}
    m = Mutant.from_dump(item)
    assert (m.module, m.occurrence, m.line, m.col, m.definition) == ("ddschema/config.py", 3, 80, 57, "__post_init__")
    assert m.key == "ddschema/config.py:core/AddNot:3"
    assert operator_family("core/ReplaceBinaryOperator_Add_Sub") == "ReplaceBinaryOperator"
    with pytest.raises(ValueError):
        Mutant("a.py", "core/AddNot", -1, 1, 0, None)


def test_tallies_and_the_issue_figures():
    rows = [{"module": "a", "family": "AddNot", "outcome": "caught", "explanation_score": "right", "internal_error": False},
            {"module": "a", "family": "AddNot", "outcome": "caught", "explanation_score": "unknown", "internal_error": False},
            {"module": "b", "family": "NumberReplacer", "outcome": "no-judge", "explanation_score": None,
             "internal_error": True},
            {"module": "b", "family": "AddNot", "outcome": "equivalent", "explanation_score": None, "internal_error": False}]
    per = tally(rows, "module")
    assert per["a"]["caught"] == 2 and per["a"]["right"] == 1 and per["a"]["unknown"] == 1
    assert per["b"]["internal_errors"] == 1 and per["b"]["equivalent"] == 1
    t = totals(rows)
    assert t["behaviour_changing"] == 3 and t["caught_share"] == round(2 / 3, 4)
    assert t["no_judge_share"] == round(1 / 3, 4) and t["internal_errors"] == 1
    assert t["explained_right_share"] == 0.5 and t["explained_wrong"] == 0


def test_an_incompetent_mutant_is_told_by_compiling_and_counts_apart_from_the_changing_ones():
    from mutation_judging import compiles, stillborn
    assert compiles("def f(**kw):\n    return 2 ** 3\n", "m.py")
    assert not compiles("def f(^kw):\n    return 2\n", "m.py")   # cosmic-ray's Pow -> BitXor on **kw
    syntax = "ddcheck: the engine under test raised SyntaxError: invalid syntax at pkg/m.py:59 (<module>) while"
    row = {"module": "pkg/m.py", "runs": [{"stderr_tail": syntax}, {"stderr_tail": syntax}]}
    assert stillborn(row)
    assert not stillborn({**row, "module": "pkg/other.py"})   # a SyntaxError elsewhere is not this mutant's
    assert not stillborn({**row, "runs": [{"stderr_tail": syntax}, {"stderr_tail": "TypeError"}]})
    rows = [{"module": "a", "family": "AddNot", "outcome": "caught", "explanation_score": "right", "internal_error": False},
            {"module": "a", "family": "AddNot", "outcome": "incompetent", "explanation_score": None,
             "internal_error": False}]
    assert totals(rows)["behaviour_changing"] == 1 and totals(rows)["caught_share"] == 1.0


def test_markdown_table_of_a_tally():
    from mutation_judging import markdown
    rows = [{"module": "a.py", "family": "AddNot", "outcome": "caught", "explanation_score": "right",
             "internal_error": False}]
    text = markdown(tally(rows, "module"), "module").splitlines()
    assert text[0].startswith("| module | caught | caught by proven crash | crash-only |") and text[1].startswith("| --- |")
    assert text[2] == "| a.py | 1 | 0 | 0 | 0 | 0 | 0 | 0 | 0 | 1 | 0 | 0 | 0 |"   # ... equivalent, incompetent, right ...
