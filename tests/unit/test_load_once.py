"""One reading of a checkpoint serves every setting that shares what it depends
on (harness.check.prepare.load_key): a sweep over a checkpoint directory reads it
once, a derived setting gets its own fault and port, and a reading never
serves another model, seed, dtype, device, window or oracle device."""
from dataclasses import replace
from pathlib import Path

import pytest

import harness.check.prepare as prepare_module
from harness.check.differential import check
from harness.engine.model.presets import PRESETS, random_weights, write_checkpoint
from harness.check.prepare import LoadCache, build, derive, load, prepare
from harness.check.records import RecordWriter
from harness.engine.settings import RunSettings
from harness.workflows.sweep import SettingJob, run_jobs

PORTS = Path(__file__).parents[1] / "fixtures" / "ports"


@pytest.fixture
def counted_reads(monkeypatch):
    reads = []
    real = prepare_module.load_checkpoint

    def counting(directory):
        reads.append(directory)
        return real(directory)
    monkeypatch.setattr(prepare_module, "load_checkpoint", counting)
    return reads


def test_a_sweep_over_a_checkpoint_directory_reads_it_once_per_seed(tmp_path, counted_reads):
    cfg = PRESETS["tiny"]
    ck = write_checkpoint(tmp_path / "ck", cfg, random_weights(cfg, 0))
    base = RunSettings(model=str(ck), backend="torch", max_new_tokens=3)
    jobs = [SettingJob(0, base), SettingJob(1, replace(base, budget=8, topk=2)),
            SettingJob(2, replace(base, fault="padded-kv-visible"), expect_fault="padded-kv-visible"),
            SettingJob(3, replace(base, seed=1))]
    results = run_jobs(jobs, 2)
    assert len(counted_reads) == 2                 # seed 0 once for three settings, seed 1 once
    assert [r.passed for r in results] == [True, True, False, True]
    loaded = [bool(r.summary["load_s"].get("engine_load")) for r in results]
    assert sorted(loaded) == [False, False, True, True]   # a setting that reused a reading says so: no load time


def test_a_derived_setting_gets_its_own_fault_and_port():
    p = prepare(RunSettings(backend="torch", max_new_tokens=2))
    port = f"ddtree-utils:{PORTS / 'ddtree_utils' / 'faithful.py'}"
    q = derive(p, replace(p.settings, impl=port))
    assert q.port is not None and q.oracle is p.oracle
    r = derive(p, replace(p.settings, fault="padded-kv-visible"))
    assert r.port is None and r.engine.pipeline != p.engine.pipeline
    assert not check(r, RecordWriter(None), localize=False).passed


def test_a_reading_serves_only_its_own_key(counted_reads):
    s = RunSettings(backend="torch", max_new_tokens=2)
    loaded = load(s)
    for other in (replace(s, seed=1), replace(s, dtype="bfloat16"), replace(s, sliding_window=4),
                  replace(s, oracle_device="cpu")):
        with pytest.raises(ValueError, match="model, seed, dtype"):
            build(other, loaded)
    cache = LoadCache()
    cache.prepare(s)
    cache.prepare(replace(s, budget=8))
    cache.prepare(replace(s, seed=2))
    assert len(counted_reads) == 1 + 2


def test_torch_under_real_cuda_graphs_is_a_usage_error_for_a_run():
    from harness.engine.attn import make_backend
    from harness.check.prepare import check_capturable
    from harness.engine.settings import NotRunnableHere, UsageError
    s = RunSettings(backend="torch", cuda_graph=True, device="cuda")
    torch_backend = make_backend("torch", "cpu", s.torch_dtype)   # the same backend object: reads indptrs on the host
    with pytest.raises(NotRunnableHere, match="can be captured") as e:
        check_capturable(s, torch_backend)
    assert isinstance(e.value, UsageError)                        # `run` exits 2 on it
    check_capturable(replace(s, device="cpu"), torch_backend)      # the CPU's graph runner replays the closure


def test_a_matrix_setting_this_machine_cannot_run_is_a_skip_not_an_error(monkeypatch):
    from harness.engine.settings import NotRunnableHere
    from harness.workflows.sweep import run_job, verdict

    def cannot(self, s, prompts=None):
        raise NotRunnableHere("--cuda-graph on CUDA needs a backend that can be captured")
    monkeypatch.setattr(LoadCache, "prepare", cannot)
    job = SettingJob(0, RunSettings(backend="torch", cuda_graph=True))
    r = run_job(job)
    assert r.usage_error is None and verdict(job, r) == "skip"
    assert "can be captured" in r.summary["skipped"]
