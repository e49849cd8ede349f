"""Run settings and the requests of a run.

Layer: engine. Imports ddschema and harness.verdict; never ports, faults, check, report,
workflows or cli."""
from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, field

import torch

from harness.verdict.noise_floor import NOISE_FLOOR, VERDICTS, NoiseFloorRule

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class UsageError(ValueError):
    """Bad input from the user: one line, exit code 2."""


class NotRunnableHere(UsageError):
    """A setting this device and backend cannot run together: a usage error
    for one run (exit 2), a skip with the reason in a sweep or gate matrix
    (a case's axes crossed on a machine that cannot run every corner)."""


# The largest value each numeric option takes (issue 12: --block-size 100000 was
# accepted and ran for minutes). Far above any setting DDTree is run at, low
# enough that a run of it ends; case files and sweep lists are held to the same.
LIMITS = {"budget": 1024, "topk": 64, "block_size": 64, "batch": 256, "max_new_tokens": 8192,
          "seed": 2**32 - 1, "stop_after": 8192, "eos_id": 2**31 - 1,
          "sliding_window": 2**20, "draft_layers": 1024, "tp": 64}
ORACLE_CHOICES = ("auto", "dense", "streamed")   # harness/check/oracle_placement.py decides auto
DRAFTER_CHOICES = ("auto", "noisy", "self")   # auto: self for a checkpoint or trained model, noisy for a preset


def within_limit(name: str, value: int, minimum: int) -> str | None:
    """None when `minimum <= value <= LIMITS[name]`, else the one-line complaint."""
    flag = "--" + name.replace("_", "-")
    if value < minimum:
        return f"{flag} must be >= {minimum}, got {value}"
    if value > LIMITS[name]:
        return f"{flag} must be <= {LIMITS[name]}, got {value}"
    return None


@dataclass(frozen=True)
class RunSettings:
    budget: int = 16
    topk: int = 1
    cuda_graph: bool = False
    backend: str = "torch"
    batch: int = 1
    max_new_tokens: int = 24
    block_size: int = 8
    model: str = "tiny"
    seed: int = 0
    dtype: str = "float32"
    fault: str | None = None
    accept: str = "walk"
    device: str = "cpu"
    tolerance: float | None = None  # relative logit tolerance; None: the dtype's (compare/tolerance.py)
    impl: str | None = None         # FAMILY:PATH of a port under test (harness/ports); None: ddcheck's own engine
    port_stages: str | None = None  # comma list of the port's stages to use; None: all it provides
    strict: bool = False            # audit warnings fail the run too
    case: str | None = None         # the case file whose prompts the run uses (None: the seed's prompts)
    kv_poison: bool = True          # free KV slots hold NaN (the provenance canary's poison)
    eos_id: int | None = None       # end-of-sequence token: a stream stops there (on both sides)
    stop_after: int = 2             # end the run after this many divergent verify steps (0: never)
    oracle_device: str = "auto"     # where the float64 oracle computes (harness/check/oracle_placement.py)
    oracle: str = "auto"            # auto | dense (the whole model held) | streamed (one layer at a time)
    prompt_lens: tuple[int, ...] | None = None  # prompts of these lengths drawn from the seed (--prompt-len)
    prompt_file: str | None = None  # token ids as JSON, or text for the checkpoint's tokenizer (--prompt-file)
    verdict: str = "auto"           # fixed | noise-floor | auto (harness/verdict/noise_floor.py)
    tf32: bool = False              # float32 on CUDA: let Triton's dots use TF32 (judged at the tf32 tolerance)
    noise_rule: tuple[float, ...] | None = None  # (multiplier, floor, ceiling[, drift limit]): a calibrated noise floor
    page_size: int = 1              # KV page size: 1 (a token-slot pool) or a paged pool (harness/engine/mem/paged.py)
    sliding_window: int | None = None  # a sliding window on the model (its own sliding layers, else every layer)
    drafter: str = "auto"           # noisy | self | auto (harness/engine/ddtree/drafter.py)
    draft_layers: int | None = None  # the self-draft's k (None: all but the target's last two layers)
    tp: int = 1                     # tensor-parallel ranks of the engine under test (harness/engine/tp)

    def __post_init__(self) -> None:
        bounded = [within_limit(name, getattr(self, name), minimum) for name, minimum in
                   (("budget", 1), ("topk", 1), ("block_size", 2), ("batch", 1), ("max_new_tokens", 1),
                    ("seed", 0), ("stop_after", 0), ("tp", 1))]
        bounded.append(None if self.eos_id is None else within_limit("eos_id", self.eos_id, 0))
        bounded.append(None if self.sliding_window is None else within_limit("sliding_window", self.sliding_window, 1))
        bounded.append(None if self.draft_layers is None else within_limit("draft_layers", self.draft_layers, 1))
        checks = [(msg is None, msg) for msg in bounded] + [
                  (self.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}"),
                  (self.accept in ("walk", "sglang"), f"--accept must be walk or sglang, got {self.accept!r}"),
                  (self.drafter in DRAFTER_CHOICES,
                   f"--drafter must be one of {', '.join(DRAFTER_CHOICES)}, got {self.drafter!r}"),
                  (self.tolerance is None or 0.0 < self.tolerance < 1.0,
                   f"--tolerance must be in (0, 1), got {self.tolerance}"),
                  (self.port_stages is None or self.impl is not None, "--port-stages needs --impl"),
                  (sum(x is not None for x in (self.case, self.prompt_file, self.prompt_lens)) <= 1,
                   "--case, --prompt-file and --prompt-len each choose the prompts: give one"),
                  (not self.tf32 or self.dtype == "float32", "--tf32 only changes float32 runs"),
                  (not self.tf32 or self.device.startswith("cuda"), "--tf32 only changes float32 runs on CUDA"),
                  (self.verdict != "noise-floor" or self.tolerance is None,
                   "--tolerance is the fixed verdict's bound; --verdict noise-floor judges each node against its "
                   "twin: give one"),
                  (self.noise_rule is None or (self.dtype in NOISE_FLOOR and self.verdict != "fixed"
                                               and _valid_rule(self.noise_rule)),
                   f"--noise-rule needs a bfloat16 or float16 run not judged --verdict fixed, and multiplier >= 1, "
                   f"0 < floor < ceiling < 1 (drift limit >= 1); got {self.noise_rule} for {self.dtype}"),
                  (self.verdict in VERDICTS, f"--verdict must be one of {', '.join(VERDICTS)}, got {self.verdict!r}"),
                  (self.verdict != "noise-floor" or self.dtype in NOISE_FLOOR,
                   f"--verdict noise-floor judges bfloat16 and float16 runs; {self.dtype} uses the fixed table"),
                  (self.oracle_device in ("auto", "cpu", "cuda") or _is_cuda_index(self.oracle_device),
                   f"--oracle-device must be auto, cpu, cuda or cuda:N, got {self.oracle_device!r}"),
                  (self.oracle in ORACLE_CHOICES,
                   f"--oracle must be one of {', '.join(ORACLE_CHOICES)}, got {self.oracle!r}")]
        checks += page_size_checks(self) + tp_checks(self)
        for ok, msg in checks:
            if not ok:
                raise UsageError(msg)

    @property
    def q_len(self) -> int:
        return self.budget + 1

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def drafter_config(self, num_layers: int):
        """The drafter of this run over a target of `num_layers` layers: `auto` is the seeded stand-in on a
        random-weight preset (its records stay as they were) and the self-draft on a real checkpoint."""
        from harness.engine.ddtree.drafter import DrafterConfig
        from harness.engine.model.presets import PRESETS
        kind = self.drafter if self.drafter != "auto" else ("noisy" if self.model in PRESETS else "self")
        layers = min(self.draft_layers or max(1, num_layers - 2), num_layers)   # default: all but the last two
        return DrafterConfig(self.block_size, kind=kind, layers=layers)

    def to_dict(self) -> dict:
        return asdict(self)

    def command(self) -> str:
        """The ddcheck command that reproduces this setting."""
        parts = ["ddcheck run", f"--budget {self.budget}", f"--topk {self.topk}",
                 "--cuda-graph" if self.cuda_graph else "--no-cuda-graph", f"--backend {self.backend}",
                 f"--batch {self.batch}", f"--max-new-tokens {self.max_new_tokens}",
                 f"--block-size {self.block_size}", f"--model {self.model}", f"--seed {self.seed}",
                 f"--dtype {self.dtype}", f"--accept {self.accept}", f"--device {self.device}"]
        if self.tolerance is not None:
            parts.append(f"--tolerance {self.tolerance:g}")
        if self.fault:
            parts.append(f"--fault {self.fault}")
        if self.impl:
            parts.append(f"--impl {self.impl}")
        if self.port_stages:
            parts.append(f"--port-stages {self.port_stages}")
        if self.strict:
            parts.append("--strict")
        if not self.kv_poison:
            parts.append("--no-kv-poison")
        if self.eos_id is not None:
            parts.append(f"--eos-id {self.eos_id}")
        if self.sliding_window is not None:
            parts.append(f"--sliding-window {self.sliding_window}")
        if self.stop_after != 2:
            parts.append(f"--stop-after {self.stop_after}")
        if self.tf32:
            parts.append("--tf32")
        if self.verdict != "auto":
            parts.append(f"--verdict {self.verdict}")
        if self.noise_rule is not None:
            parts.append("--noise-rule " + ",".join(f"{x:g}" for x in self.noise_rule))
        if self.oracle_device != "auto":
            parts.append(f"--oracle-device {self.oracle_device}")
        if self.oracle != "auto":
            parts.append(f"--oracle {self.oracle}")
        if self.page_size != 1:
            parts.append(f"--page-size {self.page_size}")
        if self.drafter != "auto":
            parts.append(f"--drafter {self.drafter}")
        if self.draft_layers is not None:
            parts.append(f"--draft-layers {self.draft_layers}")
        if self.tp != 1:
            parts.append(f"--tp {self.tp}")
        if self.case:
            parts.append(f"--case {shlex.quote(self.case)}")
        if self.prompt_file:
            parts.append(f"--prompt-file {shlex.quote(self.prompt_file)}")
        if self.prompt_lens:
            parts.append(f"--prompt-len {','.join(map(str, self.prompt_lens))}")
        return " ".join(parts)


PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64)   # powers of two, as SGLang's paged allocator takes them


def page_size_checks(s: "RunSettings") -> list[tuple[bool, str]]:
    """--page-size: a power of two up to 64 (a port whose own commit is in play skips a paged setting: ports/attach.py)."""
    return [(s.page_size in PAGE_SIZES, f"--page-size must be one of {', '.join(map(str, PAGE_SIZES))}, "
                                        f"got {s.page_size}")]


def tp_checks(s: "RunSettings") -> list[tuple[bool, str]]:
    """--tp N > 1 runs ddcheck's own engine eagerly over N ranks (the backend and model are checked at build)."""
    if s.tp == 1:
        return []
    return [(not s.cuda_graph, f"--tp {s.tp} runs eagerly: the graph runner captures one process (use --no-cuda-graph)"),
            (s.impl is None, f"--tp {s.tp} shards ddcheck's own engine; a port under test (--impl) runs in one process")]


def _valid_rule(rule) -> bool:
    try:
        NoiseFloorRule(*rule) if len(rule) == 4 else NoiseFloorRule(*rule, drift_limit=1.0)
    except (TypeError, ValueError):
        return False
    return True


def _is_cuda_index(device: str) -> bool:
    head, _, index = device.partition(":")
    return head == "cuda" and index.isdigit()


@dataclass(frozen=True)
class PromptSpec:
    """A prompt as data: its tokens (or a length to draw them from the seed)
    and the drafter's accuracy on it (code-like prompts are accurate)."""

    name: str
    length: int
    accuracy: float
    tokens: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if not 0.0 <= self.accuracy <= 1.0:
            raise UsageError(f"prompt {self.name!r}: accuracy must be in [0, 1]")
        if self.length < 1:
            raise UsageError(f"prompt {self.name!r}: length must be >= 1")


# The seed's pair: an accurate code-like prompt next to an open-ended poem-like one.
DEFAULT_PROMPTS = (PromptSpec("code", 14, 0.9), PromptSpec("poem", 9, 0.3),
                   PromptSpec("code-long", 23, 0.8), PromptSpec("poem-short", 5, 0.2))


def prompts_for_batch(batch: int, prompts: tuple[PromptSpec, ...] = DEFAULT_PROMPTS) -> list[PromptSpec]:
    return [prompts[i % len(prompts)] for i in range(batch)]


def prompt_tokens(spec: PromptSpec, index: int, vocab: int, seed: int) -> list[int]:
    if spec.tokens:
        return list(spec.tokens)
    gen = torch.Generator().manual_seed(seed * 1000 + index)
    return torch.randint(0, vocab, (spec.length,), generator=gen).tolist()
