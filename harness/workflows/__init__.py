"""The workflows built on the check: case files, sweeps, the CI gate,
calibration, reduction to a repro, the fault self-test.

Layer: workflows. Imports report, the check and below; never cli."""
