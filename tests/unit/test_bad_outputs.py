"""Output paths are checked before any work: a directory, a path under a file,
an unwritable folder is exit 2 in one line, and nothing is written."""
from __future__ import annotations

import os

import pytest
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


# ---------------------------------------------------------------- outputs that are not regular files, or are inputs

def _kinds(tmp):
    """Output paths ddcheck must refuse, each with a function telling that it is still as it was."""
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    target = elsewhere / "precious.txt"
    target.write_text("keep me")
    fifo = tmp / "a.fifo"
    os.mkfifo(fifo)
    # a reader holds the FIFO open, so a broken implementation that writes into it never blocks the test
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    out_link, null_link, dangling = tmp / "out-link", tmp / "null-link", tmp / "dangling"
    out_link.symlink_to(target)
    null_link.symlink_to("/dev/null")   # a broken implementation replaces this link, never /dev/null itself
    dangling.symlink_to(tmp / "nowhere" / "x")
    import stat

    def unchanged(p, link_to=None):
        st = os.lstat(p)
        if link_to is not None:
            return stat.S_ISLNK(st.st_mode) and os.readlink(p) == str(link_to)
        return stat.S_ISFIFO(st.st_mode)
    kinds = {"a FIFO": (fifo, lambda: unchanged(fifo) and os.read(reader, 1) == b""),
             "a symlink out of its folder": (out_link, lambda: unchanged(out_link, target)
                                             and target.read_text() == "keep me"),
             "a symlink to /dev/null": (null_link, lambda: unchanged(null_link, "/dev/null")),
             "a dangling symlink": (dangling, lambda: unchanged(dangling, tmp / "nowhere" / "x")
                                    and not (tmp / "nowhere").exists())}
    return kinds, reader


def _output_commands(tmp):
    case = tmp / "c.toml"
    case.write_text('max_new_tokens = 2\n[[matrix]]\nbudget = [4]\n')
    records = tmp / "rec.jsonl"
    records.write_text('{"kind": "summary", "setting": "ddcheck run", "passed": true}\n')
    gate = ["gate", str(case), "--jobs", "1", "--device", "cpu"]
    return {
        "run --out": lambda p: ["run", *FAST, "--out", str(p)],
        "run --html": lambda p: ["run", *FAST, "--out", str(tmp / "ok.jsonl"), "--html", str(p)],
        "sweep --out": lambda p: ["sweep", "--budget", "4", "--backend", "torch", "--max-new-tokens", "2", "--jobs",
                                  "1", "--out", str(p)],
        "gate --out": lambda p: [*gate, "--out", str(p)],
        "gate --junit": lambda p: [*gate, "--out", str(tmp / "g.jsonl"), "--junit", str(p)],
        "gate --json": lambda p: [*gate, "--out", str(tmp / "g.jsonl"), "--json", str(p)],
        "gate --html": lambda p: [*gate, "--out", str(tmp / "g.jsonl"), "--html", str(p)],
        "report -o": lambda p: ["report", str(records), "-o", str(p)],
        "calibrate --out": lambda p: ["calibrate", str(case), "--out", str(p)],
        "faults --check --json": lambda p: ["faults", "--check", "--quick", "--seeds", "1", "--json", str(p)],
    }


def test_an_output_that_is_no_regular_file_is_refused_and_left_as_it_was(tmp_path):
    """A FIFO, a symbolic link (out of the output's folder, to /dev/null,
    dangling): exit 2 in one line before any work, the path left as it was."""
    kinds, reader = _kinds(tmp_path)
    try:
        for command, make in _output_commands(tmp_path).items():
            for kind, (p, still) in kinds.items():
                before = set(tmp_path.rglob("*"))
                r = CliRunner().invoke(app, make(p))
                name = f"{command} {kind}"
                assert r.exit_code == 2, (name, r.output)
                lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
                assert len(lines) == 1 and lines[0].startswith("ddcheck: error:"), (name, r.output)
                assert still(), name
                assert set(tmp_path.rglob("*")) == before, name   # nothing written, no temp or lock file
    finally:
        os.close(reader)


def test_reduce_refuses_an_output_folder_holding_a_fifo_or_link_where_it_writes(tmp_path):
    records = tmp_path / "rec.jsonl"
    records.write_text('{"kind": "summary", "setting": "ddcheck run", "passed": false}\n')
    for name in ("case.toml", "repro.py"):
        d = tmp_path / f"out-{name}"
        d.mkdir()
        (d / name).symlink_to("/dev/null")
        r = CliRunner().invoke(app, ["reduce", str(records), "--out", str(d)])
        assert r.exit_code == 2 and "symbolic link" in r.output, r.output
        assert os.readlink(d / name) == "/dev/null"


def test_a_character_device_is_refused_without_being_opened():
    """/dev/null itself is only ever inspected, never opened: the check that
    every command calls before any work refuses it."""
    import stat
    from harness.cli.common import check_outputs
    from harness.engine.settings import UsageError
    for flag in ("out", "html", "junit", "json"):
        with pytest.raises(UsageError, match="is a character device"):
            check_outputs(**{flag: "/dev/null"})
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def _checkpoint(tmp):
    from harness.engine.model.presets import checkpoint_dir
    ckpt = tmp / "ckpt"
    ckpt.mkdir()
    with checkpoint_dir("tiny", 0) as d:
        for f in d.iterdir():
            (ckpt / f.name).write_bytes(f.read_bytes())
    return ckpt


def test_an_output_that_is_also_an_input_is_refused_and_left_as_it_was(tmp_path):
    """The input checkpoint's files, the case, the prompt file, the records a
    report reads: exit 2 in one line, the input byte for byte as it was."""
    ckpt = _checkpoint(tmp_path)
    weights = next(ckpt.glob("*.safetensors"))
    case = tmp_path / "c.toml"
    case.write_text('max_new_tokens = 2\n[[matrix]]\nbudget = [4]\n')
    prompts = tmp_path / "p.json"
    prompts.write_text("[1, 2, 3]")
    records = tmp_path / "rec.jsonl"
    records.write_text('{"kind": "summary", "setting": "ddcheck run", "passed": true}\n')
    hard = tmp_path / "hard-link-to-case.toml"
    os.link(case, hard)
    gate = ["gate", str(case), "--jobs", "1", "--device", "cpu", "--out", str(tmp_path / "g.jsonl")]
    rows = {
        "run --out the checkpoint's weights": (["run", *FAST, "--model", str(ckpt), "--out", str(weights)], weights),
        "run --html the checkpoint's config": (["run", *FAST, "--model", str(ckpt), "--html", str(ckpt / "config.json"),
                                                "--out", str(tmp_path / "r.jsonl")], ckpt / "config.json"),
        "run --out the case": (["run", *FAST, "--case", str(case), "--out", str(case)], case),
        "run --out the prompt file": (["run", *FAST, "--prompt-file", str(prompts), "--out", str(prompts)], prompts),
        "sweep --out the checkpoint's weights": (["sweep", "--budget", "4", "--backend", "torch", "--max-new-tokens",
                                                  "2", "--jobs", "1", "--model", str(ckpt), "--out", str(weights)],
                                                 weights),
        "sweep --html the case": (["sweep", "--case", str(case), "--jobs", "1", "--out", str(tmp_path / "s.jsonl"),
                                   "--html", str(case)], case),
        "gate --junit the case": ([*gate, "--junit", str(case)], case),
        "gate --json a hard link to the case": ([*gate, "--json", str(hard)], case),
        "report -o its records": (["report", str(records), "-o", str(records)], records),
        "calibrate --out the checkpoint's config": (["calibrate", str(case), "--model", str(ckpt), "--out",
                                                     str(ckpt / "config.json")], ckpt / "config.json"),
    }
    for name, (argv, kept) in rows.items():
        before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
        r = CliRunner().invoke(app, argv)
        assert r.exit_code == 2, (name, r.output)
        lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
        assert len(lines) == 1 and "is also an input" in lines[0], (name, r.output)
        assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before, name
        assert kept.read_bytes() == before[kept], name
