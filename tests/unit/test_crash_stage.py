"""An engine crash names the stage whose code raised (harness/check/crash.py
crash_stage) when the verify inputs it was handed break no rule: a graph
replay's shape error is the graph stage's, a kernel that kills its process
the attention stage's (issue 21, cases f and i)."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import harness.cli as cli
from harness.check.crash import Crash, crash_stage

cli._register()

RUN = ["run", "--backend", "torch", "--budget", "4", "--topk", "2", "--batch", "2", "--max-new-tokens", "4",
       "--cuda-graph"]


@pytest.mark.parametrize("where, error, stage", [
    ("harness/engine/graph.py:147 (verify)", "RuntimeError: expanded size", "graph"),
    ("harness/engine/attn/torch_backend.py:32 (forward)", "the process died by SIGSEGV", "attention"),
    ("harness/engine/ddtree/commit.py:20 (commit_kv)", "ValueError: free", "commit"),
    ("harness/engine/ddtree/verify_inputs.py:93 (build_verify_batch)", "IndexError", "verify inputs"),
    ("harness/engine/model/llama.py:110 (_mlp)", "RuntimeError: mat1", "model"),
    ("harness/engine/model/llama.py:73 (_norm)", "KeyError: 'model.layers.0.post_attention_layernorm.weight'", "load"),
    ("harness/engine/loop.py:200 (_round)", "RuntimeError", None),   # the loop's own code: no one stage
])
def test_the_engine_file_names_the_stage(where, error, stage):
    assert crash_stage(Crash("engine", where, where, error, 0, "")) == stage


def test_only_the_engines_crashes_name_a_stage():
    assert crash_stage(Crash("ddcheck", "harness/engine/graph.py:1 (x)", "?", "E", 0, "")) is None


def test_a_graph_replay_that_raises_is_named_the_graph_stage(tmp_path, monkeypatch):
    from harness.engine import graph

    def capture(self, bucket, longest_prefix, windowed):   # a shape error met where the runner calls it
        raise RuntimeError("The expanded size of the tensor (18) must match the existing size (27)")
    monkeypatch.setattr(graph.GraphRunner, "_capture", capture)
    out = tmp_path / "r.jsonl"
    result = CliRunner().invoke(cli.app, [*RUN, "--out", str(out)])
    assert result.exit_code == 1, result.output
    summary = json.loads(out.read_text().splitlines()[-1])
    # the eager forward in the graph's place runs the step and matches the oracle: a divergence of that step
    assert summary["first"]["what"] == "proven-crash" and summary["crash"]["where"].startswith("harness/engine/graph.py:")
    assert summary["stage"] == "graph" and summary["quantity"] == "crash"
    assert summary["explanation"].startswith("The graph stage crashed")


def test_a_stopiteration_out_of_the_engines_generator_is_the_engines_not_the_consumers():
    """PEP 479 turns a StopIteration raised inside the engine's `rounds` generator into a RuntimeError whose own
    traceback stops at whoever iterated it (ddcheck's step clock): the raise is attributed from its cause's frames
    (a graph bucket smaller than the batch ended as 'an internal error' in step_clock.py before)."""
    from harness.check.crash import attribute
    from harness.check.step_clock import StepClock
    from harness.engine.loop import Engine

    class Stub:   # the engine's generator over a stand-in whose round hits an exhausted iterator
        def prefill(self):
            pass

        def _retire_finished(self):
            return [0]

        def _round(self, step, active):
            return next(iter(()))
    with pytest.raises(RuntimeError) as caught:
        list(StepClock().timed(Engine.rounds(Stub())))
    crash = attribute(caught.value)
    assert crash.side == "engine" and crash.where.startswith("harness/engine/loop.py"), crash
