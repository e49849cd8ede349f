"""SGLang's own Triton extend-attention kernel, fed the target-verify metadata
its Triton backend builds. On a machine without CUDA it runs under the Triton
interpreter in float32 (bf16 tl.dot is wrong in the interpreter).

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

import importlib
import inspect
import os
import sys

import torch

from harness.engine.attn.base import PLAIN, BackendUnavailable, LayerAttention
from harness.engine.attn.bounds import check_kernel_reads
from harness.engine.ddtree.verify_inputs import AttnMetadata

MODULE_PATHS = (
    "sglang.kernels.ops.attention.extend_attention",               # 0.5.15 and newer
    "sglang.srt.layers.attention.triton_ops.extend_attention",     # 0.5.9 and older
)
INSTALL_HINT = "pip install --no-deps sglang==0.5.23 (see the README's setup)"
REQUIRED_PARAMS = ("custom_mask", "mask_indptr", "skip_prefix_custom_mask")


def use_interpreter() -> bool:
    return not torch.cuda.is_available()


def prepare_interpreter() -> None:
    """TRITON_INTERPRET must be set before triton is first imported."""
    if use_interpreter() and os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:
            raise BackendUnavailable("triton was imported before TRITON_INTERPRET=1 could be set; "
                                     "run with TRITON_INTERPRET=1 in the environment")
        os.environ["TRITON_INTERPRET"] = "1"


def _one_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _import_kernel():
    """extend_attention_fwd from the first module path that imports; a
    BackendUnavailable naming the install command when none does, or when the
    kernel predates the arguments verify needs (custom mask, prefix skip)."""
    prepare_interpreter()
    errors = []
    for path in MODULE_PATHS:
        try:
            fwd = importlib.import_module(path).extend_attention_fwd
        except Exception as e:  # noqa: BLE001  (any failure of SGLang's import chain is "unavailable")
            errors.append(f"{path}: {_one_line(e)}")
            continue
        missing = [p for p in REQUIRED_PARAMS if p not in inspect.signature(fwd).parameters]
        if missing:
            raise BackendUnavailable(f"SGLang is too old: {path}.extend_attention_fwd has no "
                                     f"{', '.join(missing)}; {INSTALL_HINT}")
        return fwd
    raise BackendUnavailable(f"SGLang's extend_attention kernel does not import ({errors[0]}); {INSTALL_HINT}")


def float32_dots(tf32: bool) -> str:
    """How Triton multiplies float32 tl.dot from now on in this process: IEEE
    float32 unless TF32 is asked for (Triton reads TRITON_F32_DEFAULT when a
    kernel compiles, so this runs before the run's first kernel)."""
    os.environ["TRITON_F32_DEFAULT"] = "tf32" if tf32 else "ieee"
    return os.environ["TRITON_F32_DEFAULT"]


def kernel_extras(layer_attn: LayerAttention, device) -> dict:
    """SGLang's `logit_cap` and `sinks` arguments for a layer (only what the layer sets)."""
    extras = {}
    if layer_attn.logit_cap > 0:
        extras["logit_cap"] = float(layer_attn.logit_cap)
    if layer_attn.sinks is not None:
        extras["sinks"] = layer_attn.sinks.to(device=device, dtype=torch.float32).contiguous()  # [heads]
    return extras


def available() -> bool:
    try:
        _import_kernel()
        return True
    except BackendUnavailable:
        return False


class SGLangTritonBackend:
    name = "sglang-triton"
    # skip_prefix_custom_mask=True: the kernel never reads the prefix columns
    mask_regions = frozenset({"draft"})
    graph_capturable = True
    reads_max_kv_len = False  # the kernel takes no prefix bound: it walks kv_indptr
    runs_mla = True           # the extend kernel takes K and V of different widths (Lq, Lv), as SGLang's MLA calls it

    def __init__(self, device: str, dtype: torch.dtype) -> None:
        # Natively on CUDA in the run's dtype; on CPU under the interpreter in float32.
        self.interpret = not device.startswith("cuda")
        if self.interpret and not use_interpreter() and os.environ.get("TRITON_INTERPRET") != "1":
            raise BackendUnavailable("sglang-triton on --device cpu needs the Triton interpreter on a CUDA "
                                     "machine: set TRITON_INTERPRET=1 in the environment, or use --device cuda")
        self._fwd = _import_kernel()
        params = inspect.signature(self._fwd).parameters
        self._takes_scales = "k_scale" in params  # positional since 0.5.15
        self.compute_dtype = torch.float32 if self.interpret else dtype
        # the kernel's tl.dot(p.to(v.dtype), v): exp(s - max) rounded to the value dtype before P @ V
        self.probability_dtype = self.compute_dtype if self.compute_dtype in (torch.bfloat16, torch.float16) else None

    def precision(self, dtype: str) -> str:
        """Triton's float32 tl.dot multiplies in TF32 on CUDA (not in the interpreter)
        unless TRITON_F32_DEFAULT=ieee was set before it compiled (float32_dots)."""
        ieee = os.environ.get("TRITON_F32_DEFAULT") == "ieee"
        return "tf32" if dtype == "float32" and not self.interpret and not ieee else dtype

    def key_tiles(self, prefix_len: int, head_dim: int) -> int | None:
        """Prefix key tiles one query block walks: ceil(prefix / BLOCK_N), with
        BLOCK_N as SGLang's own block-size rule picks it on this GPU (None
        where the rule needs a GPU it cannot see, as under the interpreter)."""
        try:
            module = importlib.import_module(self._fwd.__module__)
            block_n = module._get_block_sizes_for_extend_attention(head_dim, head_dim)[4]
        except Exception:  # noqa: BLE001  (a figure for the summary, never a verdict)
            return None
        return -(-prefix_len // block_n)

    def forward(self, q, k, v, layer, k_buffer, v_buffer, meta: AttnMetadata,
                layer_attn: LayerAttention = PLAIN) -> torch.Tensor:
        if self.interpret:   # an interpreted read past a buffer kills the process (attn/bounds.py)
            check_kernel_reads(meta, q.shape[0], k_buffer.shape[0])
        cd = self.compute_dtype
        q_, k_, v_ = q.to(cd).contiguous(), k.to(cd).contiguous(), v.to(cd).contiguous()
        o = q_.new_empty(q_.shape[:-1] + v_.shape[-1:])   # [T, heads, v width]
        args = [q_, k_, v_, o, k_buffer.to(cd), v_buffer.to(cd), meta.qo_indptr, meta.kv_indptr,
                meta.kv_indices, meta.custom_mask, meta.custom_mask is None, meta.mask_indptr,
                meta.max_len_extend]
        if self._takes_scales:
            args += [1.0, 1.0]
        # a sliding-window layer's mask carries the window in its prefix columns (meta.prefix_mask): the kernel
        # must read them; its own sliding_window_size would bound rows by their flat index, not their depth
        self._fwd(*args, sm_scale=layer_attn.sm_scale(q.shape[-1]), skip_prefix_custom_mask=not meta.prefix_mask,
                  **kernel_extras(layer_attn, q.device))
        return o.to(q.dtype)

