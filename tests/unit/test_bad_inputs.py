"""One table of bad inputs across commands: each is exit 2, exactly one line on
stderr (`ddcheck: error: ...`), no traceback, and nothing written, found
before any engine work (so the whole table runs in seconds)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import harness.cli as cli

cli._register()

RUN = ["run", "--backend", "torch", "--max-new-tokens", "2", "--budget", "4"]
SWEEP = ["sweep", "--backend", "torch", "--max-new-tokens", "2", "--jobs", "1"]
HF = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
      "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}
SUMMARY = {"kind": "summary", "setting": "ddcheck run", "passed": True, "nodes_checked": 1}


class Inputs:
    """Bad files in the test's folder, made on first use."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp

    def file(self, name: str, data: bytes | str) -> str:
        p = self.tmp / name
        p.write_bytes(data if isinstance(data, bytes) else data.encode())
        return str(p)

    def folder(self, name: str = "a_folder") -> str:
        p = self.tmp / name
        p.mkdir(exist_ok=True)
        return str(p)

    def case(self, text: str) -> str:
        return self.file("case.toml", text)

    def records(self, *recs) -> str:
        return self.file("r.jsonl", "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in recs))

    def checkpoint(self, **changes) -> str:
        d = self.tmp / "ckpt"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**HF, **changes}))
        (d / "model.safetensors").write_bytes(b"x")
        return str(d)


def _case(body: str) -> str:
    return f"max_new_tokens = 2\n{body}\n[[matrix]]\nbudget = [4]\n"


# name -> argv built from the test's Inputs
TABLE = {
    # run: numeric limits
    "run --block-size 100000": lambda f: [*RUN, "--block-size", "100000"],
    "run --block-size 1": lambda f: [*RUN, "--block-size", "1"],
    "run --budget 0": lambda f: ["run", "--budget", "0"],
    "run --budget 100000": lambda f: ["run", "--budget", "100000"],
    "run --topk 0": lambda f: [*RUN, "--topk", "0"],
    "run --topk 100000": lambda f: [*RUN, "--topk", "100000"],
    "run --seed 2**70": lambda f: [*RUN, "--seed", str(2 ** 70)],
    "run --seed -1": lambda f: [*RUN, "--seed", "-1"],
    "run --seed 2**32": lambda f: [*RUN, "--seed", str(2 ** 32)],
    "run --batch 0": lambda f: [*RUN, "--batch", "0"],
    "run --batch 100000": lambda f: [*RUN, "--batch", "100000"],
    "run --max-new-tokens 0": lambda f: ["run", "--max-new-tokens", "0"],
    "run --max-new-tokens 10**9": lambda f: ["run", "--max-new-tokens", str(10 ** 9)],
    "run --stop-after -1": lambda f: [*RUN, "--stop-after", "-1"],
    "run --stop-after 2**70": lambda f: [*RUN, "--stop-after", str(2 ** 70)],
    "run --eos-id -1": lambda f: [*RUN, "--eos-id", "-1"],
    "run --eos-id 2**40": lambda f: [*RUN, "--eos-id", str(2 ** 40)],
    "run --tolerance 0": lambda f: [*RUN, "--tolerance", "0"],
    "run --tolerance 2": lambda f: [*RUN, "--tolerance", "2"],
    "run --tolerance nan": lambda f: [*RUN, "--tolerance", "nan"],
    "run --prompt-len 0": lambda f: [*RUN, "--prompt-len", "0"],
    "run --prompt-len huge": lambda f: [*RUN, "--prompt-len", str(10 ** 9)],
    "run --prompt-len letters": lambda f: [*RUN, "--prompt-len", "ten"],
    # run: other options and flags that only make sense together
    "run --dtype float8": lambda f: [*RUN, "--dtype", "float8"],
    "run --accept greedy": lambda f: [*RUN, "--accept", "greedy"],
    "run --verdict maybe": lambda f: [*RUN, "--verdict", "maybe"],
    "run --oracle-device tpu": lambda f: [*RUN, "--oracle-device", "tpu"],
    "run --device mps": lambda f: [*RUN, "--device", "mps"],
    "run --fault unknown": lambda f: [*RUN, "--fault", "no-such-fault"],
    "run --tf32 on bfloat16": lambda f: [*RUN, "--tf32", "--dtype", "bfloat16"],
    "run --port-stages without --impl": lambda f: [*RUN, "--port-stages", "build"],
    "run two prompt sources": lambda f: [*RUN, "--prompt-len", "8", "--case", f.case(_case(""))],
    "run --noise-rule on float32": lambda f: [*RUN, "--noise-rule", "2,1e-3,0.1"],
    # run: bad files
    "run --case not UTF-8": lambda f: [*RUN, "--case", f.file("bad.toml", b'name = "\xff\xfe"\n')],
    "run --case a directory": lambda f: [*RUN, "--case", f.folder()],
    "run --case missing": lambda f: [*RUN, "--case", str(f.tmp / "missing.toml")],
    "run --prompt-file a directory": lambda f: [*RUN, "--prompt-file", f.folder()],
    "run --prompt-file not UTF-8": lambda f: [*RUN, "--prompt-file", f.file("p.txt", b"\xff\xfe\x00")],
    "run --prompt-file negative ids": lambda f: [*RUN, "--prompt-file", f.file("p.json", "[1, -2]")],
    # run: impossible checkpoints
    "config num_attention_heads 0": lambda f: [*RUN, "--model", f.checkpoint(num_attention_heads=0)],
    "config num_attention_heads -4": lambda f: [*RUN, "--model", f.checkpoint(num_attention_heads=-4)],
    "config hidden_size a string": lambda f: [*RUN, "--model", f.checkpoint(hidden_size="16")],
    "config num_hidden_layers 10**9": lambda f: [*RUN, "--model", f.checkpoint(num_hidden_layers=10 ** 9)],
    "config vocab_size 0": lambda f: [*RUN, "--model", f.checkpoint(vocab_size=0)],
    "config num_key_value_heads 0": lambda f: [*RUN, "--model", f.checkpoint(num_key_value_heads=0)],
    "config architectures a number": lambda f: [*RUN, "--model", f.checkpoint(architectures=5)],
    "config rope_scaling a string": lambda f: [*RUN, "--model", f.checkpoint(rope_scaling="llama3")],
    # sweep
    "sweep --jobs -1": lambda f: [*SWEEP, "--jobs", "-1"],
    "sweep --jobs 100000": lambda f: [*SWEEP, "--jobs", "100000"],
    "sweep --budget 4,100000": lambda f: [*SWEEP, "--budget", "4,100000"],
    "sweep --topk 0": lambda f: [*SWEEP, "--topk", "0"],
    "sweep --batch 1,1000": lambda f: [*SWEEP, "--batch", "1,1000"],
    "sweep --block-size 100000": lambda f: [*SWEEP, "--block-size", "100000"],
    "sweep --seed 2**70": lambda f: [*SWEEP, "--seed", str(2 ** 70)],
    "sweep --budget letters": lambda f: [*SWEEP, "--budget", "a,b"],
    "sweep --case not UTF-8": lambda f: [*SWEEP, "--case", f.file("bad.toml", b'name = "\xff"\n')],
    "sweep --case a directory": lambda f: [*SWEEP, "--case", f.folder()],
    "sweep --case with --budget": lambda f: [*SWEEP, "--case", f.case(_case("")), "--budget", "4"],
    # gate and its case files
    "gate --jobs -1": lambda f: ["gate", f.case(_case("")), "--jobs", "-1"],
    "gate --jobs 100000": lambda f: ["gate", f.case(_case("")), "--jobs", "100000"],
    "gate case not UTF-8": lambda f: ["gate", f.file("bad.toml", b"max_new_tokens = 2 # \xff\n")],
    "gate case a directory": lambda f: ["gate", f.folder()],
    "gate case nested too deeply": lambda f: ["gate", f.case("a = " + "[" * 100_000 + "]" * 100_000)],
    "gate case not TOML": lambda f: ["gate", f.case("[[matrix]\n")],
    "gate case block_size 100000": lambda f: ["gate", f.case(_case("block_size = 100000"))],
    "gate case seed 2**62": lambda f: ["gate", f.case(_case(f"seed = {2 ** 62}"))],
    "gate case max_new_tokens 10**6": lambda f: ["gate", f.case("max_new_tokens = 1000000\n[[matrix]]\nbudget = [4]\n")],
    "gate case budget 100000": lambda f: ["gate", f.case("max_new_tokens = 2\n[[matrix]]\nbudget = [100000]\n")],
    "gate case topk 0": lambda f: ["gate", f.case("max_new_tokens = 2\n[[matrix]]\ntopk = [0]\n")],
    "gate case unknown key": lambda f: ["gate", f.case(_case("budgets = 4"))],
    "gate --fault unknown": lambda f: ["gate", f.case(_case("")), "--fault", "no-such-fault"],
    # faults
    "faults --check --seeds 0": lambda f: ["faults", "--check", "--seeds", "0"],
    "faults --check --seeds 100000": lambda f: ["faults", "--check", "--seeds", "100000"],
    "faults --check --fault-seeds 0": lambda f: ["faults", "--check", "--fault-seeds", "0"],
    "faults --check --fault-seeds 2**70": lambda f: ["faults", "--check", "--fault-seeds", str(2 ** 70)],
    "faults --fault unknown": lambda f: ["faults", "--fault", "no-such-fault"],
    # report
    "report binary": lambda f: ["report", f.file("bin.jsonl", bytes(range(256)) * 4)],
    "report a directory": lambda f: ["report", f.folder()],
    "report missing": lambda f: ["report", str(f.tmp / "missing.jsonl")],
    "report nested too deeply": lambda f: ["report", f.records('{"kind": "node", "a": ' + "[" * 100_000
                                                              + "]" * 100_000 + "}")],
    "report not JSON": lambda f: ["report", f.records("{not json")],
    "report a JSON list": lambda f: ["report", f.records([1, 2])],
    "report kind a list": lambda f: ["report", f.records({"kind": ["summary"]})],
    "report settings a number": lambda f: ["report", f.records({**SUMMARY, "settings": 3})],
    "report passed a string": lambda f: ["report", f.records({**SUMMARY, "passed": "yes"})],
    "report first a list": lambda f: ["report", f.records({**SUMMARY, "first": [1]})],
    "report first.step a string": lambda f: ["report", f.records({**SUMMARY, "first": {"step": "x"}})],
    "report node rel_err a word": lambda f: ["report", f.records({"kind": "node", "step": 0, "rel_err": "big"}, SUMMARY)],
    "report node step a float": lambda f: ["report", f.records({"kind": "node", "step": 0.5}, SUMMARY)],
    "report setting an object": lambda f: ["report", f.records({**SUMMARY, "setting": {"a": 1}})],
    "report interrupted total a string": lambda f: ["report", f.records({"kind": "interrupted", "total": "3"})],
    "report localize mask_probe a list": lambda f: ["report", f.records({"kind": "localize", "mask_probe": []},
                                                                        SUMMARY)],
    # click's own parse errors, one line too
    "run --budget sixteen": lambda f: [*RUN, "--budget", "sixteen"],
    "run --no-such-option": lambda f: [*RUN, "--no-such-option"],
    "run --seed with no value": lambda f: [*RUN, "--seed"],
    "sweep --jobs two": lambda f: [*SWEEP, "--jobs", "two"],
    "gate --json with no value": lambda f: ["gate", f.case(_case("")), "--json"],
    "faults --seeds 1.5": lambda f: ["faults", "--check", "--seeds", "1.5"],
    "report with no file": lambda f: ["report"],
    "no such command": lambda f: ["rnu", "--budget", "4"],
    # other commands
    "cases --directory missing": lambda f: ["cases", "--directory", str(f.tmp / "none")],
    "reduce binary records": lambda f: ["reduce", f.file("bin.jsonl", b"\xff\xfe" * 100)],
}


def test_the_table_is_large():
    assert len(TABLE) + len(BAD_THREADS) >= 60
    assert len({argv_name.split()[0] for argv_name in TABLE}) >= 6   # run, sweep, gate, faults, report, config...


def _written(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


@pytest.mark.parametrize("name", TABLE)
def test_bad_input_is_one_line_exit_2_with_nothing_written(name, tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)   # default outputs (reports/...) would land here
    argv = TABLE[name](Inputs(tmp_path))
    before = _written(tmp_path)
    r = CliRunner().invoke(cli.app, argv)
    assert r.exit_code == 2, (name, r.exit_code, r.output, r.exception)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddcheck: error: "), (name, r.stderr)
    assert "Traceback" not in r.output, name
    assert _written(tmp_path) == before, (name, _written(tmp_path) - before)


BAD_THREADS = ["0", "-2", "two", "", "100000", "1.5", str(2 ** 70)]


@pytest.mark.parametrize("value", BAD_THREADS)
def test_bad_ddcheck_threads_is_one_line_exit_2(value, tmp_path, monkeypatch, capsys):
    """DDCHECK_THREADS is read by the console script's own frame, before any command."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DDCHECK_THREADS", value)
    monkeypatch.setattr(sys, "argv", ["ddcheck", *RUN])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ddcheck: error: DDCHECK_THREADS"), err
    assert list(tmp_path.iterdir()) == []
