"""Hand-made records following docs/RECORDS.md, for report tests (no torch)."""
from __future__ import annotations

import json
from pathlib import Path

SETTING = ("ddcheck run --budget 16 --topk 1 --no-cuda-graph --backend torch --batch 1 --max-new-tokens 8 "
           "--block-size 8 --model tiny --seed 0 --dtype float32 --accept walk --fault padded-kv-visible")
PREFIX, Q_LEN, REAL = 4, 9, 5   # budget 8: root + 4 drafts, rows 5..8 padding


def settings(**over) -> dict:
    s = {"budget": 8, "topk": 1, "cuda_graph": False, "backend": "torch", "batch": 1, "max_new_tokens": 8,
         "block_size": 5, "model": "tiny", "seed": 0, "dtype": "float32", "fault": "padded-kv-visible",
         "accept": "walk", "device": "cpu"}
    s.update(over)
    return s


def mask_probe() -> dict:
    cols = PREFIX + Q_LEN
    expected = [[int(c < PREFIX or (r < REAL and PREFIX <= c <= PREFIX + r) or (r >= REAL and c == PREFIX + r))
                 for c in range(cols)] for r in range(Q_LEN)]
    effective = [[1 if (r < REAL and c >= PREFIX + REAL) else v for c, v in enumerate(row)]
                 for r, row in enumerate(expected)]
    leaked = [[r, c] for r in range(Q_LEN) for c in range(cols) if effective[r][c] and not expected[r][c]]
    roles = ([f"prefix:{p}" for p in range(PREFIX)] + ["root"] + [f"node:{i}" for i in range(1, REAL)]
             + [f"padding:{i}" for i in range(REAL, Q_LEN)])
    return {"rows": Q_LEN, "cols": cols, "prefix_len": PREFIX, "expected": expected, "effective": effective,
            "leaked": leaked, "blocked": [], "key_roles": roles, "key_slots": list(range(10, 10 + cols)),
            "ignored_regions": ["prefix"]}


def failing_records(setting: str = SETTING, with_localize: bool = True, explanation: str | None = None) -> list[dict]:
    recs = []
    for row in range(Q_LEN):
        pad = row >= REAL
        recs.append({"kind": "node", "schema": 1, "setting": setting, "step": 0, "request": 0, "node": row,
                     "depth": None if pad else row, "parent": None if pad or row == 0 else row - 1,
                     "token": None if pad else 40 + row, "is_padding": pad, "accepted": row < 2,
                     "rel_err": None if pad else 0.3 + row / 100, "top1_agree": None if pad else row % 2 == 0,
                     "kl": None, "ref_gap": None, "finite": True, "verdict": "padding" if pad else "diverge"})
    recs.append({"kind": "stream", "schema": 1, "setting": setting, "request": 0, "prompt": "code",
                 "engine_tokens": [5, 6, 7, 99, 1], "reference_tokens": [5, 6, 7, 8, 9], "first_mismatch": 3,
                 "verdict": "diverge"})
    if with_localize:
        recs.append({"kind": "localize", "schema": 1, "setting": setting, "step": 0, "request": 0, "node": 0,
                     "depth": 0, "fault_class": "padding-leak",
                     "explanation": explanation or "step 0, request 0, node 0 (depth 0) attends to keys 9-12, "
                                                   "which are padding rows; first wrong at layer 0",
                     "mask_probe": mask_probe(),
                     "kv_audit": {"violations": [], "first_bad_position": None, "first_bad_layer": None,
                                  "rel_err": None},
                     "layer_bisect": {"rel_err_per_layer": [0.0, 0.2, 0.35], "first_bad_layer": 1,
                                      "tolerance": 1e-4}})
    recs.append(summary(setting, passed=False))
    return recs


def summary(setting: str, passed: bool, **over) -> dict:
    s = {"kind": "summary", "schema": 1, "setting": setting, "passed": passed, "settings": settings(**over),
         "nodes_checked": REAL, "divergent_nodes": 0 if passed else REAL, "near_ties": 0, "padding_rows": 4,
         "steps": 1, "stream_mismatches": 0 if passed else 1, "max_rel_err": 1e-7 if passed else 0.34,
         "first": None if passed else {"step": 0, "request": 0, "node": 0, "depth": 0, "padding_present": True,
                                       "rel_err": 0.3, "what": "node"}, "notes": []}
    return s


def write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
