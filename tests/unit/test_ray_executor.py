"""`--executor ray` on a local Ray cluster on the CPU (skipped where Ray is
not installed): the gate's records, JUnit and HTML are those of the process
pool, timings and run ids aside; a worker that dies has its setting rerun,
and the summary counts the rerun."""
import json
import os
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray is an optional extra (pip install 'ddcheck[ray]')")

from harness.check.records import same_run_to_run  # noqa: E402
from harness.report.html import page_run_to_run  # noqa: E402
from harness.workflows.cases import load_case  # noqa: E402
from harness.workflows.executors.ray_executor import RayExecutor  # noqa: E402
from harness.workflows.gate import junit_run_to_run, plan  # noqa: E402
from harness.workflows.sweep import on_device, run_job, worker_died  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CASE = ROOT / "tests/fixtures/cases/ray_small.toml"


@pytest.fixture(scope="module", autouse=True)
def local_cluster():
    """One local cluster of 2 CPUs for the module (a start costs seconds); the
    executor joins it, as it joins one given by --ray-address."""
    from harness.workflows.sweep import prepare_environment
    prepare_environment()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def _records(path: Path) -> list[dict]:
    """The records with what differs run to run taken out."""
    return [same_run_to_run(json.loads(ln)) for ln in path.read_text().splitlines()]


def _gate(tmp_path: Path, name: str, *flags: str):
    """The gate on CASE: the CLI's result and its records, JUnit and HTML report, each with what differs
    run to run taken out."""
    from typer.testing import CliRunner

    import harness.cli.gate_cmd  # noqa: F401  (registers the command)
    from harness.cli import app
    out, junit, page = (tmp_path / f"{name}.{ext}" for ext in ("jsonl", "xml", "html"))
    r = CliRunner().invoke(app, ["gate", str(CASE), "--device", "cpu", "--out", str(out), "--junit", str(junit),
                                 "--html", str(page), *flags])
    assert r.exit_code == 0, r.output
    return r, _records(out), junit_run_to_run(junit.read_text()), page_run_to_run(page.read_text())


def test_gate_on_ray_gives_the_pools_records_junit_and_html(tmp_path):
    """The pool with 2 jobs and Ray with 2 workers: both spread the settings over two processes, in
    whichever order they finish; what they write is the same."""
    pool, *pool_outputs = _gate(tmp_path, "pool", "--jobs", "2")
    on_ray, *ray_outputs = _gate(tmp_path, "ray", "--executor", "ray", "--workers", "2")
    assert "gate: PASS: 4 settings, 1 expected faults" in on_ray.output
    records, junit, page = ray_outputs
    assert len(records) > 5 and "<testcase" in junit and "<table" in page   # something real was compared
    same = {what: mine == pools for what, mine, pools in zip(("records", "junit", "html"), ray_outputs, pool_outputs)}
    assert same == {"records": True, "junit": True, "html": True}


def test_a_dead_worker_reruns_its_setting_and_the_summary_counts_it(tmp_path):
    """Setting 0's worker dies once: rerun, it passes, its summary counts the
    rerun. Setting 1's worker dies every time: after its one rerun it is unjudged."""
    jobs = on_device(plan([load_case(CASE)]), "cpu")[:2]
    marker = str(tmp_path / "died-once")

    def dying(job):   # a worker dying as a killed process does
        if job.index == 1:
            os._exit(1)
        if not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)
        return run_job(job)

    got = {}
    RayExecutor(workers=2, max_reruns=1).run(jobs, lambda r: got.setdefault(r.index, r), dying, worker_died)
    assert sorted(got) == [0, 1]
    rerun = got[0].summary
    assert rerun["reruns"] == 1 and rerun["rerun_reasons"][0].startswith("WorkerCrashedError")
    assert got[0].passed and json.loads(got[0].lines[-1]) == rerun   # the record the JSONL gets says so too
    lost = got[1].summary
    assert lost["reruns"] == 1 and len(lost["rerun_reasons"]) == 2   # one rerun, two deaths
    assert not got[1].passed and lost["verdict"] == "internal-error" and "died 2 times" in lost["error"]
