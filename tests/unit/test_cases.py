"""Case files: the default gate's scenario, `ddcheck cases`, and malformed
files as one-line errors naming the file and the key (exit 2)."""
import subprocess
import sys
from pathlib import Path

import pytest

from harness.workflows.cases import DEFAULT_CASE, CaseError, load_case, prompts_for

ROOT = Path(__file__).resolve().parents[2]
GOOD = """
name = "t"
model = "tiny"
max_new_tokens = 4
[[prompts]]
name = "code"
length = 6
accuracy = 0.9
[[matrix]]
budget = [8, 16]
topk = 1
[[faults]]
name = "padded-kv-visible"
budget = 16
"""


def test_default_gate_holds_the_seed_scenario_and_the_general_matrix():
    case = load_case(ROOT / DEFAULT_CASE)
    settings = case.settings()
    seed = [s for s in settings if (s.budget, s.topk, s.batch) == (16, 1, 2) and s.backend == "torch"]
    assert {s.cuda_graph for s in seed} == {True, False}
    assert [p.name for p in case.prompts[:2]] == ["code", "poem"]
    assert case.prompts[0].accuracy > case.prompts[1].accuracy
    general = {(s.budget, s.topk, s.cuda_graph, s.batch) for s in settings if s.backend == "torch"}
    assert {(b, k, g, n) for b in (4, 8, 16, 32) for k in (1, 2, 4) for g in (True, False) for n in (1, 4)} <= general
    assert any(s.backend == "sglang-triton" for s in settings)
    assert "padded-kv-visible" in {f.name for f in case.faults}
    assert all(s.fault is None for s in settings)


def test_good_case_expands_its_matrix(tmp_path):
    case = load_case(_write(tmp_path, GOOD))
    assert [(s.budget, s.topk, s.max_new_tokens) for s in case.settings()] == [(8, 1, 4), (16, 1, 4)]
    assert case.faults[0].under.settings(case.base)[0].fault == "padded-kv-visible"


def test_overlapping_matrix_tables_run_each_setting_once_under_the_first_label(tmp_path):
    text = GOOD.replace("[[faults]]", '[[matrix]]\nlabel = "again"\nbudget = [16, 32]\n[[faults]]')
    case = load_case(_write(tmp_path, text))
    labelled = [(s.budget, label) for s, label in case.labelled_settings()]
    assert labelled == [(8, "matrix-0"), (16, "matrix-0"), (32, "again")]
    assert [s.budget for s in case.settings()] == [8, 16, 32]


def test_a_table_or_fault_may_run_on_another_model(tmp_path):
    text = GOOD.replace("[[faults]]", '[[matrix]]\nlabel = "sinks"\nmodel = ["tiny-sinks", "tiny-softcap"]\n'
                                      '[[faults]]\nname = "sinks-first-row-only"\nmodel = "tiny-sinks"\n[[faults]]')
    case = load_case(_write(tmp_path, text))
    assert [(s.budget, s.model) for s in case.settings()] == [(8, "tiny"), (16, "tiny"), (16, "tiny-sinks"),
                                                             (16, "tiny-softcap")]
    assert [f.under.settings(case.base)[0].model for f in case.faults] == ["tiny-sinks", "tiny"]
    # a fault that cannot show on the case's own model is refused there
    with pytest.raises(CaseError, match="settings where it can show"):
        load_case(_write(tmp_path, text.replace('model = "tiny-sinks"\n[[faults]]', '[[faults]]')))


MALFORMED = [
    ("budget = [8, 16]", 'budget = ["x"]', "matrix[0].budget", "positive integers"),
    ("topk = 1", "topk = 0", "matrix[0].topk", "positive integers"),
    ("budget = [8, 16]", "budget = [8, 16]\nwidth = 3", "matrix[0].width", "unknown key"),
    ("accuracy = 0.9", "accuracy = 1.5", "prompts[0].accuracy", "[0, 1]"),
    ("length = 6", "length = 6\ntokens = [1, 2]", "prompts[0].length", "exactly one of"),
    ('name = "padded-kv-visible"', 'name = "no-such-fault"', "faults[0].name", "registered fault"),
    ('model = "tiny"', 'model = "tiny"\nbogus = 1', "bogus", "unknown key"),
    ("max_new_tokens = 4", "max_new_tokens = 0", "max_new_tokens", "integer in [1, 8192]"),
    ("topk = 1", 'topk = 1\ndtype = "float8"', "matrix[0].dtype", "dtypes among"),
    ("topk = 1", 'topk = 1\ndtype = ["float32", "tf32"]', "matrix[0].dtype", "dtypes among"),
    ("[[prompts]]", "[tolerances]\ntf32 = 1e-3\n[[prompts]]", "tolerances.tf32", "unknown key"),
    ("[[prompts]]", "[tolerances]\nfloat32 = 0\n[[prompts]]", "tolerances.float32", "a number in (0, 1)"),
    ("budget = 16\n", "budget = 4\ntopk = 4\n", "faults[0].name", "settings where it can show"),
    ("topk = 1", "topk = 1\nprompt_len = 0", "matrix[0].prompt_len", "a prompt length in [1,"),
    ("topk = 1", 'topk = 1\nprompt_len = "600"', "matrix[0].prompt_len", "a prompt length in [1,"),
    ("topk = 1", "topk = 1\nprompt_len = true", "matrix[0].prompt_len", "a prompt length in [1,"),
]


@pytest.mark.parametrize("old,new,key,expected", MALFORMED)
def test_malformed_case_names_file_and_key(tmp_path, old, new, key, expected):
    assert old in GOOD
    path = _write(tmp_path, GOOD.replace(old, new, 1))
    with pytest.raises(CaseError) as err:
        load_case(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: key '{key}': expected") and expected in msg and "\n" not in msg


def test_invalid_toml_names_the_file(tmp_path):
    path = _write(tmp_path, "name = \n")
    with pytest.raises(CaseError, match=rf"^{path}: not valid TOML"):
        load_case(path)


def test_cases_command_lists_one_line_each_and_rejects_a_bad_file(tmp_path):
    _write(tmp_path, GOOD)
    ok = _ddcheck("cases", "--directory", str(tmp_path))
    assert ok.returncode == 0 and ok.stdout.count("\n") == 1 and "1 settings" not in ok.stdout
    assert ok.stdout.startswith("t ") and "2 settings" in ok.stdout and "padded-kv-visible" in ok.stdout
    (tmp_path / "bad.toml").write_text(GOOD.replace("topk = 1", "topk = 'one'"))
    bad = _ddcheck("cases", "--directory", str(tmp_path))
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().count("\n") == 0 and "bad.toml: key 'matrix[0].topk'" in bad.stderr


def test_default_cases_directory_lists_gate():
    out = _ddcheck("cases")
    assert out.returncode == 0 and out.stdout.startswith("gate ")


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "case.toml"
    path.write_text(text)
    return path


def _ddcheck(*args):
    return subprocess.run([sys.executable, "-c", "from harness.cli import main; main()", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("tol, passes", [(1e-9, False), (2e-2, True)])
def test_case_tolerance_is_what_the_nodes_are_judged_at(tmp_path, tol, passes):
    """[tolerances] sets the relative tolerance of that dtype's runs, tighter or looser than the default."""
    from harness.check.differential import check
    from harness.check.prepare import prepare
    from harness.check.records import RecordWriter
    case = load_case(_write(tmp_path, GOOD + f"[tolerances]\nfloat32 = {tol}\n"))
    settings = case.settings()
    assert settings and all(s.tolerance == tol for s in settings)
    s = settings[0]
    assert f"--tolerance {tol:g}" in s.command()
    summary = check(prepare(s, prompts_for(s)), RecordWriter(None), localize=False)
    assert summary.tolerance == tol and summary.passed is passes


def test_default_gate_judges_a_bf16_slice():
    """Arithmetic the engine's low-precision twin shares (issue 21: a softmax scale 3% off) shows only in low
    precision, through the run-level drift test: the default gate runs a bfloat16 slice."""
    settings = load_case(ROOT / DEFAULT_CASE).settings()
    short = [s for s in settings if s.dtype == "bfloat16" and not s.prompt_lens]
    assert {(s.cuda_graph, s.batch) for s in short} == {(g, b) for g in (True, False) for b in (2, 4)}


def test_default_gate_judges_bf16_on_a_long_prompt():
    """RoPE angles rounded to the run's dtype (issue 21, case d) grow with the position: the default gate runs
    one bfloat16 setting on a prompt of hundreds of tokens, reproducible without the case file."""
    (long,) = [s for s in load_case(ROOT / DEFAULT_CASE).settings() if s.prompt_lens]
    assert long.dtype == "bfloat16" and long.prompt_lens[0] >= 512 and long.case is None
    assert f"--prompt-len {long.prompt_lens[0]}" in long.command() and "--case" not in long.command()


def test_a_table_may_draw_its_own_long_prompt(tmp_path):
    """`prompt_len = N`: that table's settings run prompts of N tokens drawn from the seed (as --prompt-len N),
    the gate hands them no case prompts; the other tables keep the case's prompts."""
    from harness.workflows.gate import plan
    text = GOOD.replace("[[faults]]", '[[matrix]]\nlabel = "long"\nbudget = 8\nprompt_len = 300\n[[faults]]')
    case = load_case(_write(tmp_path, text))
    assert [(s.budget, s.prompt_lens, s.case) for s in case.settings()] == [
        (8, None, str(case.path)), (16, None, str(case.path)), (8, (300,), None)]
    jobs = plan([case])
    assert [j.prompts for j in jobs[:3]] == [case.prompts, case.prompts, None]
    from harness.check.prepare import prepare
    assert [len(ids) for ids in prepare(jobs[2].settings, jobs[2].prompts).prompt_ids] == [300]
