"""Output paths are checked before any work: a directory, a path under a file,
an unwritable folder is exit 2 in one line, and nothing is written."""
from __future__ import annotations

import os

from typer.testing import CliRunner

from harness.cli import _register, app

_register()
FAST = ["--backend", "torch", "--max-new-tokens", "2", "--budget", "4"]


def _cases(tmp):
    a_file = tmp / "a_file"
    a_file.write_text("x")
    a_dir = tmp / "a_dir"
    a_dir.mkdir()
    locked = tmp / "locked"
    locked.mkdir()
    os.chmod(locked, 0o500)
    case = tmp / "c.toml"
    case.write_text('max_new_tokens = 2\n[[matrix]]\nbudget = [4]\n')
    bad_paths = {"a directory": a_dir, "under a file": a_file / "x.out", "unwritable": locked / "x.out"}
    commands = {
        "run --out": lambda p: ["run", *FAST, "--out", str(p)],
        "run --html": lambda p: ["run", *FAST, "--out", str(tmp / "ok.jsonl"), "--html", str(p)],
        "sweep --out": lambda p: ["sweep", "--budget", "4", "--backend", "torch", "--max-new-tokens", "2", "--jobs", "1",
                                  "--out", str(p)],
        "sweep --html": lambda p: ["sweep", "--budget", "4", "--backend", "torch", "--max-new-tokens", "2", "--jobs", "1",
                                   "--out", str(tmp / "s.jsonl"), "--html", str(p)],
        "gate --out": lambda p: ["gate", str(case), "--jobs", "1", "--device", "cpu", "--out", str(p)],
        "gate --junit": lambda p: ["gate", str(case), "--jobs", "1", "--device", "cpu", "--out", str(tmp / "g.jsonl"),
                                   "--junit", str(p)],
        "gate --json": lambda p: ["gate", str(case), "--jobs", "1", "--device", "cpu", "--out", str(tmp / "g.jsonl"),
                                  "--json", str(p)],
        "gate --html": lambda p: ["gate", str(case), "--jobs", "1", "--device", "cpu", "--out", str(tmp / "g.jsonl"),
                                  "--html", str(p)],
        "report -o": lambda p: ["report", str(a_file), "-o", str(p)],
        "faults --check --json": lambda p: ["faults", "--check", "--quick", "--seeds", "1", "--json", str(p)],
    }
    return [(f"{c} {why}", make(p), tmp) for c, make in commands.items() for why, p in bad_paths.items()]


def test_bad_output_paths_exit_2_before_any_work(tmp_path):
    cases = _cases(tmp_path)
    assert len(cases) == 30
    root = os.geteuid() == 0
    for name, argv, tmp in cases:
        if root and "unwritable" in name:
            continue   # root writes through permission bits
        before = {p for p in tmp.rglob("*")}
        r = CliRunner().invoke(app, argv)
        assert r.exit_code == 2, (name, r.output)
        lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
        assert len(lines) == 1 and "Traceback" not in r.output and lines[0].startswith("ddcheck: error:"), (name, r.output)
        assert {p for p in tmp.rglob("*")} == before, name   # nothing written, no temp file left


def test_bad_model_inputs_are_input_errors_not_engine_crashes(tmp_path):
    """A prompt token beyond the vocabulary and a checkpoint with NaN weights:
    exit 2, one line, before the engine runs."""
    import torch
    from safetensors.torch import load_file, save_file
    from harness.engine.model.presets import checkpoint_dir
    case = tmp_path / "c.toml"
    case.write_text('max_new_tokens = 2\n[[prompts]]\nname = "big"\ntokens = [1, 2, 999999]\naccuracy = 0.5\n'
                    '[[matrix]]\nbudget = [4]\n')
    out = tmp_path / "s.jsonl"
    r = CliRunner().invoke(app, ["sweep", "--case", str(case), "--jobs", "1", "--out", str(out)])
    assert r.exit_code == 2 and "outside the model's vocabulary" in r.output, r.output
    assert not out.exists()
    with checkpoint_dir("tiny", 0) as d:
        ckpt = tmp_path / "nan"
        ckpt.mkdir()
        for f in d.iterdir():
            (ckpt / f.name).write_bytes(f.read_bytes())
    st = next(ckpt.glob("*.safetensors"))
    tensors = load_file(st)
    name = next(k for k, v in tensors.items() if v.is_floating_point())
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, st)
    r = CliRunner().invoke(app, ["run", "--model", str(ckpt), *FAST, "--out", str(tmp_path / "r.jsonl")])
    assert r.exit_code == 2 and "non-finite" in r.output, r.output
    assert not (tmp_path / "r.jsonl").exists()
