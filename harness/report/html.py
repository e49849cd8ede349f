"""`write_report`: records in, one self-contained HTML file out (inline CSS,
script and SVG; a Content-Security-Policy that forbids any network fetch).

The page: a coloured grid of the setting matrix, each cell linking to its
details; for a failing setting, the first divergence and its explanation,
the expected and effective masks, the draft tree, per-node error, the layer
curve, both token streams and the reproduce command. It renders records only.


Layer: report. Imports the check and below; never workflows or cli."""
from __future__ import annotations

import re
from pathlib import Path

from harness.report import assets
from harness.report.model import BAD_STATUSES, SettingView, describe_first, group
from harness.report.svg import esc, heatmap, layer_chart, node_error_chart, tree

GRID_COLS = ("budget", "topk")
GRID_ROWS = ("backend", "dtype", "batch", "cuda_graph", "fault", "accept", "model", "seed", "max_new_tokens",
             "block_size", "device")
EMPTY_CELL = '<span class="empty">-</span>'
FULL_DETAIL_LIMIT = 4  # below this many settings, passing ones get every chart too


def write_report(record_paths: list[Path], out: Path) -> list[SettingView]:
    """Render the records of one or more JSONL files into `out` (atomically); the runs it showed."""
    from harness.report.model import ReportInputError
    views = group([Path(p) for p in record_paths])
    try:
        html = render(views, [str(p) for p in record_paths])
    except (KeyError, TypeError, AttributeError, IndexError, ValueError, RecursionError) as e:
        # a record the type table lets through but the page cannot draw: bad input, said in one line
        raise ReportInputError(f"{', '.join(map(str, record_paths))}: records the report cannot render "
                               f"({type(e).__name__}: {e}); are they ddcheck's?") from None
    from harness.check.outputs import replace_atomically
    replace_atomically(Path(out), html)
    return views


def render(views: list[SettingView], sources: list[str]) -> str:
    failing = [v for v in views if v.status in BAD_STATUSES or v.status == "incomplete"]
    full = len(views) <= FULL_DETAIL_LIMIT
    n = {st: sum(v.status == st for v in views)
         for st in ("caught", "skip", "diverge", "below-baseline", "missed", "incomplete")}
    head = (f"{len(views)} setting{'s' * (len(views) != 1)}: "
            f"{sum(v.status in ('pass', 'near-tie') for v in views)} pass, "
            + (f"{n['caught']} expected faults caught, " if n["caught"] else "")
            + (f"{n['skip']} skipped (not run here: not checked, not passed), " if n["skip"] else "")
            + f"{n['diverge']} diverge, "
            + (f"{n['below-baseline']} below the acceptance baseline, " if n["below-baseline"] else "")
            + (f"{n['missed']} expected faults missed, " if n["missed"] else "")
            + f"{n['incomplete']} incomplete")
    body = [f'<header><h1>ddcheck report</h1><p class="verdict {"bad" if failing else "good"}">{esc(head)}</p>'
            f'<p class="sources">records: {esc(", ".join(sources))}{_stamp(views)}</p></header>',
            '<section id="grid-section"><h2>Setting matrix</h2>', grid(views), assets.LEGEND, "</section>",
            '<section id="details"><h2>Settings</h2>']
    # failures (and runs with no summary) first, then the rest, each in record order
    ordered = [v for v in views if v in failing] + [v for v in views if v not in failing]
    body += [details(v, full or v.status != "pass") for v in ordered]
    body.append("</section>")
    return assets.page("ddcheck report", "".join(body))


def _stamp(views: list[SettingView]) -> str:
    """Which ddcheck, commit and time produced the records (from the summary records)."""
    m = next((v.summary for v in views if v.summary and v.summary.get("ddcheck_version")), None)
    if not m:
        return ""
    commit = f", commit {m['commit']}" if m.get("commit") else ""
    return f"; ddcheck {m['ddcheck_version']}{commit}, {m.get('time', '')}"


# what differs between two runs of the same settings: the rows of `facts` read off the clock (a label naming a
# time, the warm-up) or naming the records file, and the records' paths and write time in the header (`_stamp`)
_RUN_TO_RUN_FACTS = re.compile(r"(<tr><th>(?:[^<]*\btime\b[^<]*|warm-up[^<]*|records)</th><td>)[^<]*(</td>)")
_RUN_TO_RUN_SOURCES = re.compile(r'(<p class="sources">records: )[^<]*?(?=; ddcheck |</p>)')
_RUN_TO_RUN_WRITTEN = re.compile(r'(<p class="sources">[^<]*, )\d{4}-\d\d-\d\dT[\d:.]+(?:[+-]\d\d:\d\d|Z)?(?=</p>)')


def page_run_to_run(page: str) -> str:
    """A page of `render` without what differs between two runs of one matrix (times per step, the records'
    paths and the time they were written): what two executors, or two runs, must agree on. The ddcheck
    version and commit stay."""
    for pattern, blank in ((_RUN_TO_RUN_FACTS, r"\1?\2"), (_RUN_TO_RUN_SOURCES, r"\1?"), (_RUN_TO_RUN_WRITTEN, r"\1?")):
        page = pattern.sub(blank, page)
    return page


# ---------------------------------------------------------------- grid

def _row_label(key: str, value) -> str:
    if key == "cuda_graph":
        return "graph" if value else "eager"
    if key in ("batch",):
        return f"bs {value}"
    if key == "fault":
        return f"fault {value}" if value else "no fault"
    return f"{key} {value}" if key in ("seed", "max_new_tokens", "block_size") else str(value)


def grid(views: list[SettingView]) -> str:
    """Rows: the non-(budget, topk) settings that vary; columns: (budget, topk)."""
    varying = [k for k in GRID_ROWS if len({repr(v.settings.get(k)) for v in views}) > 1]
    row_keys = varying or ["backend"]

    def col(v): return tuple(v.settings.get(k) for k in GRID_COLS)
    def row(v): return tuple(v.settings.get(k) for k in row_keys)

    cols = sorted({col(v) for v in views}, key=lambda c: tuple((x is None, x) for x in c))
    rows = sorted({row(v) for v in views}, key=lambda r: tuple((x is None, str(x)) for x in r))
    cells: dict[tuple, list[SettingView]] = {}
    for v in views:
        cells.setdefault((row(v), col(v)), []).append(v)
    out = ['<table class="grid" id="grid"><thead><tr><th>', esc(" / ".join(row_keys)), " \\ budget, topk</th>"]
    out += [f"<th>B {esc(b)}<br>K {esc(k)}</th>" for b, k in cols]
    out.append("</tr></thead><tbody>")
    for r in rows:
        label = ", ".join(_row_label(k, x) for k, x in zip(row_keys, r))
        out.append(f'<tr><th class="row-label">{esc(label)}</th>')
        for c in cols:
            vs = cells.get((r, c), [])
            links = "".join(f'<a class="cell st-{v.status}" href="#{v.key}" data-status="{v.status}" '
                            f'title="{esc(v.status + ": " + v.setting)}">{esc(_cell_text(v))}</a>' for v in vs)
            out.append(f"<td>{links or EMPTY_CELL}</td>")
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _cell_text(v: SettingView) -> str:
    m = v.summary or {}
    if v.status == "incomplete":
        return "?"
    if v.status == "skip":
        return "skip"
    if not m.get("passed"):
        return f"{m.get('divergent_nodes', 0)}/{m.get('nodes_checked', 0)}"
    return f"{m.get('nodes_checked', 0)}"


# ---------------------------------------------------------------- one setting

def details(v: SettingView, full: bool) -> str:
    m = v.summary or {}
    out = [f'<section class="setting st-{v.status}" id="{v.key}"><h3><span class="badge st-{v.status}">'
           f'{esc(v.status.upper())}</span> {esc(_title(v))} <a class="back" href="#grid">grid</a></h3>',
           f'<div class="cmd-row"><pre class="cmd">{esc(v.setting)}</pre>'
           f'<button class="copy" type="button">copy</button></div>', _facts(v)]
    if v.audits:   # the audit's findings are named, errors and warnings alike, whatever the status
        out.append(_audits(v.audits))
    if v.localize:
        out.append(_localize(v))
    if full:
        out.append(_tree_block(v))
        if v.nodes:
            out.append(f'<div class="figure">{node_error_chart(v.nodes, v.tolerance)}</div>')
        if v.localize and v.localize.get("layer_bisect"):
            out.append(f'<div class="figure">{layer_chart(v.localize["layer_bisect"])}</div>')
        out.append(_accepts(v.accepts))
        out.append(_streams(v.streams))
    elif m:
        out.append('<p class="muted">passing setting: counts only (the full charts are drawn for failing '
                   'settings and for reports of at most four settings)</p>')
    out.append("</section>")
    return "".join(out)


def _title(v: SettingView) -> str:
    s = v.settings
    if not s:
        return v.setting or "(no setting)"
    graph = "graph" if s.get("cuda_graph") else "eager"
    fault = f", fault {s['fault']}" if s.get("fault") else ""
    return (f"budget {s.get('budget')}, topk {s.get('topk')}, {graph}, {s.get('backend')}, "
            f"batch {s.get('batch')}, {s.get('dtype')}{fault}")


def _fmt(x, spec: str):
    return format(x, spec) if isinstance(x, (int, float)) else x


def _facts(v: SettingView) -> str:
    m = v.summary
    if m is None:
        return '<p class="bad">no summary record: the run did not finish</p>'
    err = m.get("max_rel_err")
    if m.get("skipped"):
        return f'<p class="muted">skipped, not run here (neither checked nor passed): {esc(m["skipped"])}</p>'
    rows = [("first divergence", describe_first(m)), ("nodes checked", m.get("nodes_checked")),
            ("divergent nodes", m.get("divergent_nodes")), ("near ties", m.get("near_ties")),
            ("router ties", m.get("router_ties") or None),
            ("padding rows seen", m.get("padding_rows")),
            ("non-finite padding rows", m.get("nonfinite_padding_rows") or None),
            ("stream mismatches", m.get("stream_mismatches")),
            ("acceptance mismatches", m.get("accept_mismatches")),
            ("mean accepted length", _fmt(m.get("mean_accepted_length"), ".2f")),
            ("acceptance baseline", m.get("acceptance_shortfall") or (
                f"held (floor {m['acceptance_floor']:.3f})" if m.get("acceptance_floor") is not None else None)),
            ("acceptance by depth", " ".join(f"{a:.2f}" for a in m["acceptance_by_depth"])
             if m.get("acceptance_by_depth") else None),
            ("trees / walks unlike the oracle's", f"{m['tree_mismatches']} / {m.get('accept_ref_mismatches', 0)}"
             if "tree_mismatches" in m else None),
            ("load mismatches", m.get("load_mismatches") or None),
            ("max rel. error", f"{err:.2e}" if isinstance(err, (int, float)) else err),
            ("tolerance", f"{v.tolerance:.0e}" if v.tolerance else "n/a"),
            ("verdict rule", _noise_rule(m)),
            ("max noise ratio (engine / twin error)", _fmt(m.get("max_noise_ratio"), ".2f")),
            ("max twin error", _fmt(m.get("max_twin_err"), ".2e")),
            ("noise excess (nodes in the noise's 1% tail)", _excess(m.get("noise_excess"))),
            ("oracle time per step (after step 0)", _fmt(m.get("oracle_s_per_step"), ".3f")),
            ("engine time per step (after step 0)", _fmt(m.get("engine_s_per_step"), ".3f")),
            ("oracle / engine time", _fmt(m.get("oracle_time_ratio"), ".2f")),
            ("warm-up, step 0 (engine, oracle)", _warmup(m)),
            ("oracle device", m.get("oracle_device")), ("records", v.source)]
    rows += [("note", n) for n in m.get("notes") or []]
    body = "".join(f"<tr><th>{esc(k)}</th><td>{esc(x)}</td></tr>" for k, x in rows if x is not None)
    return f'<table class="facts">{body}</table>'


def _excess(x: dict | None) -> str | None:
    return None if not x else f"{x['above']} of {x['nodes']} (binomial p {x['p']:.1e})"


def _noise_rule(m: dict) -> str | None:
    r = m.get("noise_rule")
    if m.get("verdict_rule") != "noise-floor" or not r:
        return None
    return (f"noise floor: diverge above {r['multiplier']:g} x max(twin error, {r['floor']:.1e}) "
            f"or above {r['ceiling']:g}")


def _localize(v: SettingView) -> str:
    loc = v.localize
    out = ['<div class="localize"><h4>Localization</h4>',
           f'<p class="explanation"><span class="badge fc">{esc(loc.get("fault_class", "?"))}</span> '
           f'{esc(loc.get("explanation", ""))}</p>']
    reps = (v.summary or {}).get("replacements") or []
    if reps:   # the stage proven by replacing its output (harness/check/localize/stage_swap.py)
        out.append("<p>Replaced at the first divergent step:</p><ul>"
                   + "".join(f"<li>{esc(r.get('sentence', ''))}</li>" for r in reps) + "</ul>")
    out.append(_wrongs(loc.get("first_wrong"), loc.get("metadata_audit") or []))
    probe = loc.get("mask_probe")
    if probe and probe.get("expected") and probe.get("effective"):
        leaked = {tuple(x) for x in probe.get("leaked") or []}
        blocked = {tuple(x) for x in probe.get("blocked") or []}
        roles = probe.get("key_roles") or []
        out.append(f'<p>mask of step {esc(loc.get("step"))}, request {esc(loc.get("request"))}: '
                   f'{len(leaked)} leaked cells (x), {len(blocked)} wrongly blocked (outlined); '
                   f'prefix length {esc(probe.get("prefix_len"))}'
                   f'{"; the backend ignores: " + esc(", ".join(probe["ignored_regions"])) if probe.get("ignored_regions") else ""}'
                   '</p><div class="figure heatmaps">')
        out.append(heatmap("expected (tree ancestors)", probe["expected"], roles, leaked, blocked, "expected"))
        out.append(heatmap("effective (what the backend applied)", probe["effective"], roles, leaked, blocked,
                           "effective"))
        out.append("</div>")
        if leaked:
            out.append(f'<p class="leak-list">leaked: {esc(_pairs(leaked, roles))}</p>')
        if blocked:
            out.append(f'<p class="leak-list">wrongly blocked: {esc(_pairs(blocked, roles))}</p>')
    audit = loc.get("kv_audit") or {}
    if audit.get("violations") or audit.get("first_bad_position") is not None:
        items = "".join(f"<li>{esc(x)}</li>" for x in audit.get("violations") or [])
        out.append(f'<h4>KV audit</h4><p>first bad position: {esc(audit.get("first_bad_position"))}, '
                   f'first bad layer: {esc(audit.get("first_bad_layer"))}</p><ul>{items}</ul>')
    out.append("</div>")
    return "".join(out)


def _wrongs(first: dict | None, audit: list[dict]) -> str:
    """The first wrong quantity with its expected and found values, then every wrong quantity the audits found."""
    if not first:
        return ""
    head = (f'<h4>First wrong quantity</h4><table class="facts"><tr><th>quantity</th><td>{esc(first.get("quantity"))}'
            f'</td></tr><tr><th>stage</th><td>{esc(first.get("stage"))}</td></tr><tr><th>step, request, index</th>'
            f'<td>{esc(first.get("step"))}, {esc(first.get("request"))}, {esc(first.get("index"))}</td></tr>'
            f'<tr><th>expected</th><td>{esc(first.get("expected"))}</td></tr><tr><th>found</th>'
            f'<td>{esc(first.get("found"))}</td></tr><tr><th>wrong elements</th><td>{esc(first.get("count"))}</td></tr>'
            '</table>')
    rows = "".join(f"<tr><td>{esc(a.get('step'))}</td><td>{esc(a.get('stage'))}</td><td>{esc(a.get('quantity'))}</td>"
                   f"<td>{esc(a.get('request'))}</td><td>{esc(a.get('text'))}</td></tr>" for a in audit[1:])
    more = ('<h4>Other wrong quantities, in order</h4><table class="facts"><tr><th>step</th><th>stage</th>'
            f'<th>quantity</th><th>request</th><th>what</th></tr>{rows}</table>') if rows else ""
    return head + more


def _pairs(cells: set, roles: list[str], limit: int = 24) -> str:
    items = [f"row {r} -> key {c} ({roles[c] if c < len(roles) else '?'})" for r, c in sorted(cells)]
    return "; ".join(items[:limit]) + (f"; ... {len(items) - limit} more" if len(items) > limit else "")


def _tree_block(v: SettingView) -> str:
    f = (v.summary or {}).get("first") or {}
    if f.get("what") == "node" and f.get("step", -1) >= 0:
        step, req = f["step"], f["request"]
    elif v.localize and v.localize.get("step") is not None and v.localize["step"] >= 0:
        step, req = v.localize["step"], v.localize.get("request", 0)
    else:
        step, req = (0, 0)
    nodes = [n for n in v.nodes if n.get("step") == step and n.get("request") == req]
    if not nodes:
        return ""
    return (f'<h4>Draft tree, step {esc(step)}, request {esc(req)}</h4><p class="muted">green: accepted path; '
            f'red: divergent; grey boxes: padding rows (not in the tree)</p><div class="figure">{tree(nodes)}</div>')


def _audits(audits: list[dict], limit: int = 40) -> str:
    rows = "".join(f"<tr><td>{esc(a.get('severity'))}</td><td>{esc(a.get('check'))}</td><td>{esc(a.get('step'))}</td>"
                   f"<td>{esc(a.get('request'))}</td><td>{esc(a.get('detail'))}</td></tr>" for a in audits[:limit])
    more = f'<p class="muted">{len(audits) - limit} more in the records</p>' if len(audits) > limit else ""
    return ('<h4>Port audit findings</h4><table class="facts"><tr><th>severity</th><th>check</th><th>step</th>'
            f'<th>request</th><th>what</th></tr>{rows}</table>{more}')


def _accepts(accepts: list[dict]) -> str:
    if not accepts:
        return ""
    rows = "".join(f"<tr><td>{esc(a.get('step'))}</td><td>{esc(a.get('request'))}</td>"
                   f"<td>{esc(a.get('walk_rows'))} / {esc(a.get('walk_bonus'))}</td>"
                   f"<td>{esc(a.get('sglang_rows'))} / {esc(a.get('sglang_bonus'))}</td></tr>" for a in accepts)
    return ('<h4>Acceptance disagreements</h4><table class="facts"><tr><th>step</th><th>request</th>'
            f'<th>walk rows / bonus</th><th>SGLang rows / bonus</th></tr>{rows}</table>')


def _streams(streams: list[dict]) -> str:
    if not streams:
        return ""
    out = ["<h4>Token streams</h4>"]
    for s in sorted(streams, key=lambda s: s.get("request", 0)):
        first = s.get("first_mismatch")
        out.append(f'<div class="stream-pair" data-verdict="{esc(s.get("verdict"))}"><p>request '
                   f'{esc(s.get("request"))} ({esc(s.get("prompt"))}): {esc(s.get("verdict"))}'
                   f'{"" if first is None else f", first differing token at index {esc(first)}"}</p>')
        if s.get("engine_text") is not None:   # decoded by the checkpoint's tokenizer (records carry it)
            out.append(f'<div class="stream text"><span class="who">prompt</span><pre>{esc(s.get("prompt_text"))}</pre></div>')
            for who, key in (("engine", "engine_text"), ("reference", "reference_text")):
                out.append(f'<div class="stream text"><span class="who">{who}</span><pre>{esc(s.get(key))}</pre></div>')
        for who, toks in (("engine", s.get("engine_tokens") or []), ("reference", s.get("reference_tokens") or [])):
            spans = "".join(f'<span class="t{" diff" if i == first else " after" if first is not None and i > first else ""}"'
                            f' title="index {i}">{esc(t)}</span>' for i, t in enumerate(toks))
            out.append(f'<div class="stream"><span class="who">{who}</span><span class="toks">{spans}</span></div>')
        out.append("</div>")
    return "".join(out)


def _warmup(m: dict) -> str | None:
    e, o = m.get("engine_warmup_s"), m.get("oracle_warmup_s")
    return None if e is None or o is None else f"{e:.2f} s, {o:.2f} s"
