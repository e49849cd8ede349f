"""The DDTree method as plain stages: draft, build tree, mask, verify
inputs and slots, window fold, accept, commit.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
