"""--port-stages never substitutes a function the port's worker does not call:
the adapter reads the worker side of the checkout (parsed, never run) and
drives a stage only through a function that side names."""
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from harness.cli import _register, app
from harness.engine.pipeline import Pipeline
from harness.engine.settings import RunSettings
from harness.ports.attach import attach_port, check_port_stages
from harness.ports.protocol import PortError
from harness.ports.worker_calls import worker_calls

_register()
FIX = Path(__file__).resolve().parents[1] / "fixtures" / "ports"
CHECKOUT = FIX / "checkouts" / "legacy_helpers"
UTILS = CHECKOUT / "python" / "sglang" / "srt" / "speculative" / "ddtree_utils.py"


def test_the_worker_side_is_what_imports_the_port_by_any_spelling(tmp_path):
    port = tmp_path / "ddtree_utils.py"
    port.write_text("def a():\n    pass\n")
    (tmp_path / "worker.py").write_text(textwrap.dedent("""
        from sglang.srt.speculative.ddtree_utils import a, b as bee
        from sglang.srt.speculative import ddtree_utils as du
        du.c()
    """))
    (tmp_path / "info.py").write_text("import sglang.srt.speculative.ddtree_utils as u\nu.d()\n")
    (tmp_path / "unrelated.py").write_text("from other_utils import e\n")
    (tmp_path / "broken.py").write_text("def (:\n")
    calls = worker_calls(port)
    assert calls.files == ("info.py", "worker.py") and calls.names == {"a", "b", "c", "d"}


def test_a_port_file_alone_has_no_worker_to_consult():
    assert worker_calls(FIX / "ddtree_utils" / "faithful.py") is None   # its siblings never import it
    check_port_stages(f"ddtree-utils:{FIX / 'ddtree_utils' / 'faithful.py'}", "compile,accept,commit")


def test_asking_for_a_stage_whose_function_the_worker_never_calls_is_a_usage_error():
    with pytest.raises(PortError, match=r"never calls compile_ddtree_tree\(\).*ddtree_worker\.py"):
        check_port_stages(f"ddtree-utils:{CHECKOUT}", "compile,accept,commit")
    check_port_stages(f"ddtree-utils:{CHECKOUT}", "build")


def test_by_default_only_what_the_worker_calls_is_driven_and_the_rest_is_said():
    s = RunSettings(budget=8, topk=2, backend="torch", impl=f"ddtree-utils:{CHECKOUT}")
    _, run = attach_port(s, Pipeline(), 256)
    assert run.stages.stages == ("build",)
    assert run.not_driven == {"compile": "compile_ddtree_tree", "accept": "follow_verified_tree",
                              "commit": "compact_ddtree_kv_cache"}
    assert run.describe()["not_driven"] == run.not_driven and "ddtree_worker.py" in run.describe()["worker"]


def test_run_refuses_before_any_work_naming_what_the_worker_calls(tmp_path):
    out = tmp_path / "r.jsonl"
    res = CliRunner().invoke(app, ["run", "--impl", f"ddtree-utils:{CHECKOUT}", "--budget", "16", "--topk", "2",
                                   "--batch", "2", "--port-stages", "compile,accept,commit", "--out", str(out)])
    assert res.exit_code == 2 and not out.exists()
    assert "build_ddtree_tree, build_verify_layout" in res.output
