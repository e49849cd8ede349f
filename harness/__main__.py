"""`python -m harness`: the ddcheck command line.

Layer: entry point. Imports the cli."""
from harness.cli import main

main()
