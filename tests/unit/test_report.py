"""The HTML report from hand-made records (docs/RECORDS.md): grid cells link
to details, the heatmaps mark leaked cells, text is escaped, nothing is
fetched, and harness/report never imports torch."""
import re
import subprocess
import sys
from pathlib import Path

from harness.report.html import page_run_to_run, write_report
from report_fixtures import SETTING, failing_records, mask_probe, summary, write

ROOT = Path(__file__).resolve().parents[2]


def _render(tmp_path, records) -> str:
    out = tmp_path / "r.html"
    write_report([write(tmp_path / "r.jsonl", records)], out)
    return out.read_text()


def test_grid_cells_link_to_their_details(tmp_path):
    html = _render(tmp_path, failing_records() + [summary("ddcheck run --budget 4", True, budget=4, fault=None)])
    links = re.findall(r'<a class="cell st-(\w[\w-]*)" href="#(s\d+)"', html)
    assert sorted(links) == [("diverge", "s0"), ("pass", "s1")]
    for _, anchor in links:
        assert f'<section class="setting' in html and f'id="{anchor}"' in html


def test_grid_rows_are_labelled_by_their_settings_values(tmp_path):
    html = _render(tmp_path, [summary("ddcheck run --cuda-graph", True, cuda_graph=True, batch=2),
                              summary("ddcheck run --no-cuda-graph", True, cuda_graph=False, batch=1)])
    labels = re.findall(r'<th class="row-label">([^<]*)</th>', html)
    assert sorted(labels) == ["bs 1, eager", "bs 2, graph"]


def test_failing_setting_shows_masks_tree_charts_streams_and_command(tmp_path):
    html = _render(tmp_path, failing_records())
    probe = mask_probe()
    effective = html.split('data-which="effective"')[1].split("</svg>")[0]
    assert effective.count("hm-cell on leaked") == len(probe["leaked"]) == 20
    assert html.count('data-which="expected"') == 1
    assert "padding-leak" in html and "which are padding rows" in html
    assert html.count('<g class="node') == 5 and html.count('<g class="pad') == 4
    assert html.count("edge acc") == 1
    assert 'class="tol-line"' in html and "tolerance 1e-04" in html
    assert 'svg class="chart layers"' in html and "pt bad highlight" in html
    assert '<span class="t diff" title="index 3">99</span>' in html
    assert '<span class="t diff" title="index 3">8</span>' in html
    assert f'<pre class="cmd">{SETTING}</pre>' in html


def test_without_a_localize_record_the_grid_and_node_chart_still_render(tmp_path):
    html = _render(tmp_path, failing_records(with_localize=False))
    assert 'class="cell st-diverge"' in html and 'svg class="chart node-errors"' in html
    assert "svg class=\"heatmap\"" not in html


def _expected(passed: bool, fault_class: str | None, setting: str = SETTING) -> dict:
    return {**summary(setting, passed), "fault_class": fault_class, "expect_fault": "padded-kv-visible",
            "expect_class": "padding-leak"}


def test_a_caught_expected_fault_is_its_own_status_not_a_failure(tmp_path):
    records = failing_records()[:-1] + [_expected(False, "padding-leak")]
    records.append(summary("ddcheck run --budget 4", True, budget=4, fault=None))
    html = _render(tmp_path, records)
    assert re.findall(r'<a class="cell st-([\w-]+)"', html) == ["caught", "pass"]
    assert 'class="verdict good"' in html and "1 pass, 1 expected faults caught, 0 diverge" in html
    assert '<span class="st-caught">expected fault caught</span>' in html and ".st-caught {" in html


def test_an_expected_fault_missed_or_misnamed_is_bad(tmp_path):
    for records in ([_expected(True, None)], failing_records()[:-1] + [_expected(False, "mask-shift")]):
        html = _render(tmp_path, records)
        assert re.findall(r'<a class="cell st-([\w-]+)"', html) == ["missed"]
        assert 'class="verdict bad"' in html and "1 expected faults missed" in html


def test_text_is_escaped(tmp_path):
    evil = '<script>alert("x")</script>'
    html = _render(tmp_path, failing_records(setting=f"ddcheck run {evil}", explanation=evil))
    assert evil not in html and "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in html


def test_report_is_self_contained(tmp_path):
    html = _render(tmp_path, failing_records())
    assert not re.search(r'(src|href)="(https?:)?//', html) and "@import" not in html
    assert "default-src 'none'" in html
    assert not re.search(r"<(link|img|iframe)\b", html)


def test_report_package_does_not_import_torch():
    code = "import sys, harness.report.html, harness.report.svg, harness.report.model; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_report_cli_bad_input_is_a_usage_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kind": "node"}\nnot json\n')
    out = tmp_path / "r.html"
    r = subprocess.run([sys.executable, "-c", "from harness.cli import main; main()", "report", str(bad), "-o", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "bad.jsonl: line 2: not JSON" in r.stderr and not out.exists()


def test_the_first_wrong_quantity_shows_its_expected_and_found_values(tmp_path):
    records = failing_records()
    loc = next(r for r in records if r["kind"] == "localize")
    first = {"step": 0, "stage": "verify inputs", "quantity": "kv_indptr", "request": None, "index": 1,
             "expected": [0, 14, 28], "found": [0, 13, 27], "count": 2, "text": "kv_indptr is not the cumsum"}
    later = {**first, "stage": "mask", "quantity": "mask_indptr", "text": "mask_indptr <off> by one row"}
    loc.update(first_wrong=first, metadata_audit=[first, later])
    html = _render(tmp_path, records)
    block = html.split("<h4>First wrong quantity</h4>")[1].split("</table>")[0]
    assert "kv_indptr" in block and "verify inputs" in block
    assert "[0, 14, 28]" in block and "[0, 13, 27]" in block
    assert "mask_indptr &lt;off&gt; by one row" in html      # the later ones, escaped
    assert "<h4>First wrong quantity</h4>" not in _render(tmp_path, failing_records())


def test_page_run_to_run_drops_times_and_paths_and_keeps_what_was_found(tmp_path):
    """Two runs of one setting: other times per step, write time and records file, the same page once
    page_run_to_run takes those out; a different finding or commit is still a different page."""
    def page(name: str, **over) -> str:
        rec = {**summary("ddcheck run --budget 4", True, budget=4, fault=None), "oracle_s_per_step": 0.05,
               "engine_s_per_step": 0.3, "oracle_time_ratio": 0.17, "engine_warmup_s": 1.0, "oracle_warmup_s": 0.5,
               "ddcheck_version": "0.1.0", "commit": "abc",
               "time": "2026-01-01T00:00:00+00:00"}
        (tmp_path / name).mkdir()
        out = tmp_path / name / "r.html"
        write_report([write(tmp_path / name / "r.jsonl", [{**rec, **over}])], out)
        return out.read_text()

    first = page("a")
    again = page("b", oracle_s_per_step=0.09, engine_s_per_step=0.7, oracle_time_ratio=0.13, engine_warmup_s=2.0,
                 time="2026-01-02T10:11:12.5+00:00")
    assert first != again and page_run_to_run(first) == page_run_to_run(again)
    assert "warm-up" in first and "1.00 s, 0.50 s" in first and "0.17" in first   # the rows it blanks are drawn
    assert not any(x in page_run_to_run(first) for x in ("0.050", "1.00 s, 0.50 s", "0.17", "2026-01-01"))
    assert "commit abc" in page_run_to_run(first)
    for n, other in enumerate(({"max_rel_err": 2e-7}, {"commit": "def"}, {"near_ties": 1})):
        assert page_run_to_run(page(f"c{n}", **other)) != page_run_to_run(first), other
