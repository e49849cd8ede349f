"""The shape of each record field the report reads (docs/RECORDS.md): a
record whose field has another JSON type is bad input (exit 2, one line),
never a traceback deep in the renderer."""
from __future__ import annotations

INT, FLOAT, STR, BOOL, DICT, LIST, NULL = "int", "float", "str", "bool", "object", "list", "null"
INF = '"inf" or "-inf"'   # a non-finite float as the records write it

_COMMON = {"kind": (STR,), "setting": (STR, NULL), "run": (STR, NULL)}
_FLOAT_OR_INF = (FLOAT, INT, INF, NULL)

# kind -> field -> the JSON types it may have (absent is always allowed)
FIELDS = {
    "node": {"step": (INT,), "request": (INT,), "node": (INT,), "depth": (INT, NULL), "parent": (INT, NULL),
             "token": (INT, NULL), "is_padding": (BOOL,), "accepted": (BOOL,), "rel_err": _FLOAT_OR_INF,
             "finite": (BOOL,), "verdict": (STR,), "twin_err": _FLOAT_OR_INF, "noise_ratio": _FLOAT_OR_INF},
    "stream": {"request": (INT,), "prompt": (STR, NULL), "engine_tokens": (LIST,), "reference_tokens": (LIST,),
               "first_mismatch": (INT, NULL), "verdict": (STR,)},
    "accept": {"step": (INT,), "request": (INT,), "walk_rows": (LIST, NULL), "sglang_rows": (LIST, NULL)},
    "audit": {"severity": (STR, NULL), "check": (STR, NULL), "step": (INT, NULL), "request": (INT, NULL)},
    "localize": {"step": (INT, NULL), "request": (INT, NULL), "fault_class": (STR, NULL), "explanation": (STR, NULL),
                 "mask_probe": (DICT, NULL), "kv_audit": (DICT, NULL), "layer_bisect": (DICT, NULL)},
    "interrupted": {"finished": (INT,), "total": (INT,)},
    "summary": {"settings": (DICT, NULL), "passed": (BOOL,), "verdict": (STR,), "nodes_checked": (INT,),
                "divergent_nodes": (INT,), "near_ties": (INT,), "padding_rows": (INT,), "steps": (INT,),
                "stream_mismatches": (INT,), "accept_mismatches": (INT,), "tree_mismatches": (INT,),
                "accept_ref_mismatches": (INT,), "load_mismatches": (INT,), "max_rel_err": _FLOAT_OR_INF,
                "mean_accepted_length": (FLOAT, INT, NULL), "acceptance_by_depth": (LIST, NULL),
                "first": (DICT, NULL), "crash": (DICT, NULL), "error": (STR, NULL), "notes": (LIST, NULL),
                "fault_class": (STR, NULL), "explanation": (STR, NULL), "expect_fault": (STR, NULL),
                "expect_class": (STR, NULL), "tolerance": (FLOAT, INT, NULL), "noise_rule": (DICT, NULL),
                "verdict_rule": (STR, NULL), "max_noise_ratio": _FLOAT_OR_INF, "max_twin_err": _FLOAT_OR_INF,
                "engine_s_per_step": (FLOAT, INT, NULL), "oracle_s_per_step": (FLOAT, INT, NULL),
                "oracle_device": (STR, NULL), "first_finding": (STR, NULL), "ddcheck_version": (STR, NULL),
                "commit": (STR, NULL), "time": (STR, NULL), "skipped": (STR, NULL)},
}
# objects inside a summary the report reads field by field
NESTED = {
    ("summary", "first"): {"step": (INT, NULL), "request": (INT, NULL), "node": (INT, NULL), "depth": (INT, NULL),
                           "what": (STR, NULL), "detail": (STR, NULL), "rel_err": _FLOAT_OR_INF,
                           "padding_present": (BOOL, NULL)},
    ("summary", "crash"): {"side": (STR, NULL), "where": (STR, NULL), "error": (STR, NULL), "sentence": (STR, NULL)},
    ("summary", "settings"): {"budget": (INT, NULL), "topk": (INT, NULL), "batch": (INT, NULL),
                              "cuda_graph": (BOOL, NULL), "backend": (STR, NULL), "dtype": (STR, NULL),
                              "fault": (STR, NULL)},
    ("summary", "noise_rule"): {"multiplier": (FLOAT, INT), "floor": (FLOAT, INT), "ceiling": (FLOAT, INT)},
}


def json_type(value) -> str:
    if value is None:
        return NULL
    if isinstance(value, bool):
        return BOOL
    return {int: INT, float: FLOAT, str: STR, dict: DICT, list: LIST}.get(type(value), type(value).__name__)


def shape_error(rec: dict) -> str | None:
    """The first field of `rec` whose JSON type the report cannot read, as a phrase; None when it fits."""
    kind = rec.get("kind")
    if not isinstance(kind, str):
        return f"'kind' is {json_type(kind)}, not a string"
    for fields, obj, where in ((_COMMON, rec, ""), (FIELDS.get(kind, {}), rec, "")):
        bad = _first_bad(fields, obj, where)
        if bad:
            return bad
    for (k, field), fields in NESTED.items():
        if k == kind and isinstance(rec.get(field), dict):
            bad = _first_bad(fields, rec[field], f"{field}.")
            if bad:
                return bad
    return None


def _first_bad(fields: dict, obj: dict, where: str) -> str | None:
    for name, types in fields.items():
        if name not in obj or (INF in types and obj[name] in ("inf", "-inf")):
            continue
        if json_type(obj[name]) not in types:
            return f"'{where}{name}' is {json_type(obj[name])}, expected {' or '.join(types)}"
    return None
