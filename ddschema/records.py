"""JSON-lines record format. Documented in docs/RECORDS.md."""

SCHEMA_VERSION = 1

# kind -> what one record of that kind stands for
RECORD_KINDS = {
    "node": "one per (step, request, tree row): metrics against the oracle",
    "accept": "one per (step, request) where two acceptance implementations disagree",
    "stream": "one per request: emitted tokens against the oracle's greedy continuation",
    "load": "one per config key or tensor where the engine's parsed checkpoint differs from the oracle's own reading",
    "tree": "one per (step, request) whose tree is not the oracle's own best-first build from the same drafts",
    "accept-ref": "one per (step, request) whose walk is not the oracle's own greedy walk over the same tree",
    "audit": "one per structural finding on a port's verify metadata (mask, inputs, acceptance, commit)",
    "interrupted": "last line of a sweep or gate stopped by Ctrl-C: settings finished and total",
    "side-by-side": "one per pair of implementations run on the same drafts: where they first differ",
    "crash": "one per run where an exception was raised: the side (engine, oracle, ddcheck), file:line, error",
    "localize": "one per divergent run: mask probe, KV audit, layer bisect, explanation",
    "summary": "one per run: counts and the first divergence",
}

VERDICTS = ("match", "diverge", "near-tie", "padding", "router-tie")
