"""SGLang's serving-side classes (ForwardBatch, TritonAttnBackend, RadixAttention,
the KV pools, the verify inputs, the attention test kit's MockModelRunner), imported
once for the sglang-serving backends, with the one runtime shim their import chain
needs on a machine without torchvision.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types
from dataclasses import dataclass
from typing import Any

from harness.engine.attn.base import BackendUnavailable
from harness.engine.attn.sglang_triton import _one_line, prepare_interpreter

SERVING_HINT = ("pip install --no-deps sglang==0.5.23 and the packages of the Makefile's SGLANG_SERVING "
                "(make setup installs them)")


@dataclass(frozen=True)
class ServingAPI:
    """The SGLang classes a served forward is built from (one import, passed around)."""

    ForwardBatch: Any
    ForwardMode: Any
    CaptureHiddenMode: Any
    ForwardContext: Any
    forward_context: Any
    TritonAttnBackend: Any
    RadixAttention: Any
    MHATokenToKVPool: Any
    MockModelRunner: Any
    TinyModelConfig: Any
    DenseAttentionCase: Any
    EagleVerifyInput: Any
    DFlashVerifyInput: Any
    SpeculativeAlgorithm: Any


def _placeholder_torchvision() -> None:
    """WHY: sglang.srt.configs imports every model config at package import, and two of them
    (nano_nemotron_vl through multimodal/internvl_utils, deepseek_ocr) import torchvision at
    module level for image preprocessing that a verify forward never runs. torchvision has no
    CPU wheel matching the pinned torch here, so an empty placeholder stands in for it: it holds
    only the one name those modules read at import (InterpolationMode); any real use of it
    fails loudly with AttributeError. transformers decides once (cached) whether torchvision
    exists: that check runs first, so transformers never mistakes the placeholder for the
    real package. Installed only when torchvision is absent."""
    if importlib.util.find_spec("torchvision") is not None:
        return
    from transformers.utils import import_utils
    import_utils.is_torchvision_available()   # cache "absent" before the placeholder exists

    class InterpolationMode:   # the enum member internvl_utils names in a default argument
        BICUBIC = "bicubic"

    names = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")
    for name in names:
        module = types.ModuleType(name, "placeholder for SGLang's import chain (harness/engine/attn/sglang_runtime.py)")
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        module.InterpolationMode = InterpolationMode
        sys.modules[name] = module
    sys.modules[names[0]].transforms = sys.modules[names[1]]
    sys.modules[names[1]].functional = sys.modules[names[2]]


def import_serving() -> ServingAPI:
    """The classes, or BackendUnavailable naming what is missing and how to install it."""
    prepare_interpreter()
    try:
        _placeholder_torchvision()
        fb = importlib.import_module("sglang.srt.model_executor.forward_batch_info")
        ctx = importlib.import_module("sglang.srt.model_executor.forward_context")
        kit = importlib.import_module("sglang.test.kits.attention_unittest.attention_methods.dense_attention")
        return ServingAPI(
            ForwardBatch=fb.ForwardBatch, ForwardMode=fb.ForwardMode, CaptureHiddenMode=fb.CaptureHiddenMode,
            ForwardContext=ctx.ForwardContext, forward_context=ctx.forward_context,
            TritonAttnBackend=importlib.import_module("sglang.srt.layers.attention.triton_backend").TritonAttnBackend,
            RadixAttention=importlib.import_module("sglang.srt.layers.radix_attention").RadixAttention,
            MHATokenToKVPool=importlib.import_module("sglang.srt.mem_cache.memory_pool").MHATokenToKVPool,
            MockModelRunner=kit.MockModelRunner, TinyModelConfig=kit.TinyModelConfig,
            DenseAttentionCase=kit.DenseAttentionCase,
            EagleVerifyInput=importlib.import_module("sglang.srt.speculative.eagle_info").EagleVerifyInput,
            DFlashVerifyInput=importlib.import_module("sglang.srt.speculative.dflash_info").DFlashVerifyInput,
            SpeculativeAlgorithm=importlib.import_module("sglang.srt.speculative.spec_info").SpeculativeAlgorithm)
    except Exception as e:  # noqa: BLE001  (any failure of SGLang's serving import chain is "unavailable")
        raise BackendUnavailable(f"SGLang's serving path does not import ({type(e).__name__}: {_one_line(e)}); "
                                 f"{SERVING_HINT}") from None


def available() -> bool:
    try:
        import_serving()
        return True
    except BackendUnavailable:
        return False
