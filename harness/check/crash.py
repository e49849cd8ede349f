"""Who raised: an exception met during a check, attributed to the side whose
code raised it.

- `engine`: the engine under test (harness/engine, harness/ports,
  harness/faults, and whatever code they call: a stage swapped into the
  pipeline);
- `port`: the port under test (`--impl`) raised inside its own code, e.g.
  under the installed SGLang an environment variable it reads is gone or an
  import moved: not a divergence, not a pass (its own verdict, exit 4),
  named by the port's file:line and the installed SGLang version;
- `oracle`: the float64 reference (reference/);
- `ddcheck`: ddcheck's own code (harness/check: the comparison, the
  localizer, records, the noise-floor twin; harness/verdict, the reports, the
  workflows; and two instruments inside the engine's folders: the KV canary
  and the port audit).

The innermost frame in one of those folders, or in the port's loaded
module, decides: a frame in a library (torch, SGLang), in ddschema/ or in a
file outside the project (a test) is passed over, so a stage defined in a
test and called by the engine is the engine's, an exception torch raises
inside ddcheck's comparison is ddcheck's, and one SGLang raises where the
port called it is the port's.


Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

import traceback
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from harness.check.project import ROOT, project_path  # noqa: F401  (ROOT: read by callers as crash.ROOT)
from harness.check.refusal import refused_by
from harness.ports.loading import PORT_MODULE_PREFIX


ENGINE_PACKAGES = {"engine", "ports", "faults"}
# files inside the engine's folders that are ddcheck's instruments, not the engine
DDCHECK_FILES = {"harness/engine/mem/provenance.py", "harness/ports/audit.py"}

SIDES = ("engine", "port", "oracle", "ddcheck")


@dataclass(frozen=True)
class Crash:
    side: str          # engine | oracle | ddcheck
    where: str         # file:line (function) of the innermost frame of that side
    raised_at: str     # file:line (function) of the innermost frame of all (a library's, a port's)
    error: str         # the exception's last line, e.g. "ValueError: free of KV slot 7, which is not allocated"
    step: int | None   # the last verify step the engine produced (None: it raised before the first)
    traceback: str
    in_step: bool = False   # raised while that step was being checked (else: after it, in the engine's next round)
    sglang: str | None = None   # the installed SGLang's version ("not installed"): set for a port's own raise
    refusal: str | None = None  # "module:Class" of the validator it was raised in (harness/check/refusal.py)

    def __post_init__(self) -> None:
        if self.side not in SIDES:
            raise ValueError(f"crash side must be one of {SIDES}, got {self.side!r}")

    @property
    def who(self) -> str:
        return {"engine": "the engine under test", "port": "the port under test", "oracle": "the oracle",
                "ddcheck": "ddcheck itself (an internal error)"}[self.side]

    def sentence(self) -> str:
        when = (" before the first verify step" if self.step is None else
                f" while verify step {self.step} was checked" if self.in_step else f" after verify step {self.step}")
        own = f" in its own code, under SGLang {self.sglang}" if self.side == "port" else ""
        return f"{self.who} raised {self.error} at {self.where}{own}{when}"

    def record(self, setting: str) -> dict:
        return {"kind": "crash", "setting": setting, "side": self.side, "where": self.where,
                "raised_at": self.raised_at, "error": self.error, "step": self.step,
                "in_step": self.in_step, "sglang": self.sglang, "sentence": self.sentence(),
                "traceback": self.traceback}

    def brief(self) -> dict:
        """What the summary carries."""
        return {"side": self.side, "where": self.where, "error": self.error, "step": self.step,
                "in_step": self.in_step, "sglang": self.sglang, "sentence": self.sentence(),
                **({"refusal": self.refusal} if self.refusal else {})}


# the engine's files -> the verify stage (in the domain's words, localize/wrong.STAGE_WORDS, plus "load") whose
# code they are; the loop and the pipeline's wiring belong to no one stage. The allocator's own raises (mem/) are
# the commit's: a double free or a leak its caller made, most often (the KV allocation rung of a crash's proof
# by replacement, localize/memory_rungs.py, tells an allocator that is itself wrong)
CRASH_STAGES = (("harness/engine/graph.py", "graph"), ("harness/engine/serving_graph.py", "graph"),
                ("harness/engine/attn/", "attention"), ("harness/engine/model/llama.py", "model"),
                ("harness/engine/model/", "load"), ("harness/engine/ddtree/tree.py", "tree build"),
                ("harness/engine/ddtree/drafter.py", "tree build"), ("harness/engine/ddtree/mask.py", "mask"),
                ("harness/engine/ddtree/window.py", "mask"), ("harness/engine/ddtree/verify_slots.py", "KV allocation"),
                ("harness/engine/ddtree/verify_", "verify inputs"),
                ("harness/engine/ddtree/accept", "accept"), ("harness/engine/ddtree/commit", "commit"),
                ("harness/engine/mem/", "commit"))


# the first divergence of a run whose engine crashed at a step that a stage's replacement makes run and match the
# oracle (harness/check/localize/stage_swap.py, harness/cli/watchdog.py): a divergence of that step, the crash its
# evidence; an unproven crash stays a `crash`
PROVEN_CRASH = "proven-crash"


def proven_crash_detail(step: int | None, error: str, where: str, stage: str, replaced_by: str,
                        error_after: float | None, judged_at: int | None = None, when: str | None = None) -> str:
    """The first divergence's sentence for a proven crash: what the engine did not produce, why, and the proof.
    judged_at: the replaced run ended after that step without raising (the engine raised after its last step,
    retiring its requests) and was judged there."""
    after = "" if error_after is None else f" (error {error_after:.3g}x its bound)"
    if judged_at is not None:
        return (f"the engine raised after step {judged_at}, the run's last: {error} at {where}; with the {stage} "
                f"stage replaced by {replaced_by} the run ends there without raising and step {judged_at} matches "
                f"the oracle{after}")
    at = when or (f"at step {step}" if step is not None and step >= 0 else "at the step its process died in")
    if when is not None:   # a rerun from the start: the whole run, not one step, is what was judged
        return (f"the engine produced no logits {at}: {error} at {where}; with the {stage} stage replaced by "
                f"{replaced_by} the run ends and matches the oracle{after}")
    return (f"the engine produced no logits {at}: {error} at {where}; with the {stage} stage replaced by "
            f"{replaced_by} the step runs and matches the oracle{after}")


KILLED_RERUN = "a float64 softmax of the same inputs, from the start, in a new process"


def prove_killed(summary: dict, rerun: dict | None) -> None:
    """A killed run's summary (harness/cli/watchdog.py, harness/workflows/worker_deaths.py) with the outcome of
    the same run again in a new process with its attention replaced by a float64 softmax from the start
    (`rerun`: its summary; None: none came back) as its replacement (prove_from_start)."""
    prove_from_start(summary, "attention", "a float64 softmax of the same inputs", KILLED_RERUN, rerun,
                     "the killed run rerun in a new process", None)


def prove_from_start(summary: dict, stage: str, replaced: str, replaced_by: str, rerun: dict | None,
                     note: str, when: str | None = "before its first verify step") -> bool:
    """A crashed run's summary (a dict, as written) with one more rung: the same run again in a new process with
    `stage` replaced by `replaced_by` from the start (harness/check/from_start.py; `rerun`: its summary, None:
    none came back). When the rerun ends without a crash and matches the oracle, the stage is proven and the
    crash is a divergence (PROVEN_CRASH); True then. `replaced`: the replacement's short name in the record;
    `when`: when the engine raised (None: a killed process, at the step it died in)."""
    if rerun is None:
        return False
    correct = rerun.get("verdict") == "pass" and not rerun.get("crash")
    bound = rerun.get("max_noise_ratio") or ((rerun.get("max_rel_err") or 0.0) / (rerun.get("tolerance") or 1.0))
    after = None if rerun.get("crash") else bound
    said = ("correct: the cause" if correct else
            "still " + ("crashed" if rerun.get("crash") else "diverging") + f" ({rerun.get('verdict')})")
    sentence = (f"{stage} replaced by {replaced_by}: the run crashed -> "
                f"{'crashed' if after is None else f'error {after:.3g}x its bound'} ({said})")
    summary["replacements"] = [*summary.get("replacements", []),
                               {"stage": stage, "replaced_by": replaced, "step": None, "error_before": None,
                                "error_after": after, "correct": correct, "note": note, "sentence": sentence}]
    if not correct:
        return False
    summary["explanation"] = f"{summary.get('explanation')}; proven by replacement: {sentence}"
    summary["stage"], summary["quantity"] = stage, "crash"
    crash = summary.get("crash") or {}
    detail = proven_crash_detail(None, crash.get("error") or "?", crash.get("where") or "?", stage,
                                 replaced_by, after, when=when)
    summary["first"] = {**(summary.get("first") or {"step": -1, "request": -1, "node": -1, "depth": None,
                                                      "padding_present": False, "rel_err": None}),
                        "what": PROVEN_CRASH, "detail": detail}
    return True


def crash_stage(crash: Crash) -> str | None:
    """The stage whose file the engine's innermost frame is in (None: not the engine's, or its loop's own code).
    A KeyError on a checkpoint tensor name, met by the model's forward, is the loader's: the weights it
    handed over lack the name."""
    if crash.side != "engine":
        return None
    path = crash.where.partition(":")[0]
    stage = next((s for prefix, s in CRASH_STAGES if path.startswith(prefix)), None)
    if stage == "model" and crash.error.startswith(("KeyError: 'model.", "KeyError: 'lm_head.")):
        return "load"
    return stage


def installed_sglang() -> str:
    try:
        return version("sglang")
    except PackageNotFoundError:
        return "not installed"


def side_of(filename: str) -> str | None:
    """engine, oracle, ddcheck, or None (a library, ddschema/, a file outside the project)."""
    rel = project_path(filename)
    if rel is None or "site-packages/" in rel or rel.startswith((".venv/", "tests/")):
        return None
    parts = rel.split("/")
    if parts[0] == "reference":
        return "oracle"
    if parts[0] != "harness":
        return None
    if rel in DDCHECK_FILES:
        return "ddcheck"
    return "engine" if len(parts) > 2 and parts[1] in ENGINE_PACKAGES else "ddcheck"


def _shown(frame: traceback.FrameSummary) -> str:
    rel = project_path(frame.filename)
    if rel is None:
        name = frame.filename
        cut = name.rfind("site-packages/")
        rel = name[cut + len("site-packages/"):] if cut >= 0 else name
    return f"{rel}:{frame.lineno} ({frame.name})"


def _is_port_frame(frame) -> bool:
    """A frame of the port's own code: its module is one ddcheck loaded from the user's file."""
    return str(frame.f_globals.get("__name__", "")).startswith(PORT_MODULE_PREFIX)


def attribute(e: BaseException, step: int | None = None, in_step: bool = False) -> Crash:
    """The side whose code raised `e`; a traceback with no frame of any side
    (raised in a library called from nowhere we know) is ddcheck's."""
    walked = list(traceback.walk_tb(e.__traceback__))
    frames = traceback.extract_tb(e.__traceback__)
    if isinstance(e, RuntimeError) and isinstance(e.__cause__, StopIteration):
        # PEP 479: a StopIteration out of a generator's code surfaces as a RuntimeError at the frame that iterated
        # the generator; the generator's frames, and the code that raised, are only in its cause's traceback
        walked += list(traceback.walk_tb(e.__cause__.__traceback__))
        frames.extend(traceback.extract_tb(e.__cause__.__traceback__))
    if isinstance(e, SyntaxError) and e.filename:   # the error is in the file being compiled, not in its importer
        frames.append(traceback.FrameSummary(e.filename, e.lineno or 0, "<module>"))
    side, where = "ddcheck", None
    # an instrument refusing what the engine handed it (mem/provenance.py HandedWrong): its caller's bug
    handed = getattr(e, "caller_is_at_fault", False)
    for (live, _), frame in zip(reversed(walked), reversed(frames)):
        found = "port" if _is_port_frame(live) else side_of(frame.filename)
        if handed and found == "ddcheck" and project_path(frame.filename) in DDCHECK_FILES:
            continue
        if found is not None:
            side, where = found, _shown(frame)
            break
    raised_at = _shown(frames[-1]) if frames else "?"
    error = traceback.format_exception_only(type(e), e)[-1].strip()
    return Crash(side, where or raised_at, raised_at, error, step,
                 "".join(traceback.format_exception(type(e), e, e.__traceback__)), in_step,
                 installed_sglang() if side == "port" else None, refused_by(e) if side == "engine" else None)
