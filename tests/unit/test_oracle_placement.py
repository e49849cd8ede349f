"""Where the engine's weights and the float64 oracle go (harness/check/oracle_placement.py)."""
import torch

from harness.check.oracle_placement import engine_bytes_to_come, place_weights


def test_weights_already_on_the_device_in_the_run_dtype_add_nothing():
    w = {"a": torch.zeros(3, 4, dtype=torch.bfloat16), "b": torch.zeros(5, dtype=torch.float32)}
    # a: kept as it is; b: the engine makes a bf16 copy of 5 elements
    assert engine_bytes_to_come(w, "cpu", torch.bfloat16) == 5 * 2
    assert engine_bytes_to_come(w, "cpu", torch.float32) == 12 * 4
    assert engine_bytes_to_come(w, "meta", torch.bfloat16) == 17 * 2    # elsewhere: every tensor comes over


def test_placing_on_the_cpu_keeps_the_tensors():
    w = {"a": torch.ones(2, dtype=torch.bfloat16)}
    a = w["a"]
    placed = place_weights(w, "cpu")
    assert placed["a"] is a and placed["a"].dtype == torch.bfloat16


def test_placing_elsewhere_moves_every_tensor_in_its_own_dtype():
    w = {"a": torch.ones(2, dtype=torch.bfloat16), "b": torch.ones(3, dtype=torch.float32)}
    placed = place_weights(w, "meta")
    assert {n: (t.device.type, t.dtype) for n, t in placed.items()} == {
        "a": ("meta", torch.bfloat16), "b": ("meta", torch.float32)}
    assert w == {}   # the host tensors are let go as they move
