"""The tolerance a run is judged at follows what the backend multiplies in."""
import json

import pytest

from harness.engine.attn import sglang_triton
from harness.check.differential import check
from harness.check.prepare import prepare
from harness.verdict.tolerance import REL_TOL, matmul_precision, rel_tolerance
from harness.check.records import RecordWriter
from harness.engine.settings import RunSettings


class _PlainBackend:
    name = "plain"


def test_backend_without_declaration_is_judged_by_dtype():
    """A user's backend that declares nothing gets its run dtype's tolerance."""
    assert matmul_precision("float32", _PlainBackend()) == "float32"
    assert rel_tolerance(matmul_precision("bfloat16", _PlainBackend())) == REL_TOL["bfloat16"]


def test_sglang_kernel_float32_on_cuda_is_tf32():
    """Triton's float32 tl.dot is TF32 on CUDA: SGLang's kernel is judged at the TF32 tolerance there."""
    backend = object.__new__(sglang_triton.SGLangTritonBackend)
    backend.interpret = False  # natively on CUDA
    assert matmul_precision("float32", backend) == "tf32"
    assert matmul_precision("bfloat16", backend) == "bfloat16"
    backend.interpret = True   # the interpreter multiplies in IEEE float32
    assert matmul_precision("float32", backend) == "float32"


class _RoundingBackend:
    """The run's torch backend, its attention output off by 1e-3 relative
    (TF32-sized rounding), declaring `precision` as the given name."""

    def __init__(self, inner, precision: str) -> None:
        self.inner, self._precision = inner, precision

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def precision(self, dtype: str) -> str:
        return self._precision

    def forward(self, *args, **kwargs):
        return self.inner.forward(*args, **kwargs) * 1.001


@pytest.mark.parametrize("precision,passes", [("tf32", True), ("float32", False)])
def test_tf32_backend_is_judged_at_the_tf32_tolerance(precision, passes):
    """A float32 run whose backend declares TF32 is judged at REL_TOL["tf32"]:
    TF32-sized errors (about 8e-4 here) pass, where a float32 backend's fail."""
    p = prepare(RunSettings(backend="torch", max_new_tokens=2))
    p.engine.backend = _RoundingBackend(p.engine.backend, precision)
    assert p.tolerance == REL_TOL[precision]
    writer = RecordWriter(None)
    summary = check(p, writer, localize=False)
    assert summary.tolerance == REL_TOL[precision]
    assert REL_TOL["float32"] < summary.max_rel_err < REL_TOL["tf32"]
    assert summary.passed is passes and (summary.divergent_nodes == 0) is passes
    assert json.loads(writer.lines[-1])["tolerance"] == REL_TOL[precision]
