"""The tolerance a run is judged at follows what the backend multiplies in."""
from harness.attn import sglang_triton
from harness.compare.tolerance import REL_TOL, matmul_precision, rel_tolerance


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


def test_tf32_sits_between_float32_and_half():
    """TF32's 10-bit mantissa: looser than float32, tighter than bf16."""
    assert REL_TOL["float32"] < REL_TOL["tf32"] < REL_TOL["bfloat16"]
