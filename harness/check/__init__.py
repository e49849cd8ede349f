"""The differential check: a run prepared (checkpoint read by both sides and
agreed, engine built, port and fault attached), its verify steps compared
node by node against the float64 oracle, the summary, crash attribution,
the records, and the localizer that explains a first divergence.

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
