"""Click's own parse errors are usage errors like the rest: exit 2, exactly
one stderr line `ddcheck: error: ...`, no usage banner, no framed box, no
traceback, nothing written; a bare `ddcheck` still shows the help."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

import harness.cli as cli

cli._register()
RUN = ["run", "--backend", "torch", "--max-new-tokens", "2", "--budget", "4"]

PARSE_ERRORS = {
    "run --budget sixteen": [*RUN, "--budget", "sixteen"],
    "run --no-such-option": [*RUN, "--no-such-option"],
    "run --seed with no value": [*RUN, "--seed"],
    "run --tolerance a word": [*RUN, "--tolerance", "small"],
    "sweep --jobs two": ["sweep", "--jobs", "two"],
    "gate --json with no value": ["gate", "--json"],
    "faults --seeds 1.5": ["faults", "--check", "--seeds", "1.5"],
    "report with no file": ["report"],
    "no such command": ["rnu", "--budget", "4"],
}


@pytest.mark.parametrize("name", PARSE_ERRORS)
def test_a_parse_error_is_one_line_exit_2(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli.app, PARSE_ERRORS[name])
    assert r.exit_code == 2, (name, r.exit_code, r.output)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddcheck: error: "), (name, r.stderr)
    assert "Traceback" not in r.output and "Usage:" not in r.output, name
    assert list(tmp_path.iterdir()) == [], name


def test_a_bare_ddcheck_still_shows_the_help():
    r = CliRunner().invoke(cli.app, [])
    assert "Usage:" in r.output and "gate" in r.output
