"""Self-contained HTML reports of ddcheck records (docs/RECORDS.md). The
report renders records and never recomputes them; nothing here imports torch."""
