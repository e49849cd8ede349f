"""Self-contained HTML reports of ddcheck records (docs/RECORDS.md). The
report renders records and never recomputes them; nothing here imports torch.

Layer: report. Imports the check and below; never workflows or cli."""
