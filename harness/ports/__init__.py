"""Real DDTree ports under test: adapters that drive a user's own code
(harness/ports/families) through ddcheck's engine, next to the oracle.

Layer: ports. Imports the engine and below; never faults, check, report, workflows or cli."""
