"""KV memory in SGLang's layout: slots, pages, the pool, provenance.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from harness.engine.mem.allocator import OutOfSlots, SlotAllocator
from harness.engine.mem.pool import KVPool, ReqToTokenPool

__all__ = ["KVPool", "ReqToTokenPool", "SlotAllocator", "OutOfSlots"]
