"""Adapters of the port families ddcheck can drive, one module each.

Layer: ports. Imports the engine and below; never faults, check, report, workflows or cli."""
