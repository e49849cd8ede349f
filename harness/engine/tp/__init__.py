"""Tensor parallelism in the engine under test (issue 22 point 1): the model's
heads and MLP sharded over N ranks of a torch.distributed group (gloo on the
CPU, NCCL on GPUs), each rank building its own verify metadata as a server
rank does, rank 0's rounds streamed back to the check.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
