"""`ddcheck reduce`: from a failing run's records, the smallest setting that
still fails the same way, found by greedy shrinking one axis at a time
(fewest requests, fewest tokens to generate, fewest layers, shortest prompt,
smallest budget, smallest topk), each candidate re-run against the oracle.

"Fails the same way": the check's verdict is a divergence whose first kind
(node, padding, stream, accept, tree, crash, ...) is the original's. Every
candidate runs with --stop-after 1 and no localizer (the first divergent
step is all a candidate has to show); the reduced setting is run once more
with the localizer, to name what its repro shows.


Layer: workflows. Imports report, the check and below; never cli."""
from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Callable, Iterator

from harness.engine.settings import PromptSpec, RunSettings, UsageError, prompt_tokens

MAX_PASSES = 3


@dataclass(frozen=True)
class Candidate:
    settings: RunSettings              # stop_after 1; model may be a staged checkpoint with fewer layers
    prompts: tuple[PromptSpec, ...]    # one per request, tokens explicit
    layers: int                        # decoder layers of its model


@dataclass(frozen=True)
class Reduced:
    recorded: RunSettings      # the failing run's settings, as recorded
    original: Candidate
    reduced: Candidate
    kind: str                  # the failure kind both show
    step: int                  # the reduced run's first divergent verify step (-1: none, e.g. a stream or load)
    first: str                 # one line: the reduced run's first divergence
    fault_class: str | None    # the localizer's class on the reduced run
    runs: int                  # candidates run


def failing_summary(path: Path) -> dict:
    """The first failing run's summary in a records file; UsageError when the
    file is unreadable, is not records, or holds no divergent run."""
    if not path.is_file():
        raise UsageError(f"{path}: no such records file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: cannot read it ({type(e).__name__})") from None
    summaries = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            raise UsageError(f"{path}: line {i + 1} is not JSON; not a records file") from None
        if isinstance(rec, dict) and rec.get("kind") == "summary" and isinstance(rec.get("settings"), dict):
            summaries.append(rec)
    if not summaries:
        raise UsageError(f"{path}: no summary record; not the records of a finished run")
    failing = [s for s in summaries if not s.get("passed", True) and not s.get("skipped")
               and s.get("verdict", "diverge") == "diverge"]
    if not failing:
        unjudged = sum(s.get("verdict") in ("internal-error", "oracle-crash") for s in summaries)
        raise UsageError(f"{path}: no run diverged ({len(summaries) - unjudged} passed"
                         + (f", {unjudged} could not be judged" if unjudged else "") + "); nothing to reduce")
    return failing[0]


def settings_of(summary: dict) -> RunSettings:
    known = {f.name for f in fields(RunSettings)}
    d = {k: v for k, v in summary["settings"].items() if k in known}
    if d.get("prompt_lens") is not None:
        d["prompt_lens"] = tuple(d["prompt_lens"])
    return RunSettings(**d)


def failure_kind(first_what: str | None, audit_errors: int) -> str:
    """A proven crash is the same failure as the crash it proves (a smaller setting may not repeat the proof)."""
    if first_what == "proven-crash":
        return "crash"
    return first_what or ("audit" if audit_errors else "diverge")


def ladder(current: int, start: int = 1) -> list[int]:
    """Values below `current`, smallest first: every one up to 16, then about x1.25 apart."""
    out, v = [], start
    while v < current:
        out.append(v)
        v = v + 1 if v < 16 else v * 5 // 4
    return out


def truncated_layers(model: str, seed: int, n: int, into: Path) -> Path:
    """The run's model with its first `n` decoder layers, written as a checkpoint directory."""
    from harness.engine.model.presets import load_model, write_checkpoint
    cfg, weights = load_model(model, seed)
    keep = {k: w for k, w in weights.items()
            if not (m := re.search(r"layers\.(\d+)\.", k)) or int(m.group(1)) < n}
    into.mkdir(parents=True, exist_ok=True)
    sliding = tuple(i for i in cfg.sliding_layers if i < n)   # the cut keeps its layers' windows
    return write_checkpoint(into, replace(cfg, num_layers=n, sliding_layers=sliding,
                                          sliding_window=cfg.sliding_window if sliding else None), keep)


class Reducer:
    def __init__(self, summary: dict, say: Callable[[str], None] = print) -> None:
        from harness.workflows.cases import prompts_for
        self.say = say
        self.recorded = s = settings_of(summary)
        self.last = ""
        self.kind = failure_kind((summary.get("first") or {}).get("what"), summary.get("audit_errors", 0))
        self._staging = tempfile.TemporaryDirectory(prefix="ddcheck-reduce-")
        from harness.check.prepare import LoadCache
        self._loads = LoadCache()   # one model held at a time; its candidates read it once
        self.runs = 0
        base = self._loads.prepare(replace(s, stop_after=1), prompts_for(s))   # None: the model's own
        vocab, cfg = base.engine.cfg.vocab_size, base.engine.cfg
        prompts = tuple(PromptSpec(p.name, p.length, p.accuracy, tuple(prompt_tokens(p, i, vocab, s.seed)))
                        for i, p in enumerate(base.prompts))   # explicit tokens: a request keeps its prompt
        self.original = Candidate(replace(s, stop_after=1, case=None, prompt_lens=None, prompt_file=None),
                                  prompts, cfg.num_layers)

    def close(self) -> None:
        self._staging.cleanup()

    def fails(self, c: Candidate) -> bool:
        """Run the candidate; True when it fails the same way."""
        from harness.check.differential import check
        from harness.check.prepare import USAGE_ERRORS
        from harness.ports.attach import SettingSkipped
        from harness.check.records import RecordWriter
        self.runs += 1
        try:
            p = self._loads.prepare(c.settings, c.prompts)
            cs = check(p, RecordWriter(None), localize=False)
        except (SettingSkipped, *USAGE_ERRORS) as e:
            self.last = f"cannot run ({e})"
            return False
        kind = failure_kind(cs.first.what if cs.first else None, cs.audit_errors)
        self.last = "passes" if cs.verdict == "pass" else f"{cs.verdict} ({kind})"
        return cs.verdict == "diverge" and kind == self.kind

    # -- the axes: each yields smaller candidates, smallest first ---------------
    def fewer_requests(self, c: Candidate) -> Iterator[tuple[str, Candidate]]:
        n = c.settings.batch
        for k in range(1, n):
            for i in range(n - k + 1):
                yield (f"requests {n} -> {k} (request {i}{f'..{i + k - 1}' if k > 1 else ''})",
                       replace(c, settings=replace(c.settings, batch=k), prompts=c.prompts[i:i + k]))

    def fewer_tokens(self, c: Candidate) -> Iterator[tuple[str, Candidate]]:
        n = c.settings.max_new_tokens
        for v in ladder(n, 2):   # one token is the prefill's: no verify step
            yield f"max_new_tokens {n} -> {v}", replace(c, settings=replace(c.settings, max_new_tokens=v))

    def fewer_layers(self, c: Candidate) -> Iterator[tuple[str, Candidate]]:
        if c.settings.impl is not None:
            return
        for v in ladder(c.layers, 1):
            d = truncated_layers(c.settings.model, c.settings.seed, v, Path(self._staging.name) / f"layers-{v}")
            # a preset cut to a directory keeps its drafter (`auto` would turn a directory's into the self-draft)
            pinned = replace(c.settings, model=str(d), drafter=c.settings.drafter_config(c.layers).kind)
            yield f"layers {c.layers} -> {v}", replace(c, settings=pinned, layers=v)

    def shorter_prompts(self, c: Candidate) -> Iterator[tuple[str, Candidate]]:
        longest = max(len(p.tokens) for p in c.prompts)
        for v in ladder(longest, 1):
            cut = tuple(replace(p, length=min(v, len(p.tokens)), tokens=p.tokens[:v]) for p in c.prompts)
            yield f"prompt length {longest} -> {v}", replace(c, prompts=cut)

    def smaller_budget(self, c: Candidate) -> Iterator[tuple[str, Candidate]]:
        for v in ladder(c.settings.budget, 1):
            yield f"budget {c.settings.budget} -> {v}", replace(c, settings=replace(c.settings, budget=v))

    def smaller_topk(self, c: Candidate) -> Iterator[tuple[str, Candidate]]:
        for v in range(1, c.settings.topk):
            yield f"topk {c.settings.topk} -> {v}", replace(c, settings=replace(c.settings, topk=v))

    def search(self) -> Candidate:
        t0 = time.perf_counter()
        if not self.fails(self.original):
            raise UsageError(f"the recorded setting does not fail here any more ({self.last}); nothing to reduce: "
                             f"{self.original.settings.command()}")
        self.say(f"reduce: the recorded setting fails here ({self.kind}); shrinking one axis at a time")
        c = self.original
        axes = (self.fewer_requests, self.fewer_tokens, self.fewer_layers, self.shorter_prompts,
                self.smaller_budget, self.smaller_topk)
        for n in range(MAX_PASSES):
            before = c
            for axis in axes:
                for what, smaller in axis(c):
                    t = time.perf_counter()
                    failed = self.fails(smaller)
                    self.say(f"reduce: {what}: {'still fails' if failed else self.last} "
                             f"({time.perf_counter() - t:.1f} s)")
                    if failed:
                        c = smaller
                        break
            if c == before:
                break
        self.say(f"reduce: {self.runs} runs in {time.perf_counter() - t0:.1f} s")
        return c

    def localized(self, c: Candidate) -> tuple[int, str, str | None]:
        """The reduced setting run once more, localized: its first step, one line, the class."""
        from harness.check.differential import check
        from harness.check.records import RecordWriter
        from harness.report.model import describe_first
        from harness.check.summary import summary_record
        p = self._loads.prepare(c.settings, c.prompts)
        cs = check(p, RecordWriter(None))
        step = cs.first.step if cs.first and cs.first.what in ("node", "padding", "batch-padding") else -1
        return step, describe_first(summary_record(c.settings, cs)), cs.fault_class


def reduce_records(path: Path, out: Path, say: Callable[[str], None] = print) -> Reduced:
    from harness.workflows.reduce_write import write_outputs
    summary = failing_summary(path)
    r = Reducer(summary, say)
    try:
        c = r.search()
        if c.settings.model != r.original.settings.model and Path(c.settings.model).is_dir():
            model_dir = (out / "model").resolve()   # the checkpoint with fewer layers travels with the case
            if model_dir.exists():
                shutil.rmtree(model_dir)
            shutil.copytree(c.settings.model, model_dir)
            c = replace(c, settings=replace(c.settings, model=str(model_dir)))
        step, first, fault_class = r.localized(c)
        result = Reduced(r.recorded, r.original, c, r.kind, step, first, fault_class, r.runs)
        write_outputs(result, path, out)
        return result
    finally:
        r.close()
