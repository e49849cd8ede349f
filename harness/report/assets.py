"""The page skeleton, its inline stylesheet and script. The script collects
any error (window.onerror) into #js-errors, and once the page is laid out
writes what it sees drawn into #render-status (data-* attributes), which the
browser test reads back from the DOM.

Layer: report. Imports the check and below; never workflows or cli."""
from __future__ import annotations

from html import escape

# no network at all: only inline styles and scripts, images from data: URLs
CSP = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:"

ERROR_TRAP = """
window.__ddErrors = [];
function __ddError(text) {
  window.__ddErrors.push(String(text));
  var el = document.getElementById('js-errors');
  if (el) { el.textContent = window.__ddErrors.join('\\n'); el.hidden = false;
            el.setAttribute('data-count', String(window.__ddErrors.length)); }
}
window.onerror = function (msg, src, line, col) { __ddError(msg + ' (line ' + line + ':' + col + ')'); };
window.addEventListener('unhandledrejection', function (e) { __ddError('unhandled rejection: ' + e.reason); });
"""

SCRIPT = """
(function () {
  function drawn(selector) {
    var n = 0;
    document.querySelectorAll(selector).forEach(function (el) {
      var r = el.getBoundingClientRect();
      if (r.width > 0 && r.height > 0) { n += 1; }
    });
    return n;
  }
  document.querySelectorAll('button.copy').forEach(function (b) {
    b.addEventListener('click', function () {
      var text = b.parentNode.querySelector('pre.cmd').textContent;
      if (navigator.clipboard) { navigator.clipboard.writeText(text); }
      b.textContent = 'copied';
    });
  });
  function mark() {
    document.querySelectorAll('section.setting').forEach(function (s) {
      s.classList.toggle('target', '#' + s.id === location.hash);
    });
  }
  window.addEventListener('hashchange', mark);
  mark();
  var counts = {
    gridCells: drawn('#grid a.cell'),
    failingCells: drawn('#grid a.cell.st-diverge, #grid a.cell.st-missed'),
    caughtCells: drawn('#grid a.cell.st-caught'),
    heatmaps: drawn('svg.heatmap'),
    heatmapCells: drawn('svg.heatmap rect.hm-cell'),
    leakedCells: drawn('svg.heatmap[data-which="effective"] rect.leaked'),
    treeNodes: drawn('svg.tree g.node'),
    chartPoints: drawn('svg.node-errors circle.pt'),
    layerPoints: drawn('svg.layers circle.pt'),
    streams: drawn('.stream-pair')
  };
  var status = document.getElementById('render-status');
  var parts = [];
  Object.keys(counts).forEach(function (k) {
    status.setAttribute('data-' + k.replace(/[A-Z]/g, function (c) { return '-' + c.toLowerCase(); }),
                        String(counts[k]));
    parts.push(k + ' ' + counts[k]);
  });
  status.setAttribute('data-errors', String(window.__ddErrors.length));
  status.textContent = 'drawn: ' + parts.join(', ');
  document.body.setAttribute('data-drawn', '1');
})();
"""

CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 0 24px 40px; color: #1d232a; background: #fff; }
h1 { margin: 16px 0 4px; font-size: 22px; } h2 { margin-top: 28px; } h3 { margin: 0 0 8px; font-size: 16px; }
h4 { margin: 16px 0 6px; }
.verdict.bad { color: #b3261e; font-weight: 600; } .verdict.good { color: #1b7f3b; font-weight: 600; }
.sources, .muted { color: #5f6b76; font-size: 12px; }
#js-errors { background: #fde7e7; color: #b3261e; padding: 8px; white-space: pre-wrap; }
#render-status { color: #5f6b76; font-size: 11px; margin-top: 24px; }
table.grid { border-collapse: collapse; }
table.grid th, table.grid td { border: 1px solid #d5dbe1; padding: 3px 6px; text-align: center; font-size: 12px; }
table.grid th.row-label { text-align: left; font-weight: 500; white-space: nowrap; }
a.cell { display: inline-block; min-width: 46px; padding: 6px 4px; margin: 1px; border-radius: 3px;
         text-decoration: none; color: #fff; font-weight: 600; }
.st-pass { background: #2e9d52; } .st-near-tie { background: #d39b1c; } .st-diverge { background: #c62f2f; }
.st-incomplete { background: #a8322d; } .st-caught { background: #2f6db3; } .st-missed { background: #7b1d5e; }
.st-skip { background: #8a94a0; } .st-below-baseline { background: #b4531f; }
section.setting.st-skip { border-left-color: #8a94a0; } section.setting.st-below-baseline { border-left-color: #b4531f; }
section.setting.st-caught { border-left-color: #2f6db3; } section.setting.st-missed { border-left-color: #7b1d5e; }
section.setting { background: none; border: 1px solid #d5dbe1; border-left-width: 6px; border-radius: 4px;
                  padding: 12px 16px; margin: 12px 0; }
section.setting.st-pass { border-left-color: #2e9d52; } section.setting.st-diverge { border-left-color: #c62f2f; }
section.setting.st-near-tie { border-left-color: #d39b1c; } section.setting.target { box-shadow: 0 0 0 3px #3b82f6; }
.badge { color: #fff; border-radius: 3px; padding: 1px 6px; font-size: 12px; } .badge.fc { background: #6b3fa0; }
a.back { font-size: 12px; font-weight: 400; margin-left: 8px; }
.cmd-row { display: flex; gap: 8px; align-items: flex-start; }
pre.cmd { background: #f3f5f7; padding: 6px 8px; margin: 0; white-space: pre-wrap; word-break: break-all; flex: 1; }
table.facts { border-collapse: collapse; margin: 8px 0; font-size: 13px; }
table.facts th { text-align: left; padding: 2px 12px 2px 0; font-weight: 500; color: #3b4650; vertical-align: top; }
table.facts td { padding: 2px 8px 2px 0; }
.explanation { background: #f6f0fc; padding: 8px; border-radius: 3px; }
.figure { overflow-x: auto; margin: 8px 0; } .heatmaps { display: flex; gap: 24px; flex-wrap: wrap; }
.leak-list { font-size: 12px; color: #5f6b76; }
svg text { font: 10px system-ui, sans-serif; fill: #3b4650; } svg .svg-title { font-size: 12px; font-weight: 600; }
svg .tick { font-size: 9px; } svg .tick.tol { fill: #b3261e; }
rect.hm-cell.on { fill: #3a6ea5; } rect.hm-cell.off { fill: #eef1f4; }
rect.hm-cell.leaked { fill: #d93025; } rect.hm-cell.blocked { fill: #fbd46d; stroke: #a86b00; stroke-width: 2; }
path.x-mark { stroke: #fff; stroke-width: 1.5; }
rect.hm-cell.leaked-site { stroke: #d93025; stroke-width: 1.5; } rect.hm-cell.blocked-site { stroke: #a86b00; stroke-width: 2; }
rect.role.r-prefix { fill: #9aa5b1; } rect.role.r-root { fill: #1b7f3b; } rect.role.r-node { fill: #3a6ea5; }
rect.role.r-pad { fill: #e08a00; }
svg.tree line.edge { stroke: #9aa5b1; stroke-width: 1.5; } svg.tree line.edge.acc { stroke: #1b7f3b; stroke-width: 4; }
svg.tree g.node circle { fill: #fff; stroke: #3a6ea5; stroke-width: 2; }
svg.tree g.node.acc circle { stroke: #1b7f3b; stroke-width: 3; } svg.tree g.node.div circle { fill: #f8c9c5; stroke: #c62f2f; }
svg.tree g.node.tie circle { fill: #fbe7b0; }
svg.tree text.tok { text-anchor: middle; font-size: 9px; } svg.tree text.row-id { font-size: 8px; fill: #7d8791; }
svg.tree g.pad rect { fill: #f3f5f7; stroke: #9aa5b1; stroke-dasharray: 3 2; }
svg.tree g.pad.nonfinite rect { fill: #f8c9c5; stroke: #c62f2f; }
svg.chart .grid-line { stroke: #eef1f4; } svg.chart .step-line { stroke: #e3e7eb; }
svg.chart .tol-line { stroke: #b3261e; stroke-dasharray: 5 3; stroke-width: 1.5; }
svg.chart .curve { fill: none; stroke: #3a6ea5; stroke-width: 1.5; }
svg.chart circle.pt.ok { fill: #2e9d52; } svg.chart circle.pt.bad { fill: #c62f2f; } svg.chart circle.pt.tie { fill: #d39b1c; }
svg.chart circle.pt.hollow { fill: none; stroke: #7d8791; } svg.chart circle.pt.highlight { stroke: #1d232a; stroke-width: 2; }
.stream { display: flex; gap: 8px; margin: 2px 0; } .stream.text pre { margin: 0; white-space: pre-wrap; font-size: 13px; } .stream .who { width: 72px; color: #5f6b76; font-size: 12px; }
.toks { display: flex; flex-wrap: wrap; gap: 2px; }
.toks .t { font: 11px ui-monospace, monospace; background: #eef1f4; padding: 1px 4px; border-radius: 2px; }
.toks .t.diff { background: #c62f2f; color: #fff; font-weight: 700; } .toks .t.after { opacity: 0.55; }
.legend { font-size: 12px; margin: 6px 0; } .legend span { display: inline-block; padding: 1px 6px; color: #fff; border-radius: 3px; }
"""

LEGEND = ('<p class="legend"><span class="st-pass">pass</span> <span class="st-near-tie">pass, near ties</span> '
          '<span class="st-diverge">diverge</span> <span class="st-caught">expected fault caught</span> '
          '<span class="st-missed">expected fault missed</span> <span class="st-below-baseline">below the acceptance '
          'baseline</span> <span class="st-skip">skipped (not run here)</span> <span class="st-incomplete">incomplete</span> '
          '&nbsp;cell text: nodes checked (divergent/checked when failing); click a cell for its details</p>')


def page(title: str, body: str) -> str:
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
            f"<title>{escape(title)}</title><style>{CSS}</style><script>{ERROR_TRAP}</script></head>"
            f'<body data-drawn="0"><div id="js-errors" data-count="0" hidden></div>{body}'
            f'<div id="render-status"></div><script>{SCRIPT}</script></body></html>')
