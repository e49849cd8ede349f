"""A port that raises inside its own code under the installed SGLang gets a
verdict of its own: exit 4, the port's file:line and the SGLang version, never
a divergence (exit 1) with the adapter's line, never a pass."""
import json
from pathlib import Path

from typer.testing import CliRunner

from harness.check.crash import installed_sglang
from harness.cli import _register, app

_register()
PORT = Path(__file__).resolve().parents[1] / "fixtures" / "ports" / "ddtree_utils" / "raises_in_own_code.py"


def test_a_port_raising_in_its_own_code_exits_4_naming_its_line_and_sglang(tmp_path):
    out = tmp_path / "run.jsonl"
    res = CliRunner().invoke(app, ["run", "--impl", f"ddtree-utils:{PORT}", "--budget", "8", "--topk", "2",
                                   "--backend", "torch", "--max-new-tokens", "4", "--out", str(out)])
    assert res.exit_code == 4, res.output
    records = [json.loads(x) for x in out.read_text().splitlines()]
    summary = records[-1]
    assert summary["verdict"] == "port-error" and not summary["passed"] and summary["first"] is None
    (crash,) = [r for r in records if r["kind"] == "crash"]
    line = next(i for i, t in enumerate(PORT.read_text().splitlines(), 1) if "the line the verdict must name" in t)
    assert crash["side"] == "port" and f"ddtree_utils/{PORT.name}:{line} (build_ddtree_tree)" in crash["where"]
    assert crash["sglang"] == installed_sglang() and "harness/ports/families" not in crash["where"]
    (said,) = [ln for ln in res.output.splitlines() if ln.startswith("ddcheck: the port under test raised")]
    assert f"under SGLang {installed_sglang()}" in said and "not a divergence, not a pass" in said
