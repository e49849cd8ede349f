from harness.mem.pool import KVPool, ReqToTokenPool, SlotAllocator, OutOfSlots

__all__ = ["KVPool", "ReqToTokenPool", "SlotAllocator", "OutOfSlots"]
