"""Error paths of the command line: environment errors exit 2 in one line,
a crash of the engine under test exits 1 with its records kept."""
import json

import pytest
from typer.testing import CliRunner

import harness.cli as cli
from harness.cli.common import exit_usage, pick_device
from harness.check.oracle_lookup import OracleUnavailable, load_oracle_class
from harness.engine.settings import UsageError

cli._register()


@pytest.mark.parametrize("device", ["foo", "mps", "cuda:x"])
def test_bad_device_is_a_usage_error(device):
    """--device must name cpu or cuda; anything else is refused before a run."""
    with pytest.raises(UsageError):
        pick_device(device)


def test_usage_error_outside_a_command_exits_2_in_one_line(monkeypatch, capsys, tmp_path):
    """main() maps a usage error that escapes typer to exit 2 and one stderr line, no traceback."""
    def boom(**_):
        raise UsageError("bad case file")
    monkeypatch.setattr(cli, "app", boom)
    # as the watchdog's child (harness/cli/watchdog.py), so main() runs the command in this process
    monkeypatch.setenv("DDCHECK_FAULT_DUMP", str(tmp_path / "fault.txt"))
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.strip() == "ddcheck: error: bad case file"


def test_exit_usage_exits_2():
    """exit_usage is a real process exit, not a typer exception."""
    with pytest.raises(SystemExit) as e:
        exit_usage(ValueError("x"))
    assert e.value.code == 2


def test_unregistered_oracle_is_an_environment_error():
    """No oracle on the entry point is OracleUnavailable (exit 2 in the CLI)."""
    with pytest.raises(OracleUnavailable):
        load_oracle_class("no-such-oracle")


def test_engine_crash_exits_1_and_keeps_a_failing_summary(tmp_path, monkeypatch):
    """A crash inside the engine under test is a finding: exit 1, records written, summary names the error."""
    from harness.engine import loop as engine_mod

    def crash(self, step, active):
        raise RuntimeError("illegal memory access")
    monkeypatch.setattr(engine_mod.Engine, "_round", crash)
    out = tmp_path / "run.jsonl"
    result = CliRunner().invoke(cli.app, ["run", "--backend", "torch", "--max-new-tokens", "4", "--out", str(out)])
    assert result.exit_code == 1
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records[-1]["kind"] == "summary" and records[-1]["passed"] is False
    assert "illegal memory access" in records[-1]["error"]


def test_setting_command_reproduces_the_setting(tmp_path):
    """The `setting` a record carries, run again, gives back exactly the same settings."""
    from harness.engine.settings import RunSettings
    s = RunSettings(budget=8, topk=2, cuda_graph=True, backend="torch", batch=2, max_new_tokens=4,
                    block_size=5, seed=3, dtype="float32", accept="walk", device="cpu", tolerance=1e-3)
    out = tmp_path / "r.jsonl"
    args = s.command().split()[2:] + ["--out", str(out)]
    assert CliRunner().invoke(cli.app, ["run", *args]).exit_code == 0
    summary = json.loads(out.read_text().splitlines()[-1])
    assert summary["settings"] == s.to_dict()
