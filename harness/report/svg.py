"""Inline SVG pieces of the report: mask heatmaps, the draft tree, log-scale
error charts. Each function takes record fields and returns markup; every
piece of text goes through `esc`.

Layer: report. Imports the check and below; never workflows or cli."""
from __future__ import annotations

import math
from html import escape


def esc(value) -> str:
    return escape(str(value), quote=True)


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


# ---------------------------------------------------------------- heatmaps

ROLE_CLASS = {"prefix": "r-prefix", "root": "r-root", "node": "r-node", "padding": "r-pad"}


def heatmap(title: str, grid: list[list[int]], key_roles: list[str], leaked: set, blocked: set,
            which: str) -> str:
    """A [rows][cols] 0/1 visibility matrix. `which` is 'expected' or
    'effective'; leaked (row, col) cells are marked on both (an x), wrongly
    blocked ones with an outline."""
    cell, left, top = 12, 34, 40
    rows, cols = len(grid), len(grid[0]) if grid else 0
    w, h = max(left + cols * cell + 8, 40 + 7 * len(title)), top + rows * cell + 8
    out = [f'<svg class="heatmap" data-which="{esc(which)}" width="{w}" height="{h}" '
           f'viewBox="0 0 {w} {h}" role="img" aria-label="{esc(title)}">',
           f'<text x="{left}" y="12" class="svg-title">{esc(title)}</text>']
    for c, role in enumerate(key_roles[:cols]):
        kind = role.split(":")[0]
        out.append(f'<rect class="role {ROLE_CLASS.get(kind, "r-node")}" x="{left + c * cell}" y="18" '
                   f'width="{cell - 1}" height="8"><title>key {c}: {esc(role)}</title></rect>')
        if role.startswith(("node:", "padding:", "root")) and c % 2 == 0:
            out.append(f'<text x="{left + c * cell + 1}" y="36" class="tick">{c}</text>')
    for r in range(rows):
        y = top + r * cell
        out.append(f'<text x="2" y="{y + 10}" class="tick">{r}</text>')
        for c in range(cols):
            x = left + c * cell
            on = bool(grid[r][c])
            mark = "leaked" if (r, c) in leaked else "blocked" if (r, c) in blocked else ""
            site = f" {mark}-site" if mark else ""  # on both maps; filled/crossed on the effective one only
            mark = mark if which == "effective" else ""
            role = esc(key_roles[c]) if c < len(key_roles) else c
            out.append(f'<rect class="hm-cell {"on" if on else "off"} {mark}{site}" x="{x}" y="{y}" width="{cell - 1}" '
                       f'height="{cell - 1}"><title>row {r}, key {c} ({role}): {"visible" if on else "masked"}'
                       f'{" - LEAKED" if "leaked" in site else " - WRONGLY BLOCKED" if "blocked" in site else ""}'
                       f'</title></rect>')
            if mark == "leaked":
                out.append(f'<path class="x-mark" d="M{x + 2},{y + 2}L{x + cell - 3},{y + cell - 3}'
                           f'M{x + cell - 3},{y + 2}L{x + 2},{y + cell - 3}"/>')
    out.append("</svg>")
    return "".join(out)


# ---------------------------------------------------------------- tree

def tree(nodes: list[dict]) -> str:
    """The verify rows of one (step, request): real nodes by depth with their
    tokens, the accepted path, divergent nodes, and the padding rows apart."""
    real = [n for n in nodes if not n.get("is_padding")]
    pad = [n for n in nodes if n.get("is_padding")]
    by_depth: dict[int, list[dict]] = {}
    for n in sorted(real, key=lambda n: n["node"]):
        by_depth.setdefault(int(n.get("depth") or 0), []).append(n)
    dx, dy, r = 78, 34, 13
    pos = {n["node"]: (40 + d * dx, 30 + i * dy) for d, ns in by_depth.items() for i, n in enumerate(ns)}
    pad_x = 40 + (max(by_depth, default=0) + 1) * dx + 20
    height = max([y for _, y in pos.values()] + [30 + len(pad) * 22]) + 30
    width = pad_x + (90 if pad else 0) + 20
    out = [f'<svg class="tree" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
           f'aria-label="draft tree">']
    for n in real:
        p = n.get("parent")
        if p is None or p not in pos or p == n["node"]:
            continue
        (x1, y1), (x2, y2) = pos[p], pos[n["node"]]
        cls = "edge acc" if n.get("accepted") else "edge"
        out.append(f'<line class="{cls}" x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}"/>')
    for n in real:
        x, y = pos[n["node"]]
        cls = ["node", "acc" if n.get("accepted") else "", "div" if n.get("verdict") == "diverge" else "",
               "tie" if n.get("verdict") in ("near-tie", "router-tie") else ""]
        tok = "root" if n["node"] == 0 else n.get("token")
        err = _num(n.get("rel_err"))
        tip = (f"row {n['node']}, depth {n.get('depth')}, token {n.get('token')}, {n.get('verdict')}"
               f"{f', rel. error {err:.2e}' if err is not None else ''}{', accepted' if n.get('accepted') else ''}")
        out.append(f'<g class="{esc(" ".join(c for c in cls if c))}"><title>{esc(tip)}</title>'
                   f'<circle cx="{x}" cy="{y}" r="{r}"/><text x="{x}" y="{y + 4}" class="tok">{esc(tok)}</text>'
                   f'<text x="{x + r + 2}" y="{y - r + 2}" class="row-id">{esc(n["node"])}</text></g>')
    if pad:
        out.append(f'<text x="{pad_x}" y="14" class="svg-title">padding rows</text>')
        for i, n in enumerate(sorted(pad, key=lambda n: n["node"])):
            y = 22 + i * 22
            bad = "" if n.get("finite", True) else " nonfinite"
            out.append(f'<g class="pad{bad}"><title>padding row {esc(n["node"])}'
                       f'{"" if n.get("finite", True) else ": non-finite logits"}</title>'
                       f'<rect x="{pad_x}" y="{y}" width="80" height="18"/>'
                       f'<text x="{pad_x + 6}" y="{y + 13}">row {esc(n["node"])}</text></g>')
    out.append("</svg>")
    return "".join(out)


# ---------------------------------------------------------------- log-scale charts

def _log_axis(values: list[float], tol: float | None) -> tuple[float, float]:
    finite = [math.log10(v) for v in values if v and v > 0] + ([math.log10(tol)] if tol else [])
    lo, hi = (min(finite), max(finite)) if finite else (-8.0, 0.0)
    return math.floor(lo) - (1 if lo == hi else 0), math.ceil(hi) + (1 if lo == hi else 0)


def log_chart(css: str, title: str, points: list[tuple[float | None, str, str]], tol: float | None,
              x_label: str, marks: list[int] = (), connect: bool = False, highlight: int | None = None) -> str:
    """points: (value or None, css class, tooltip) in x order; None plots as a
    hollow marker on the floor (no value: padding or non-finite)."""
    w, h, left, right, top, bottom = 640, 240, 56, 12, 24, 34
    values = [v for v, _, _ in points if v is not None]
    lo, hi = _log_axis(values, tol)
    n = max(len(points), 1)

    def sx(i: float) -> float:
        return left + (i + 0.5) * (w - left - right) / n

    def sy(v: float | None) -> float:
        lv = lo if not v or v <= 0 else max(lo, min(hi, math.log10(v)))
        return top + (hi - lv) * (h - top - bottom) / (hi - lo)

    out = [f'<svg class="chart {esc(css)}" width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" '
           f'aria-label="{esc(title)}"><text x="{left}" y="14" class="svg-title">{esc(title)}</text>']
    for e in range(int(lo), int(hi) + 1):
        y = sy(10.0 ** e)
        out.append(f'<line class="grid-line" x1="{left}" x2="{w - right}" y1="{y:.1f}" y2="{y:.1f}"/>'
                   f'<text x="{left - 4}" y="{y + 4:.1f}" class="tick" text-anchor="end">1e{e}</text>')
    for m in marks:
        x = sx(m - 0.5)
        out.append(f'<line class="step-line" x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{h - bottom}"/>')
    if connect and len(values) > 1:
        d = "".join(f"{'M' if i == 0 else 'L'}{sx(i):.1f},{sy(v):.1f}" for i, (v, _, _) in enumerate(points))
        out.append(f'<path class="curve" d="{d}"/>')
    for i, (v, cls, tip) in enumerate(points):
        hollow = " hollow" if v is None else ""
        big = " highlight" if i == highlight else ""
        out.append(f'<circle class="pt {esc(cls)}{hollow}{big}" cx="{sx(i):.1f}" cy="{sy(v):.1f}" '
                   f'r="{5 if big else 3}"><title>{esc(tip)}</title></circle>')
    if tol:
        y = sy(tol)
        out.append(f'<line class="tol-line" x1="{left}" x2="{w - right}" y1="{y:.1f}" y2="{y:.1f}"/>'
                   f'<text x="{w - right}" y="{y - 4:.1f}" class="tick tol" text-anchor="end">'
                   f'tolerance {tol:.0e}</text>')
    out.append(f'<text x="{(left + w) / 2}" y="{h - 6}" class="tick" text-anchor="middle">{esc(x_label)}</text>')
    out.append("</svg>")
    return "".join(out)


def node_error_chart(nodes: list[dict], tol: float | None) -> str:
    real = [n for n in nodes if not n.get("is_padding")]
    real.sort(key=lambda n: (n["step"], n["request"], n["node"]))
    points, marks, last = [], [], None
    for i, n in enumerate(real):
        if last is not None and (n["step"], n["request"]) != last:
            marks.append(i)
        last = (n["step"], n["request"])
        err = _num(n.get("rel_err"))
        cls = {"diverge": "bad", "near-tie": "tie", "router-tie": "tie"}.get(n.get("verdict"), "ok")
        points.append((err, cls, f"step {n['step']}, request {n['request']}, node {n['node']} "
                                  f"(depth {n.get('depth')}): rel. error "
                                  f"{'n/a' if err is None else f'{err:.2e}'}, {n.get('verdict')}"))
    return log_chart("node-errors", "per-node relative error (log scale), dashed: tolerance", points, tol,
                     "verify rows in (step, request, node) order; faint lines separate (step, request)", marks)


def layer_chart(bisect: dict) -> str:
    errs = bisect.get("rel_err_per_layer") or []
    first = bisect.get("first_bad_layer")
    entry = None if first is None else int(first)  # an entry index: 0 the embedding, i after layer i-1
    points = [(_num(e), "bad" if entry is not None and i >= entry else "ok",
               f"{'embedding' if i == 0 else f'after layer {i - 1}'}: rel. error "
               f"{'n/a' if _num(e) is None else f'{_num(e):.2e}'}") for i, e in enumerate(errs)]
    return log_chart("layers", "divergence layer by layer at the first divergent node (entry 0: embedding)",
                     points, _num(bisect.get("tolerance")), "entry (0: embedding, i: after layer i-1)",
                     connect=True, highlight=entry)
