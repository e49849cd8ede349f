from harness.engine.mem.allocator import OutOfSlots, SlotAllocator
from harness.engine.mem.pool import KVPool, ReqToTokenPool

__all__ = ["KVPool", "ReqToTokenPool", "SlotAllocator", "OutOfSlots"]
