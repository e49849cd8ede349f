"""The seed's mask (PR #27509 v1): a bf16 additive bias handed to custom_mask as
it is. SGLang's kernels keep custom_mask != 0, so in deployment it was inverted;
ddcheck must say so on every backend, with the port's own tree and with
ddcheck's, and the run must fail (exit 1)."""
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from harness.cli import _register, app
from harness.engine.attn.sglang_triton import available

_register()
FIX = Path(__file__).resolve().parents[1] / "fixtures" / "ports" / "ddtree_utils"
BACKENDS = ["torch", pytest.param("sglang-triton", marks=pytest.mark.skipif(not available(), reason="no SGLang")),
            pytest.param("sglang-unified", marks=pytest.mark.skipif(not available(), reason="no SGLang"))]


def _run(tmp_path, fixture: str, *extra: str):
    out = tmp_path / "run.jsonl"
    args = ["run", "--impl", f"ddtree-utils:{FIX / fixture}", "--budget", "16", "--topk", "2",
            "--max-new-tokens", "6", "--out", str(out), *extra]
    res = CliRunner().invoke(app, args)
    records = [json.loads(x) for x in out.read_text().splitlines()]
    return res.exit_code, next(r for r in records if r["kind"] == "summary"), records


@pytest.mark.parametrize("stages", [[], ["--port-stages", "compile,accept,commit"]], ids=["own-build", "ddcheck-tree"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_additive_mask_handed_over_raw_fails_and_is_named_inverted(tmp_path, backend, stages):
    code, summary, records = _run(tmp_path, "additive_mask_raw.py", "--backend", backend, *stages)
    assert code == 1 and not summary["passed"]
    assert summary["fault_class"] == "inverted-mask", summary["explanation"]
    assert "complement of the tree's ancestor mask" in summary["explanation"]
    assert "bfloat16" in summary["explanation"]
    audit = [r for r in records if r["kind"] == "audit" and r["check"] == "mask-inverted"]
    assert audit and audit[0]["severity"] == "error"


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_faithful_twin_passes_on_the_same_setting(tmp_path, backend):
    """Same tree, same setting, the mask handed over as bool: a pass, so the verdict above is the encoding's."""
    code, summary, _ = _run(tmp_path, "faithful.py", "--backend", backend)
    assert code == 0 and summary["passed"] and summary["audit_errors"] == 0


@pytest.mark.skipif(not available(), reason="no SGLang")
@pytest.mark.parametrize("dtype, stages", [("bfloat16", []), ("float32", ["--port-stages", "compile,accept,commit"])],
                         ids=["own-build-bf16", "ddcheck-tree-f32"])
def test_the_seed_versions_api_gets_the_runs_dtype_and_fails_inverted(tmp_path, dtype, stages):
    """The issue's command on a fixture with the first version's API (a logits builder, a
    compile that takes the model's dtype and hands over an additive rectangle): the worker's
    dtype is the run's, and the mask reads inverted on SGLang's kernel."""
    code, summary, _ = _run(tmp_path, "seed_v1_api.py", "--backend", "sglang-triton", "--dtype", dtype, *stages)
    assert code == 1 and summary["fault_class"] == "inverted-mask", summary["explanation"]
    assert f"({dtype}, values" in summary["explanation"]
