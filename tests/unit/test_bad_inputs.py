"""Bad input across commands, one table: each row exits 2 with exactly one line
on stderr, no traceback, and writes nothing (no output file, no temporary
file). Every row fails before any engine work (issue 12)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from harness.cli import _register, app

_register()

TINY_HF = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}
CASE_OK = 'max_new_tokens = 2\n[[matrix]]\nbudget = [4]\n'
PORTS = Path(__file__).resolve().parents[1] / "fixtures" / "ports" / "broken"


def _inputs(tmp: Path) -> dict[str, Path]:
    """Bad input files, by name."""
    files = {}

    def text(name: str, body: str | bytes) -> None:
        p = tmp / name
        p.write_bytes(body) if isinstance(body, bytes) else p.write_text(body)
        files[name] = p

    def ckpt(name: str, **config) -> None:
        d = tmp / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**TINY_HF, **config}))
        (d / "model.safetensors").write_bytes(b"x")
        files[name] = d

    (tmp / "a_dir").mkdir()
    files["a_dir"] = tmp / "a_dir"
    text("not_utf8.toml", b'name = "\xff\xfe"\n[[matrix]]\nbudget = [4]\n')
    text("case_mnt0.toml", 'max_new_tokens = 0\n[[matrix]]\nbudget = [4]\n')
    text("case_budget_huge.toml", 'max_new_tokens = 2\n[[matrix]]\nbudget = [2000]\n')
    text("case_topk_huge.toml", 'max_new_tokens = 2\n[[matrix]]\ntopk = [100]\n')
    text("case_block_huge.toml", 'block_size = 100000\n[[matrix]]\nbudget = [4]\n')
    text("case_seed_neg.toml", 'seed = -1\n[[matrix]]\nbudget = [4]\n')
    text("case_prompt_huge.toml", CASE_OK + '[[prompts]]\nname = "p"\nlength = 1000000000\naccuracy = 0.5\n')
    text("case_name_int.toml", 'name = 5\n' + CASE_OK)
    text("case_matrix_int.toml", 'matrix = 5\n')
    text("case_batch_str.toml", 'max_new_tokens = 2\n[[matrix]]\nbatch = ["two"]\n')
    text("case_ok.toml", CASE_OK)
    text("binary.jsonl", bytes(range(256)) * 4)
    text("nested.jsonl", '{"kind": "summary", "x": ' + "[" * 100000 + "]" * 100000 + "}\n")
    text("setting_int.jsonl", '{"kind": "summary", "setting": 5, "passed": true}\n')
    text("step_str.jsonl", '{"kind": "node", "setting": "a", "step": "q", "request": 0, "node": 0}\n')
    text("first_int.jsonl", '{"kind": "summary", "setting": "a", "passed": false, "first": 3}\n')
    text("passed_str.jsonl", '{"kind": "summary", "setting": "a", "passed": "yes"}\n')
    text("list.jsonl", "[1, 2]\n")
    text("not_json.jsonl", "{kind: summary\n")
    text("prompts.json", "[1, 2, 3]")
    ckpt("heads0", num_attention_heads=0)
    ckpt("hidden_str", hidden_size="16")
    ckpt("hidden_odd", hidden_size=15, num_attention_heads=2)
    ckpt("eps_neg", rms_norm_eps=-1.0)
    ckpt("vocab0", vocab_size=0)
    ckpt("arch_int", architectures=5)
    ckpt("rope_str", rope_scaling="llama3")
    text("case_nested.toml", "a = " + "[" * 100000 + "]" * 100000 + "\n")
    # found before any work since issue 25 (they were found in a worker, after the outputs were touched)
    text("case_token_beyond_vocab.toml", CASE_OK + '[[prompts]]\nname = "big"\ntokens = [1, 2, 999999]\naccuracy = 0.5\n')
    ckpt("weights_garbage")   # a good config.json, a safetensors file that is no safetensors
    text("case_model_garbage.toml", f'model = "{tmp / "weights_garbage"}"\n' + CASE_OK)
    text("case_faults_only.toml", 'max_new_tokens = 2\n[[matrix]]\nbudget = [16]\nfault = "padded-kv-visible"\n')
    text("failing_run.jsonl", '{"kind": "summary", "setting": "ddcheck run", "passed": true}\n')
    text("kind_list.jsonl", '{"kind": ["summary"], "setting": "a"}\n')
    return files


FAST = ["--backend", "torch", "--max-new-tokens", "2", "--budget", "4"]


def _run(*flags: str):
    return lambda f, o: ["run", *FAST, *flags, "--out", str(o / "r.jsonl"), "--html", str(o / "r.html")]


def _run_with(make):
    return lambda f, o: ["run", *FAST, *make(f), "--out", str(o / "r.jsonl")]


def _sweep(*flags: str):
    return lambda f, o: ["sweep", "--backend", "torch", "--max-new-tokens", "2", "--jobs", "1",
                         *(x.format(**{k: v for k, v in f.items() if "." not in k}) for x in flags),
                         "--out", str(o / "s.jsonl"), "--html", str(o / "s.html")]


def _sweep_case(name: str):
    return lambda f, o: ["sweep", "--case", str(f[name]), "--jobs", "1", "--out", str(o / "s.jsonl")]


def _gate(case: str | None, *flags: str):
    return lambda f, o: ["gate", *([str(f[case])] if case else []), "--jobs", "1", *flags,
                         "--out", str(o / "g.jsonl"), "--junit", str(o / "g.xml"), "--json", str(o / "g.json"),
                         "--html", str(o / "g.html")]


def _faults(*flags: str):
    return lambda f, o: ["faults", *flags, "--json", str(o / "f.json")] if "--check" in flags else ["faults", *flags]


def _report(name: str):
    return lambda f, o: ["report", str(f[name]), "-o", str(o / "r.html")]


BAD = {
    # run: numeric limits
    "run budget 0": _run("--budget", "0"),
    "run budget 100000": _run("--budget", "100000"),
    "run topk 0": _run("--topk", "0"),
    "run topk 65": _run("--topk", "65"),
    "run block-size 1": _run("--block-size", "1"),
    "run block-size 100000": _run("--block-size", "100000"),
    "run batch 0": _run("--batch", "0"),
    "run batch 257": _run("--batch", "257"),
    "run max-new-tokens 0": _run("--max-new-tokens", "0"),
    "run max-new-tokens 1e8": _run("--max-new-tokens", "100000000"),
    "run seed -1": _run("--seed", "-1"),
    "run seed 2^70": _run("--seed", str(2 ** 70)),
    "run stop-after -1": _run("--stop-after", "-1"),
    "run stop-after 1e20": _run("--stop-after", str(10 ** 20)),
    "run eos-id -1": _run("--eos-id", "-1"),
    "run eos-id beyond vocab": _run("--eos-id", "100000"),
    "run tolerance 0": _run("--tolerance", "0"),
    "run tolerance 1.5": _run("--tolerance", "1.5"),
    "run tolerance nan": _run("--tolerance", "nan"),
    "run prompt-len 0": _run("--prompt-len", "0"),
    "run prompt-len abc": _run("--prompt-len", "abc"),
    "run prompt-len huge": _run("--prompt-len", str(10 ** 9)),
    # run: names and flags that only make sense together
    "run dtype float8": _run("--dtype", "float8"),
    "run accept greedy": _run("--accept", "greedy"),
    "run verdict nosuch": _run("--verdict", "nosuch"),
    "run noise-floor on float32": _run("--verdict", "noise-floor"),
    "run noise-floor with tolerance": _run("--dtype", "bfloat16", "--verdict", "noise-floor", "--tolerance", "0.01"),
    "run tf32 on bfloat16": _run("--tf32", "--dtype", "bfloat16"),
    "run tf32 on cpu": _run("--tf32", "--device", "cpu"),
    "run port-stages without impl": _run("--port-stages", "build"),
    "run oracle-device tpu": _run("--oracle-device", "tpu"),
    "run device tpu": _run("--device", "tpu"),
    "run fault nosuch": _run("--fault", "nosuch"),
    "run fault cannot show": _run("--fault", "padded-kv-visible", "--topk", "4"),
    "run model nosuch": _run("--model", "nosuch"),
    "run backend nosuch": _run("--backend", "nosuch"),
    "run impl nosuch": _run("--impl", "nosuch:/nowhere"),
    "run prompt-file missing": _run("--prompt-file", "/nonexistent/prompts.json"),
    "run prompt-len and prompt-file": _run_with(lambda f: ["--prompt-len", "5", "--prompt-file", str(f["prompts.json"])]),
    # run: impossible checkpoint configs
    "run config heads 0": _run_with(lambda f: ["--model", str(f["heads0"])]),
    "run config hidden_size a string": _run_with(lambda f: ["--model", str(f["hidden_str"])]),
    "run config hidden_size odd": _run_with(lambda f: ["--model", str(f["hidden_odd"])]),
    "run config rms_norm_eps < 0": _run_with(lambda f: ["--model", str(f["eps_neg"])]),
    "run config vocab 0": _run_with(lambda f: ["--model", str(f["vocab0"])]),
    "run config architectures a number": _run_with(lambda f: ["--model", str(f["arch_int"])]),
    "run config rope_scaling a string": _run_with(lambda f: ["--model", str(f["rope_str"])]),
    # run: bad case files
    "run case not utf-8": _run_with(lambda f: ["--case", str(f["not_utf8.toml"])]),
    "run case a directory": _run_with(lambda f: ["--case", str(f["a_dir"])]),
    "run case missing": _run_with(lambda f: ["--case", "/nonexistent/case.toml"]),
    "run case with prompt-len": _run_with(lambda f: ["--case", str(f["case_ok.toml"]), "--prompt-len", "5"]),
    # sweep
    "sweep budget 4,100000": _sweep("--budget", "4,100000"),
    "sweep budget a,b": _sweep("--budget", "a,b"),
    "sweep topk 0": _sweep("--topk", "0"),
    "sweep batch 1,300": _sweep("--batch", "1,300"),
    "sweep cuda-graph maybe": _sweep("--cuda-graph", "maybe"),
    "sweep dtype float8": _sweep("--dtype", "float8"),
    "sweep jobs -1": _sweep("--jobs", "-1"),
    "sweep jobs 100000": _sweep("--jobs", "100000"),
    "sweep block-size 100000": _sweep("--block-size", "100000"),
    "sweep seed -1": _sweep("--seed", "-1"),
    "sweep port-stages without impl": _sweep("--port-stages", "build"),
    "sweep fault nosuch": _sweep("--fault", "nosuch"),
    "sweep case and budget": lambda f, o: ["sweep", "--case", str(f["case_ok.toml"]), "--budget", "4",
                                           "--out", str(o / "s.jsonl")],
    "sweep case a directory": _sweep_case("a_dir"),
    "sweep case not utf-8": _sweep_case("not_utf8.toml"),
    "sweep case max_new_tokens 0": _sweep_case("case_mnt0.toml"),
    "sweep case budget 2000": _sweep_case("case_budget_huge.toml"),
    "sweep case block_size 100000": _sweep_case("case_block_huge.toml"),
    "sweep case seed -1": _sweep_case("case_seed_neg.toml"),
    "sweep case prompt length 1e9": _sweep_case("case_prompt_huge.toml"),
    "sweep case name an integer": _sweep_case("case_name_int.toml"),
    "sweep case matrix an integer": _sweep_case("case_matrix_int.toml"),
    "sweep case batch a string": _sweep_case("case_batch_str.toml"),
    # gate
    "gate case a directory": _gate("a_dir"),
    "gate case not utf-8": _gate("not_utf8.toml"),
    "gate case topk 100": _gate("case_topk_huge.toml"),
    "gate jobs 300": _gate("case_ok.toml", "--jobs", "300"),
    "gate fault nosuch": _gate("case_ok.toml", "--fault", "nosuch"),
    "gate device tpu": _gate("case_ok.toml", "--device", "tpu"),
    # faults
    "faults json without check": lambda f, o: ["faults", "--json", str(o / "f.json")],
    "faults quick without check": _faults("--quick"),
    "faults seeds without check": _faults("--seeds", "3"),
    "faults seeds 0": _faults("--check", "--seeds", "0"),
    "faults seeds 5000": _faults("--check", "--seeds", "5000"),
    "faults fault-seeds 0": _faults("--check", "--fault-seeds", "0"),
    "faults fault nosuch": _faults("--check", "--fault", "nosuch"),
    # report
    "report binary": _report("binary.jsonl"),
    "report deeply nested": _report("nested.jsonl"),
    "report kind a list": _report("kind_list.jsonl"),
    "gate case nested too deeply": _gate("case_nested.toml"),
    "report setting an integer": _report("setting_int.jsonl"),
    "report step a string": _report("step_str.jsonl"),
    "report first an integer": _report("first_int.jsonl"),
    "report passed a string": _report("passed_str.jsonl"),
    "report a list": _report("list.jsonl"),
    "report not JSON": _report("not_json.jsonl"),
    "report a directory": _report("a_dir"),
    # found in the parent before any work (issue 25): token ids, checkpoint headers, the port's import
    "sweep case token beyond vocab": _sweep_case("case_token_beyond_vocab.toml"),
    "gate case token beyond vocab": _gate("case_token_beyond_vocab.toml"),
    "sweep model weights not safetensors": _sweep("--model", "{weights_garbage}"),
    "gate case model weights not safetensors": _gate("case_model_garbage.toml"),
    "run impl exits at import": _run("--impl", f"ddtree-utils:{PORTS / 'exits_at_import.py'}"),
    "sweep impl exits at import": _sweep("--impl", f"ddtree-utils:{PORTS / 'exits_at_import.py'}"),
    "gate impl exits at import": _gate("case_ok.toml", "--impl", f"ddtree-utils:{PORTS / 'exits_at_import.py'}"),
    # calibrate and reduce
    "calibrate case missing": lambda f, o: ["calibrate", "/nonexistent/case.toml", "--out", str(o / "c.toml")],
    "calibrate no fault-free setting": lambda f, o: ["calibrate", str(f["case_faults_only.toml"]),
                                                     "--out", str(o / "c.toml")],
    "calibrate case a directory": lambda f, o: ["calibrate", str(f["a_dir"]), "--out", str(o / "c.toml")],
    "reduce records missing": lambda f, o: ["reduce", "/nonexistent/r.jsonl", "--out", str(o / "red")],
    "reduce records not JSON": lambda f, o: ["reduce", str(f["not_json.jsonl"]), "--out", str(o / "red")],
    "reduce records with no failing run": lambda f, o: ["reduce", str(f["failing_run.jsonl"]), "--out", str(o / "red")],
    "reduce out a file": lambda f, o: ["reduce", str(f["failing_run.jsonl"]), "--out", str(f["prompts.json"])],
}


def _files(root: Path) -> set[Path]:
    return set(root.rglob("*"))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return _inputs(tmp_path_factory.mktemp("inputs"))


def assert_exit_2_one_line(exit_code: int, stderr: str, stdout: str, name: str) -> None:
    assert exit_code == 2, (name, exit_code, stdout, stderr)
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("ddcheck: error: "), (name, stderr)
    assert "Traceback" not in stderr + stdout, name


def test_the_table_is_large_enough():
    assert len(BAD) >= 60


@pytest.mark.parametrize("name", BAD)
def test_bad_input_is_exit_2_in_one_line_writing_nothing(name, inputs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # default outputs (reports/...) would land here
    out = tmp_path / "out"
    inputs_before = _files(inputs["a_dir"].parent)
    r = CliRunner().invoke(app, BAD[name](inputs, out))
    assert_exit_2_one_line(r.exit_code, r.stderr, r.stdout, name)
    assert _files(tmp_path) == set(), (name, _files(tmp_path))   # no output, no temporary file
    assert _files(inputs["a_dir"].parent) == inputs_before, name


@pytest.mark.parametrize("threads", ["abc", "0", "100000"])
def test_bad_ddcheck_threads_is_exit_2_in_one_line(threads, tmp_path):
    """DDCHECK_THREADS is read by the console script itself, before any command."""
    out = tmp_path / "r.jsonl"
    proc = subprocess.run([sys.executable, "-c", "from harness.cli import main; main()", "run", *FAST,
                           "--out", str(out)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "DDCHECK_THREADS": threads})
    assert_exit_2_one_line(proc.returncode, proc.stderr, proc.stdout, threads)
    assert "DDCHECK_THREADS" in proc.stderr and not out.exists()
