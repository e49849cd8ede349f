"""The engine under test: a DDTree verify engine laid out as SGLang lays out
target-verify (model, attention backends, DDTree stages, KV memory, CUDA
graph runner), its run settings, and the loop that ties the stages.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
