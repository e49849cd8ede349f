"""The HTML report in a real browser: headless Debian chromium opens the report
of a failing run (the seed's bug, padded-kv-visible), no script errors, the
grid and the per-node chart are drawn, and the mask heatmap with its leaked
cells whenever a localize record is present. A second page, built from
hand-made records, always carries a heatmap. Screenshots go to reports/."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "unit"))
from report_fixtures import failing_records, write  # noqa: E402

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (`make test` installs "
                                                          "it: apt-get install -y chromium)")]
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1280,2000"]


def _chromium(tmp_path: Path, *args: str) -> str:
    profile = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}"
    r = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def _open(tmp_path: Path, page: Path, shot: Path) -> dict:
    """Dump the DOM after the page's script ran; save a screenshot."""
    dom = _chromium(tmp_path, "--virtual-time-budget=5000", "--dump-dom", page.as_uri())
    shot.parent.mkdir(parents=True, exist_ok=True)
    _chromium(tmp_path, f"--screenshot={shot}", page.as_uri())
    assert shot.stat().st_size > 10_000
    errors = re.search(r'<div id="js-errors"[^>]*>(.*?)</div>', dom, re.S)
    assert errors is not None and errors.group(1).strip() == "", f"script errors: {errors.group(1)}"
    status = re.search(r'<div id="render-status"([^>]*)>', dom)
    assert status and 'data-drawn="1"' in dom, "the report's script did not finish"
    attrs = dict(re.findall(r'data-([\w-]+)="(\d+)"', status.group(1)))
    assert attrs["errors"] == "0"
    return {k: int(v) for k, v in attrs.items()}


def test_report_of_the_seeds_bug_draws_in_chromium(tmp_path):
    records, page = tmp_path / "run.jsonl", tmp_path / "run.html"
    run = subprocess.run([sys.executable, "-c", "from harness.cli import main; main()", "run", "--budget", "16",
                          "--topk", "1", "--no-cuda-graph", "--backend", "torch", "--max-new-tokens", "4",
                          "--fault", "padded-kv-visible", "--out", str(records), "--html", str(page)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stderr[-2000:]
    drawn = _open(tmp_path, page, ROOT / "reports" / "browser-report.png")
    assert drawn["grid-cells"] == 1 and drawn["failing-cells"] == 1
    assert drawn["chart-points"] > 0 and drawn["tree-nodes"] > 0 and drawn["streams"] >= 1
    kinds = {json.loads(line)["kind"] for line in records.read_text().splitlines()}
    if "localize" in kinds:
        assert drawn["heatmaps"] == 2 and drawn["heatmap-cells"] > 0
        assert drawn["leaked-cells"] > 0, "the padding columns leaked by the seed's bug must show in the heatmap"


def test_heatmap_from_a_localize_record_draws_in_chromium(tmp_path):
    page = tmp_path / "fixture.html"
    from harness.report.html import write_report
    write_report([write(tmp_path / "fixture.jsonl", failing_records())], page)
    drawn = _open(tmp_path, page, ROOT / "reports" / "browser-report-fixture.png")
    assert drawn["heatmaps"] == 2 and drawn["heatmap-cells"] == 2 * 9 * 13 and drawn["leaked-cells"] == 20
    assert drawn["layer-points"] == 3
