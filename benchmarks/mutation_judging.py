"""The pure parts of the mutation-engine benchmark (benchmarks/mutation_engine.py):
the truth table (benchmarks/mutation_truth.toml), a mutant's outcome from its
runs over the quick matrix, an explanation's score against the truth, the
stratified sample, and the per-module / per-operator tallies. No processes,
no files but the truth table."""
from __future__ import annotations

import ast
import random
import tomllib
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

# a mutant's outcome, first to last by what it says of ddcheck
OUTCOMES = ("caught", "crash-only", "no-judge", "timeout", "survived", "equivalent", "incompetent")
NOT_CHANGING = ("equivalent", "incompetent")   # outcomes of mutants that change no behaviour a run can see
SCORES = ("right", "unknown", "wrong")
MODULE_LEVEL = "<module>"
INTERNAL_ERROR = "ddcheck: internal error"


@dataclass(frozen=True)
class Mutant:
    """One mutation as cosmic-ray's `init` lists it."""
    module: str                 # path relative to the repository root
    operator: str               # cosmic-ray's operator name, e.g. core/ReplaceBinaryOperator_Add_Sub
    occurrence: int             # its index among that operator's sites in the module (what `cosmic-ray apply` takes)
    line: int                   # 1-based line of the mutated node
    col: int
    definition: str | None      # the innermost def/class around it (None: module level)

    def __post_init__(self):
        if self.occurrence < 0 or self.line < 1 or not self.module or not self.operator:
            raise ValueError(f"not a mutant: {self}")

    @property
    def key(self) -> str:
        return f"{self.module}:{self.operator}:{self.occurrence}"

    @classmethod
    def from_dump(cls, work_item: dict) -> "Mutant":
        """From one line of `cosmic-ray dump` (its work item; one mutation per item)."""
        (m,) = work_item["mutations"]
        return cls(m["module_path"], m["operator_name"], int(m["occurrence"]), int(m["start_pos"][0]),
                   int(m["start_pos"][1]), m.get("definition_name"))


@dataclass(frozen=True)
class ModuleTruth:
    path: str
    stage: str
    functions: dict[str, str] = field(default_factory=dict)   # definition name -> stage
    skip: dict[str, str] = field(default_factory=dict)        # definition name -> why out of scope


@dataclass(frozen=True)
class Truth:
    """Each module's stage (benchmarks/mutation_truth.toml) and the localizer words that name each stage."""
    stages: dict[str, tuple[str, ...]]
    modules: dict[str, ModuleTruth]

    def __post_init__(self):
        for m in self.modules.values():
            for stage in (m.stage, *m.functions.values()):
                if stage not in self.stages:
                    raise ValueError(f"{m.path}: stage {stage!r} is not one of {sorted(self.stages)}")

    @classmethod
    def load(cls, path: Path) -> "Truth":
        raw = tomllib.loads(path.read_text())
        mods = {m["path"]: ModuleTruth(m["path"], m["stage"], dict(m.get("functions", {})), dict(m.get("skip", {})))
                for m in raw["module"]}
        return cls({k: tuple(v) for k, v in raw["stages"].items()}, mods)

    def in_scope(self, m: Mutant) -> bool:
        mt = self.modules.get(m.module)
        return mt is not None and (m.definition or MODULE_LEVEL) not in mt.skip

    def stage_of(self, m: Mutant) -> str:
        mt = self.modules[m.module]
        return mt.functions.get(m.definition or MODULE_LEVEL, mt.stage)


def score_explanation(truth: Truth, expected_stage: str, named_stage: str | None) -> str:
    """right: the summary's stage names the mutant's; unknown: it names none; wrong: another stage."""
    if not named_stage:
        return "unknown"
    return "right" if named_stage in truth.stages[expected_stage] else "wrong"


@dataclass(frozen=True)
class SettingRun:
    """One setting of the matrix, as the mutant's run ended."""
    exit: int
    what: str | None            # the summary's first divergence kind (node, stream, crash, ...); None: no summary
    has_summary: bool
    internal_error: bool        # ddcheck's own code raised (its one line on stderr)
    fingerprint: str | None     # the engine's outputs (mutation_common.engine_outputs)


# the summary's first divergence of a crash whose stage a replacement proved (harness/check/crash.py PROVEN_CRASH):
# the crashed step rerun with that stage replaced runs and matches the oracle. A divergence, counted as caught,
# and tallied apart (caught_by_proven_crash) so the figures say how many were value divergences
PROVEN_CRASH = "proven-crash"


def setting_outcome(r: SettingRun) -> str:
    if r.exit == 0:
        return "pass"
    if r.exit == 124:
        return "timeout"
    if r.exit == 1 and r.what != "crash" and r.has_summary:   # a value divergence, or a proven crash
        return "caught"
    if r.exit == 3 or r.internal_error:
        return "no-judge"
    return "crash-only"   # exit 1 on a crash of the engine, a refusal (2), a signal, or no summary at all


def mutant_outcome(runs: list[SettingRun], baseline: list[str | None]) -> str:
    """The mutant's outcome over the settings it ran (in matrix order; a run stops at the first caught)."""
    if not runs:
        raise ValueError("a mutant with no runs has no outcome")
    per = [setting_outcome(r) for r in runs]
    for o in ("caught", "crash-only", "no-judge", "timeout"):
        if o in per:
            return o
    if len(runs) == len(baseline) and all(r.fingerprint == b for r, b in zip(runs, baseline)):
        return "equivalent"
    return "survived"


def compiles(source: str, module: str) -> bool:
    """Whether the mutated module is Python at all: a mutant that is not (cosmic-ray turns `**kwargs` into
    `^kwargs`) is incompetent, as mutation testing names it: never run, counted apart from the
    behaviour-changing ones, like an equivalent mutant."""
    try:
        compile(source, module, "exec", dont_inherit=True)
    except SyntaxError:
        return False
    return True


def stillborn(row: dict) -> bool:
    """A row judged before the compile check: every run ended on a SyntaxError of the mutated module itself."""
    tails = [r.get("stderr_tail") or "" for r in row.get("runs", [])]
    where = "SyntaxError: "
    return bool(tails) and all(where in t and f" at {row['module']}:" in t for t in tails)


def caught_by(runs: list[SettingRun]) -> str | None:
    """How the first setting that caught the mutant caught it: `proven-crash` (the engine crashed and a stage's
    replacement made the step run and match) or `divergence` (a wrong value); None when none caught it."""
    first = next((r for r in runs if setting_outcome(r) == "caught"), None)
    if first is None:
        return None
    return PROVEN_CRASH if first.what == PROVEN_CRASH else "divergence"


def annotation_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) of every annotation: under `from __future__ import annotations` a mutant inside one
    changes no behaviour (`int | None` -> `int - None`), so it is left out before sampling."""
    spans = []
    for node in ast.walk(ast.parse(source)):
        notes = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            notes = [a.annotation for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs,
                                            node.args.vararg, node.args.kwarg) if a is not None] + [node.returns]
        elif isinstance(node, ast.AnnAssign):
            notes = [node.annotation]
        spans += [((n.lineno, n.col_offset), (n.end_lineno, n.end_col_offset)) for n in notes if n is not None]
    return spans


def in_annotation(m: Mutant, spans: list[tuple[tuple[int, int], tuple[int, int]]]) -> bool:
    return any(a <= (m.line, m.col) < b for a, b in spans)


def stratified_sample(mutants: list[Mutant], n: int, seed: int) -> list[Mutant]:
    """N mutants, round-robin over modules (each module's shuffled by SEED): every module is sampled
    before any is sampled twice, and a run cut short still covers the modules evenly."""
    rng = random.Random(seed)
    by_module: dict[str, list[Mutant]] = defaultdict(list)
    for m in sorted(mutants, key=lambda m: m.key):
        by_module[m.module].append(m)
    queues = []
    for mod in sorted(by_module):
        q = by_module[mod][:]
        rng.shuffle(q)
        queues.append(q)
    out: list[Mutant] = []
    while len(out) < n and any(queues):
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop())
    return out


def operator_family(operator: str) -> str:
    """core/ReplaceBinaryOperator_Add_Sub -> ReplaceBinaryOperator: the tallies' per-operator key."""
    return operator.split("/")[-1].split("_")[0]


BY_PROVEN_CRASH = "caught_by_proven_crash"


def tally(rows: list[dict], key: str) -> dict[str, dict[str, int]]:
    """Per KEY value: how many mutants ended in each outcome, and how the caught ones' explanations scored."""
    out: dict[str, dict[str, int]] = {}
    for r in rows:
        t = out.setdefault(r[key], {"caught": 0, BY_PROVEN_CRASH: 0, **{o: 0 for o in OUTCOMES},
                                    **{s: 0 for s in SCORES}, "internal_errors": 0})
        t[r["outcome"]] += 1
        if r["outcome"] == "caught":
            t[r["explanation_score"]] += 1
            t[BY_PROVEN_CRASH] += r.get("caught_by") == PROVEN_CRASH   # rows before proven crashes: none
        t["internal_errors"] += int(r["internal_error"])
    return dict(sorted(out.items()))


def totals(rows: list[dict]) -> dict:
    """The issue's figures: over behaviour-changing mutants (all but equivalent), the share caught as a
    divergence (of them, how many by a wrong value and how many by a proven crash) and not judged; over caught
    ones, the explanations right / unknown / wrong."""
    t = tally([{**r, "all": "all"} for r in rows], "all").get("all", {})
    changing = len(rows) - sum(t.get(o, 0) for o in NOT_CHANGING)
    caught = t.get("caught", 0)
    share = (lambda k, n: round(t.get(k, 0) / n, 4) if n else None)
    t["caught_by_value_divergence"] = caught - t.get(BY_PROVEN_CRASH, 0)
    return {"mutants": len(rows), "behaviour_changing": changing, **{o: t.get(o, 0) for o in OUTCOMES},
            "caught_by_value_divergence": t["caught_by_value_divergence"],
            BY_PROVEN_CRASH: t.get(BY_PROVEN_CRASH, 0), "internal_errors": t.get("internal_errors", 0),
            "caught_share": share("caught", changing),
            "caught_by_value_divergence_share": share("caught_by_value_divergence", changing),
            "caught_by_proven_crash_share": share(BY_PROVEN_CRASH, changing),
            "no_judge_share": share("no-judge", changing),
            **{f"explained_{s}": t.get(s, 0) for s in SCORES},
            **{f"explained_{s}_share": share(s, caught) for s in SCORES}}


def markdown(per: dict[str, dict[str, int]], key: str) -> str:
    """A tally as a markdown table (docs/MUTATIONS.md's per-module and per-operator tables)."""
    cols = ("caught", BY_PROVEN_CRASH, *OUTCOMES[1:], *SCORES, "internal_errors")
    lines = [f"| {key} | " + " | ".join(c.replace("_", " ") for c in cols) + " |",
             "| --- |" + " --- |" * len(cols)]
    lines += [f"| {k} | " + " | ".join(str(t[c]) for c in cols) + " |" for k, t in per.items()]
    return "\n".join(lines)
