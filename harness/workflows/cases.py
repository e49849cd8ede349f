"""Scenarios as TOML files (cases/*.toml): a model, prompts, a setting matrix,
faults that must be caught, and per-dtype tolerances. Parsing is strict: a bad
key is a CaseError (a usage error, exit 2) naming the file, the key and what
was expected, in one line.

    name = "gate"                      # optional, defaults to the file stem
    description = "one line"
    model = "tiny"                     # preset, trained model (`ddcheck models`) or checkpoint directory
    seed = 0
    max_new_tokens = 12
    block_size = 8
    drafter = "self"                   # optional: noisy | self | auto (self for a checkpoint, noisy for a preset)
    draft_layers = 15                  # optional: the self-draft's k (default all but the target's last two layers)
    impl = "ddtree-utils:path/to/ddtree_utils.py"   # optional: a port under test (FAMILY:PATH, PATH
    port_stages = "build,compile"                   #   relative to the case file), which of its stages
    strict = false                                  #   to use, and whether audit warnings fail

    [[prompts]]                        # optional; default: the seed's prompts
    name = "code"
    length = 14                        # or tokens = [1, 2, 3]
    accuracy = 0.9                     # drafter accuracy on this prompt

    [[matrix]]                         # each table is a product; the case runs their union
    label = "seed"
    budget = [16]                      # scalars or lists; omitted axes take AXIS_DEFAULTS
    topk = [1]
    cuda_graph = [true, false]
    backend = ["torch"]
    batch = [2]
    dtype = ["float32"]
    page_size = [1, 16]                # KV page size (harness/engine/mem/paged.py)
    sliding_window = [0, 8]            # 0: no window; N: a window of N keys (the model's sliding layers, else all)
    prompt_len = 600                   # optional: this table's requests run prompts of 600 tokens drawn from the
                                       #   seed (as --prompt-len 600) instead of the case's prompts
    fault = "padded-kv-visible"        # optional: switch a fault on (the gate must then fail)
    acceptance = { mean_accepted_length = 3.4, band = 0.3 }   # optional: the gate fails a setting of
                                       # this table whose mean accepted length is below 3.4 - 0.3

    [[faults]]                         # faults the gate must catch, with the settings they run under
    name = "padded-kv-visible"
    budget = 16
    topk = 1

    [tolerances]                       # optional: the relative tolerance nodes are judged at, per dtype,
    float32 = 1e-5                     #   or a noise floor (ddcheck calibrate writes these)
    bfloat16 = { multiplier = 1.6, floor = 0.0039, ceiling = 0.2 }

docs/CASES.md documents every key.


Layer: workflows. Imports report, the check and below; never cli."""
from __future__ import annotations

import itertools
import json
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

from harness.check.compare.acceptance_stats import AcceptanceBaseline
from harness.check.prompts import MAX_PROMPT_LEN
from harness.engine.settings import (DEFAULT_PROMPTS, DRAFTER_CHOICES, DTYPES, LIMITS, PAGE_SIZES, PromptSpec,
                                     RunSettings, UsageError)

AXES = ("budget", "topk", "cuda_graph", "backend", "batch", "dtype", "sliding_window", "model", "page_size", "tp")
AXIS_DEFAULTS = {"budget": (16,), "topk": (1,), "cuda_graph": (False,), "backend": ("torch",),
                 "batch": (1,), "dtype": ("float32",), "sliding_window": (0,), "model": ("",), "page_size": (1,),
                 "tp": (1,)}
_AXIS_TYPES = {"budget": int, "topk": int, "cuda_graph": bool, "backend": str, "batch": int, "dtype": str,
               "sliding_window": int, "model": str, "page_size": int, "tp": int}
ZERO_IS_OFF = ("sliding_window",)   # axes whose 0 means "none" (RunSettings holds None)
EMPTY_IS_BASE = ("model",)          # axes whose "" means the case's own (a table may name another model)
_TOP_KEYS = {"name", "description", "model", "seed", "max_new_tokens", "block_size", "prompts", "matrix",
             "faults", "tolerances", "impl", "port_stages", "strict", "drafter", "draft_layers"}
CASES_DIR = Path("cases")
DEFAULT_CASE = CASES_DIR / "gate.toml"


class CaseError(UsageError):
    """A malformed case file: `<file>: key '<key>': expected <what>, got <value>`."""


@dataclass(frozen=True)
class Matrix:
    """One product of setting axes (a [[matrix]] table, a [[faults]] entry's
    settings, or the sweep's flags)."""

    label: str
    axes: dict  # axis -> tuple of values, every axis of AXES present
    fault: str | None = None
    accept: str = "walk"
    acceptance: AcceptanceBaseline | None = None  # the floor its settings' mean accepted length must hold
    prompt_len: int | None = None  # its requests' prompts: this many tokens drawn from the seed (not the case's)

    def settings(self, base: RunSettings) -> list[RunSettings]:
        values = [self.axes[a] for a in AXES]
        if self.prompt_len is not None:   # the setting reproduces with --prompt-len, not the case's prompts
            base = replace(base, case=None, prompt_lens=(self.prompt_len,))
        return [replace(base, fault=self.fault, accept=self.accept,
                        **{a: None if a in ZERO_IS_OFF and v == 0 else v for a, v in zip(AXES, combo)
                           if not (a in EMPTY_IS_BASE and v == "")})
                for combo in itertools.product(*values)]


@dataclass(frozen=True)
class ExpectedFault:
    name: str
    under: Matrix  # the settings it runs under


@dataclass(frozen=True)
class Case:
    name: str
    path: Path
    description: str
    base: RunSettings            # model, seed, max_new_tokens, block_size
    prompts: tuple[PromptSpec, ...]
    matrix: tuple[Matrix, ...]
    faults: tuple[ExpectedFault, ...]
    tolerances: dict             # dtype -> relative tolerance the nodes are judged at

    def settings(self) -> list[RunSettings]:
        """The fault-free (or fault-injected) matrix, deduplicated, in file order."""
        return [s for s, _ in self.labelled_settings()]

    def labelled_settings(self) -> list[tuple[RunSettings, str]]:
        """Each distinct matrix setting once, with the label of the first table that holds it."""
        out: dict[RunSettings, str] = {}
        for m in self.matrix:
            for s in m.settings(self.base):
                out.setdefault(self.with_tolerance(s), m.label)
        return list(out.items())

    def prompts_of(self, s: RunSettings) -> tuple[PromptSpec, ...] | None:
        """The prompts a setting of this case runs: the case's, or None where its table drew its own
        (`prompt_len`: prepare draws them from the settings)."""
        return None if s.prompt_lens else self.prompts

    def acceptance_for(self, label: str) -> AcceptanceBaseline | None:
        """The acceptance baseline of the matrix table named `label`, if it holds one."""
        return next((m.acceptance for m in self.matrix if m.label == label), None)

    def with_tolerance(self, s: RunSettings) -> RunSettings:
        """The case's tolerance for the setting's dtype, when it names one: a
        number (fixed) or a calibrated noise floor (multiplier, floor, ceiling)."""
        value = self.tolerances.get(s.dtype)
        if isinstance(value, tuple):
            return replace(s, noise_rule=value)
        return replace(s, tolerance=value if value is not None else s.tolerance)

    def one_line(self) -> str:
        faults = ", ".join(f.name for f in self.faults) or "none"
        return (f"{self.name:<14} {len(self.settings()):>3} settings, {len(self.prompts)} prompts, "
                f"faults: {faults} ({self.path}) {self.description}")


def _fail(path: Path, key: str, expected: str, got) -> CaseError:
    return CaseError(f"{path}: key '{key}': expected {expected}, got {json.dumps(got, default=str)}")


def _get(path: Path, table: dict, key: str, where: str, kind, default, expected: str):
    value = table.get(key, default)
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise _fail(path, f"{where}{key}", expected, value)
    return value


def _check_keys(path: Path, table, allowed: set, where: str) -> None:
    if not isinstance(table, dict):
        raise _fail(path, where.rstrip(".") or "<top>", "a table", table)
    for key in table:
        if key not in allowed:
            raise _fail(path, f"{where}{key}", f"one of {', '.join(sorted(allowed))} (unknown key)", table[key])


def _axis(path: Path, table: dict, axis: str, where: str) -> tuple:
    if axis not in table:
        return AXIS_DEFAULTS[axis]
    raw = table[axis]
    values = raw if isinstance(raw, list) else [raw]
    kind = _AXIS_TYPES[axis]
    name = {int: "positive integers", bool: "booleans", str: "strings"}[kind]
    least = 0 if axis in ZERO_IS_OFF else 1
    good = values and all(isinstance(v, kind) and (kind is not int or (not isinstance(v, bool) and v >= least))
                          for v in values)
    if not good:
        raise _fail(path, f"{where}{axis}", f"a {name[:-1]} or a non-empty list of {name}", raw)
    limit = LIMITS.get(axis)
    if limit is not None and any(v > limit for v in values):
        raise _fail(path, f"{where}{axis}", f"values <= {limit}", raw)
    if axis == "dtype" and any(v not in DTYPES for v in values):
        raise _fail(path, f"{where}{axis}", f"dtypes among {', '.join(DTYPES)}", raw)
    if axis == "page_size" and any(v not in PAGE_SIZES for v in values):
        raise _fail(path, f"{where}{axis}", f"page sizes among {', '.join(map(str, PAGE_SIZES))}", raw)
    return tuple(dict.fromkeys(values))


def _matrix(path: Path, table: dict, where: str, label: str, extra: set) -> Matrix:
    _check_keys(path, table, set(AXES) | {"label", "fault", "accept", "acceptance", "prompt_len"} | extra, where)
    axes = {a: _axis(path, table, a, where) for a in AXES}
    fault = table.get("fault")
    if fault is not None and not isinstance(fault, str):
        raise _fail(path, f"{where}fault", "a fault name (a string)", fault)
    accept = _get(path, table, "accept", where, str, "walk", "'walk' or 'sglang'")
    if accept not in ("walk", "sglang"):
        raise _fail(path, f"{where}accept", "'walk' or 'sglang'", accept)
    prompt_len = table.get("prompt_len")
    if prompt_len is not None and not (isinstance(prompt_len, int) and not isinstance(prompt_len, bool)
                                       and 1 <= prompt_len <= MAX_PROMPT_LEN):
        raise _fail(path, f"{where}prompt_len", f"a prompt length in [1, {MAX_PROMPT_LEN}] (an integer)", prompt_len)
    return Matrix(_get(path, table, "label", where, str, label, "a string"), axes, fault, accept,
                  _acceptance(path, table.get("acceptance"), where), prompt_len)


def _acceptance(path: Path, raw, where: str) -> AcceptanceBaseline | None:
    if raw is None:
        return None
    expected = "a table { mean_accepted_length = N (>= 1), band = M (>= 0) }"
    if not isinstance(raw, dict) or set(raw) != {"mean_accepted_length", "band"}:
        raise _fail(path, f"{where}acceptance", expected, raw)
    values = {k: _get(path, raw, k, f"{where}acceptance.", float, None, "a number") for k in raw}
    try:
        return AcceptanceBaseline(values["mean_accepted_length"], values["band"])
    except ValueError:
        raise _fail(path, f"{where}acceptance", expected, raw) from None


def _prompts(path: Path, raw) -> tuple[PromptSpec, ...]:
    if raw is None:
        return DEFAULT_PROMPTS
    if not isinstance(raw, list) or not raw:
        raise _fail(path, "prompts", "a non-empty array of tables ([[prompts]])", raw)
    out = []
    for i, p in enumerate(raw):
        where = f"prompts[{i}]."
        _check_keys(path, p, {"name", "length", "tokens", "accuracy"}, where)
        name = _get(path, p, "name", where, str, None, "a string")
        accuracy = _get(path, p, "accuracy", where, float, None, "a number in [0, 1]")
        if not 0.0 <= accuracy <= 1.0:
            raise _fail(path, f"{where}accuracy", "a number in [0, 1]", accuracy)
        tokens = p.get("tokens", [])
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in tokens):
            raise _fail(path, f"{where}tokens", "a list of token ids (non-negative integers)", tokens)
        if ("length" in p) == bool(tokens):
            raise _fail(path, where + "length", "exactly one of 'length' or 'tokens'", p.get("length"))
        length = len(tokens) if tokens else _get(path, p, "length", where, int, None, "a positive integer")
        if not 1 <= length <= MAX_PROMPT_LEN:
            raise _fail(path, f"{where}{'tokens' if tokens else 'length'}", f"a length in [1, {MAX_PROMPT_LEN}]",
                        length)
        out.append(PromptSpec(name, length, accuracy, tuple(tokens)))
    return tuple(out)


RULE_KEYS = ("multiplier", "floor", "ceiling")
OPTIONAL_RULE_KEYS = ("drift_limit",)


def _tolerances(path: Path, raw) -> dict:
    if raw is None:
        return {}
    # keys are run dtypes; tf32 is a matmul precision, not a dtype a case can ceil
    _check_keys(path, raw, set(DTYPES), "tolerances.")
    out = {}
    for dtype, value in raw.items():
        if isinstance(value, dict):   # a calibrated noise floor (ddcheck calibrate): bf16 and fp16
            out[dtype] = _noise_rule(path, dtype, value)
            continue
        # the nodes of this dtype are judged at this tolerance instead of the default
        value = _get(path, raw, dtype, "tolerances.", float, None, "a number in (0, 1)")
        if not 0.0 < value < 1.0:
            raise _fail(path, f"tolerances.{dtype}", "a number in (0, 1)", value)
        out[dtype] = value
    return out


def _noise_rule(path: Path, dtype: str, table: dict) -> tuple[float, ...]:
    from harness.verdict.noise_floor import NOISE_FLOOR, NoiseFloorRule
    expected = ("{ multiplier >= 1, 0 < floor < ceiling < 1, optional drift_limit >= 1 } (a bfloat16 or float16 "
                "noise floor)")
    keys = RULE_KEYS + tuple(k for k in OPTIONAL_RULE_KEYS if k in table)
    if dtype not in NOISE_FLOOR or set(table) != set(keys) or not all(
            isinstance(table[k], (int, float)) and not isinstance(table[k], bool) for k in keys):
        raise _fail(path, f"tolerances.{dtype}", expected, table)
    rule = tuple(float(table[k]) for k in keys)
    try:
        NoiseFloorRule(*rule) if len(rule) == 4 else NoiseFloorRule(*rule, drift_limit=1.0)
    except ValueError:
        raise _fail(path, f"tolerances.{dtype}", expected, table) from None
    return rule


def load_case(path: Path) -> Case:
    """Parse and validate one case file; raises CaseError."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CaseError(f"{path}: no such case file (`ddcheck cases` lists them)") from None
    except IsADirectoryError:
        raise CaseError(f"{path}: is a directory, not a case file") from None
    except UnicodeDecodeError as e:
        raise CaseError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise CaseError(f"{path}: cannot read ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise CaseError(f"{path}: not valid TOML ({e})") from None
    except RecursionError:   # tomllib parses nested arrays recursively
        raise CaseError(f"{path}: nested too deeply to be a case file") from None
    _check_keys(path, doc, _TOP_KEYS, "")
    drafter = _get(path, doc, "drafter", "", str, "auto", "auto, noisy or self")
    if drafter not in DRAFTER_CHOICES:
        raise _fail(path, "drafter", "auto, noisy or self", drafter)
    base = RunSettings(
        model=_get(path, doc, "model", "", str, "tiny", "a model preset or checkpoint directory"),
        seed=_positive(path, doc, "seed", 0, minimum=0),
        max_new_tokens=_positive(path, doc, "max_new_tokens", 12),
        block_size=_positive(path, doc, "block_size", 8, minimum=2),
        backend="torch", impl=_impl(path, doc),
        port_stages=_get(path, doc, "port_stages", "", (str, type(None)), None, "a comma list of port stages"),
        strict=_get(path, doc, "strict", "", bool, False, "true or false"),
        drafter=drafter,
        draft_layers=_positive(path, doc, "draft_layers", 0, minimum=0) or None,
        case=str(path) if "prompts" in doc else None)   # the reproduce command must bring the case's prompts
    matrices = doc.get("matrix", [])
    if not isinstance(matrices, list):
        raise _fail(path, "matrix", "an array of tables ([[matrix]])", matrices)
    matrix = tuple(_matrix(path, m, f"matrix[{i}].", f"matrix-{i}", set()) for i, m in enumerate(matrices))
    faults_raw = doc.get("faults", [])
    if not isinstance(faults_raw, list):
        raise _fail(path, "faults", "an array of tables ([[faults]])", faults_raw)
    faults = []
    for i, f in enumerate(faults_raw):
        where = f"faults[{i}]."
        name = _get(path, f if isinstance(f, dict) else {}, "name", where, str, None, "a fault name")
        under = _matrix(path, {k: v for k, v in f.items() if k != "name"}, where, name, set())
        if under.fault is not None:
            raise _fail(path, f"{where}fault", "no 'fault' key (the entry's name is the fault)", under.fault)
        faults.append(ExpectedFault(name, replace(under, fault=name)))
    if not matrix and not faults:
        raise _fail(path, "matrix", "at least one [[matrix]] or [[faults]] table", None)
    case = Case(_get(path, doc, "name", "", str, path.stem, "a string"), path,
                _get(path, doc, "description", "", str, "", "a string"), base,
                _prompts(path, doc.get("prompts")), matrix, tuple(faults), _tolerances(path, doc.get("tolerances")))
    validate_faults(case)
    return case


def _impl(path: Path, doc: dict) -> str | None:
    """impl = "FAMILY:PATH", PATH relative to the case file; checked like --impl."""
    raw = _get(path, doc, "impl", "", (str, type(None)), None, "FAMILY:PATH (a port under test)")
    if raw is None:
        return None
    from harness.ports.registry import parse_impl
    family, sep, where = raw.partition(":")
    if sep and not Path(where).is_absolute():
        where = str(path.parent / where)
    try:
        return parse_impl(f"{family}{sep}{where}").label
    except UsageError as e:
        raise _fail(path, "impl", f"a port under test ({e})", raw) from None


def _positive(path: Path, doc: dict, key: str, default: int, minimum: int = 1) -> int:
    expected = f"an integer in [{minimum}, {LIMITS[key]}]"
    value = _get(path, doc, key, "", int, default, expected)
    if not minimum <= value <= LIMITS[key]:
        raise _fail(path, key, expected, value)
    return value


def validate_faults(case: Case) -> None:
    """Every fault named in the case is registered and can show under its settings."""
    from harness.faults.registry import catalog, why_cannot_show
    faults = catalog()
    named = [(f"matrix[{i}].fault", m.fault, m) for i, m in enumerate(case.matrix) if m.fault]
    named += [(f"faults[{i}].name", f.name, f.under) for i, f in enumerate(case.faults)]
    for key, name, m in named:
        if name not in faults:
            raise _fail(case.path, key, f"a registered fault ({', '.join(sorted(faults))})", name)
        for s in m.settings(case.base):
            reason = why_cannot_show(name, s, model_vocab(s.model))
            if reason:
                raise _fail(case.path, key, f"settings where it can show ({reason})", name)


def model_vocab(model: str) -> int:
    """The vocabulary size of a preset or checkpoint, without loading weights."""
    from harness.engine.model.presets import PRESETS, ModelLoadError, model_dir, read_config, unknown_model
    if model in PRESETS:
        return PRESETS[model].vocab_size
    directory = model_dir(model)   # a trained model by name: its cache (materialized on first use)
    if not (directory / "config.json").is_file():
        raise ModelLoadError(unknown_model(model))
    return read_config(directory).vocab_size


def prompts_for(s: RunSettings) -> tuple[PromptSpec, ...] | None:
    """A run's case file's prompts (`--case`); None without a case: prepare
    takes the prompt file's, the lengths' or the model's defaults
    (harness/check/prompts.py)."""
    return load_case(Path(s.case)).prompts if s.case else None


def discover(directory: Path = CASES_DIR) -> list[Path]:
    return sorted(Path(directory).glob("*.toml"))
