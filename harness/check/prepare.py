"""Everything a differential run needs, validated before anything runs or
is written: both sides' readings of the checkpoint and their agreement, the
backend, the pipeline (faults, a port), the prompts, the engine and the
nodes' low-precision twins; `derive` makes another setting's run over the
same weights and oracle.

Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ddschema import ModelConfig
from harness.engine.attn import BackendUnavailable, make_backend
from harness.verdict.noise_floor import NoiseFloorRule, planned_nodes, verdict_rule
from harness.verdict.tolerance import matmul_precision, rel_tolerance
from harness.faults import apply_fault
from harness.check.load_agreement import LoadDivergence, LoadMismatch, compare_loaded
from harness.engine.model.presets import PRESETS, ModelLoadError, checkpoint_dir, load_checkpoint
from harness.check.oracle_lookup import OracleUnavailable, load_oracle_class
from harness.check.oracle_placement import OraclePlan, decide, place_weights
from harness.ports.attach import PortRun, attach_port
from harness.check.causal_twin import CausalTwin
from harness.check.from_start import replaced_from_env
from harness.engine.loop import Engine
from harness.check.prompts import prompts_of
from harness.engine.settings import (NotRunnableHere, PromptSpec, RunSettings, UsageError, prompt_tokens,
                                     prompts_for_batch)
from harness.check.step_clock import timed_phase

# usage or environment errors: one line on stderr, exit 2, nothing written
USAGE_ERRORS = (UsageError, ModelLoadError, BackendUnavailable, OracleUnavailable)


def load_key(s: RunSettings) -> tuple:
    """What a checkpoint's reading depends on: settings with the same key share one `Loaded`."""
    return s.model, s.seed, s.dtype, s.device, s.sliding_window, s.oracle_device, s.oracle


@dataclass(frozen=True)
class Loaded:
    """One checkpoint read by both sides and checked: the engine's tensors
    (the checkpoint's dtype, on the run's device), the float64 oracle over
    its own reading, and where the two disagree."""

    key: tuple                     # load_key of the settings it was read for
    cfg: ModelConfig               # the engine's parsing of config.json
    weights: dict[str, torch.Tensor]
    oracle: object
    oracle_device: str             # where the float64 oracle computes
    load_mismatches: tuple[LoadMismatch, ...]   # the engine's loader against the oracle's own reading
    load_s: dict                   # wall seconds of each loading phase (timed_phase)
    tokenizer: object | None = None   # the checkpoint's tokenizer.json (a tokenizers.Tokenizer), None without one
    oracle_plan: OraclePlan | None = None   # which oracle (dense or streamed) and why (oracle_placement.decide)


@dataclass(frozen=True)
class Prepared:
    """Everything validated before anything runs or is written."""

    settings: RunSettings
    engine: Engine
    loaded: Loaded
    prompts: list[PromptSpec]
    prompt_ids: list[list[int]]
    port: PortRun | None = None
    twin: CausalTwin | None = None   # the nodes' low-precision twins, for the noise-floor verdict
    every_twin: bool = False   # every node's twin, not only where it can change a verdict: studies and calibration
    load_s: dict = field(default_factory=dict)   # this run's loading phases; empty when it reused a reading

    @property
    def oracle(self):
        return self.loaded.oracle

    @property
    def oracle_device(self) -> str:
        return self.loaded.oracle_device

    @property
    def oracle_plan(self) -> OraclePlan | None:
        return self.loaded.oracle_plan

    @property
    def load_mismatches(self) -> tuple[LoadMismatch, ...]:
        return self.loaded.load_mismatches

    @property
    def rule(self) -> NoiseFloorRule | None:
        """The noise-floor rule the nodes are judged by; None: the fixed tolerance."""
        s = self.settings
        return verdict_rule(s.dtype, s.verdict, s.tolerance is not None, s.noise_rule, planned_nodes(s))

    @property
    def rounded_probabilities(self) -> bool:
        """Whether the engine's kernel rounds attention's probabilities before
        P @ V (its `probability_dtype`): the oracle's rounded computation of
        the nodes then rounds there too."""
        return getattr(self.engine.kernel, "probability_dtype", None) is not None

    @property
    def tolerance(self) -> float:
        """Relative logit tolerance for this run: the settings' own if given,
        the noise-floor rule's ceiling when it judges, else by dtype and by
        what the backend multiplies in (TF32 for SGLang's kernel on CUDA in
        float32)."""
        if self.rule is not None:
            return self.rule.ceiling
        if self.settings.tolerance is not None:
            return self.settings.tolerance
        return rel_tolerance(matmul_precision(self.settings.dtype, self.engine.backend))


def prepare(s: RunSettings, prompts: tuple[PromptSpec, ...] | None = None) -> Prepared:
    """Raises UsageError / ModelLoadError / BackendUnavailable on bad input. Prompts:
    the given ones, else the settings' (harness/check/prompts.py)."""
    loaded = load(s)
    return build(s, loaded, prompts, load_s=loaded.load_s)


def load(s: RunSettings) -> Loaded:
    """Both sides read the checkpoint (a preset is first written out as one),
    the engine's tensors are checked finite, the oracle goes where it fits,
    and the two readings are compared."""
    phases: dict[str, float] = {}
    with checkpoint_dir(s.model, s.seed, s.sliding_window) as directory:  # a preset is written out: both sides read files
        with timed_phase(phases, "engine_load"):
            try:
                cfg, weights = load_checkpoint(directory)
            except Exception as e:  # noqa: BLE001  (a divergence where the oracle reads what the engine could not)
                divergence = loader_divergence(s, directory, e)
                if divergence is None:
                    raise
                raise divergence from e
            weights = place_weights(weights, s.device)   # checkpoint dtype, on the run's device
            check_finite_weights(weights, s.model)
        plan = decide(s, weights)
        with timed_phase(phases, "oracle_load"):
            oracle = load_oracle_from(directory, s.model, plan.device, plan.name)
        tokenizer = read_tokenizer(directory)
    with timed_phase(phases, "load_agreement"):
        load_mismatches = tuple(compare_loaded(cfg, weights, oracle))
    return Loaded(load_key(s), cfg, weights, oracle, plan.device, load_mismatches, phases, tokenizer, plan)


def loader_divergence(s: RunSettings, directory, e: Exception) -> LoadDivergence | None:
    """The engine's loader raised E on DIRECTORY: a load divergence when its code raised and the oracle reads the
    same checkpoint; None (E stands) otherwise, or when the engine refused a checkpoint that is not a preset
    (a user's checkpoint the engine does not support is a usage error, whatever the oracle reads)."""
    from harness.check.crash import attribute
    crash = attribute(e)
    if crash.side != "engine" or (isinstance(e, ModelLoadError) and s.model not in PRESETS):
        return None
    try:
        load_oracle_from(directory, s.model, "cpu", "dense" if s.model in PRESETS else "streamed")
    except Exception:  # noqa: BLE001  (the oracle cannot read it either: the checkpoint's, not the loader's)
        return None
    from harness.engine.model import presets
    what, key = "weights", "*.safetensors"
    try:
        presets.read_config(directory)
    except Exception:  # noqa: BLE001  (the engine's config reading is what raised)
        what, key = "config", "config.json"
    error = crash.error.replace(str(directory), "<checkpoint>")   # no temporary path in a record
    return LoadDivergence((LoadMismatch(what, key, f"raised {error}", "read it",
                                        f"{key}: the engine's loader raised {error} at {crash.where}; the oracle "
                                        "read the same checkpoint"),))


def read_tokenizer(directory):
    """The checkpoint's tokenizer.json as a tokenizers.Tokenizer; None when it has none (the presets)."""
    f = directory / "tokenizer.json"
    if not f.is_file():
        return None
    try:
        from tokenizers import Tokenizer
        return Tokenizer.from_file(str(f))
    except Exception as e:  # noqa: BLE001  (tokenizers raises its own Exception type for a bad file)
        raise ModelLoadError(f"--model {directory}: cannot read tokenizer.json ({e})") from None


def build(s: RunSettings, loaded: Loaded, prompts: tuple[PromptSpec, ...] | None = None, pipeline=None,
          port: PortRun | None = None, backend=None, load_s: dict | None = None) -> Prepared:
    """One setting's engine over a checkpoint already read: the backend (or
    the one given), the pipeline (the given one, else the setting's fault and
    port), the prompts checked against the vocabulary, and the twins."""
    if load_key(s) != loaded.key:
        raise ValueError("a reading of a checkpoint serves only settings with its model, seed, dtype, device, "
                         "window and oracle")
    phases = dict(load_s or {})
    cfg = loaded.cfg
    if s.dtype == "float32" and s.device.startswith("cuda"):   # exact float32 unless TF32 is asked for
        from harness.engine.attn.sglang_triton import float32_dots
        float32_dots(s.tf32)
    fresh, built = pipeline is None, None
    if fresh:
        pipeline, port = attach_port(s, apply_fault(s.fault, s, cfg.vocab_size), cfg.vocab_size)
    specs = prompts_for_batch(s.batch, prompts if prompts is not None else prompts_of(s, loaded.tokenizer))
    ids = [prompt_tokens(q, i, cfg.vocab_size, s.seed) for i, q in enumerate(specs)]
    if fresh:
        # a rerun with one stage replaced from the start: the proof of a crash that left no engine (from_start.py);
        # built(engine), where not None, finishes the replacement once the engine is built
        s, pipeline, built = replaced_from_env(s, pipeline, ids)
    if backend is None:   # after the replacement: one of the attention backend is made without it
        with timed_phase(phases, "backend"):
            backend = make_backend(s.backend, s.device, s.torch_dtype)
    check_capturable(s, backend)
    for spec, toks in zip(specs, ids):
        if any(t >= cfg.vocab_size for t in toks):   # bad input, not an engine crash
            raise UsageError(f"prompt {spec.name!r}: token id {max(toks)} is outside the model's vocabulary "
                             f"(vocab_size {cfg.vocab_size})")
    if s.eos_id is not None and s.eos_id >= cfg.vocab_size:
        raise UsageError(f"--eos-id {s.eos_id} is outside the model's vocabulary (vocab_size {cfg.vocab_size})")
    with timed_phase(phases, "engine_build"):
        # the weights are shared; cast only off the run dtype
        engine = engine_class(s)(s, cfg, loaded.weights, backend, specs, ids, pipeline)
        if built is not None:
            built(engine)
        guide_drafts_by_the_oracle(engine, s, loaded)
        twin = twin_for(s, engine)
    return Prepared(s, engine, loaded, specs, ids, port=port, twin=twin, load_s=phases if load_s else {})


def guide_drafts_by_the_oracle(engine, s: RunSettings, loaded: Loaded) -> None:
    """The drafter's guide (each prompt's greedy continuation by the target: what a perfect drafter would say)
    from the dense oracle instead of the engine's own model, torch backend and pool: the drafter is not under
    test, so a bug in those must not reach it too (a crash there had no replacement that let the run go on:
    issue 21). Only the drafts' acceptance depends on it. Left to the engine where the oracle is streamed (it
    would read every layer once per token) and under --tp (each rank guides itself)."""
    if s.tp != 1 or loaded.oracle_plan is None or loaded.oracle_plan.name != "dense":
        return
    oracle, n = loaded.oracle, s.max_new_tokens + s.block_size
    # the engine's one seam for it (loop.Engine._greedy_continuation, called once per request at the prefill)
    engine._greedy_continuation = lambda r: oracle.greedy(list(r.prompt), n)[0]


def engine_class(s: RunSettings):
    """One process, or --tp ranks launched by ddcheck (harness/engine/tp/launch.py)."""
    if s.tp == 1:
        return Engine
    from harness.engine.tp.launch import TPEngine
    return TPEngine


def check_capturable(s: RunSettings, backend) -> None:
    """Real CUDA graphs need a backend that reads no indptr on the host."""
    if s.cuda_graph and s.device.startswith("cuda") and not backend.graph_capturable:
        raise NotRunnableHere(f"--cuda-graph on CUDA needs a backend that can be captured; {s.backend} "
                              "reads indptrs on the host (use --backend sglang-triton)")


def twin_for(s: RunSettings, engine: Engine) -> CausalTwin | None:
    """The nodes' low-precision twins when the noise-floor verdict judges the run."""
    if verdict_rule(s.dtype, s.verdict, s.tolerance is not None, s.noise_rule) is None:
        return None
    # the kernel as made: a pipeline's change to the attention is under test, the twin measures the dtype's noise
    # on the engine's threads (torch's count as the engine is built: the CLI's), whatever the oracle's are
    return CausalTwin(engine.model, engine.kernel, s.device, engine.max_context + engine.q_len,
                      threads=torch.get_num_threads())


def derive(p: Prepared, s: RunSettings | None = None, prompts: tuple[PromptSpec, ...] | None = None,
           pipeline=None) -> Prepared:
    """A fresh engine for settings `s` (default: p's own) over p's reading of
    the checkpoint: nothing is read or loaded again, so a localizer or a
    study of many settings holds one copy of an 8B model's weights and one
    oracle. p's own settings keep p's pipeline (custom stages and its port)
    unless `pipeline` is given; other settings get their own fault and port.
    The settings must keep p's load_key."""
    s = s or p.settings
    same = s == p.settings
    if load_key(s) != p.loaded.key:
        raise ValueError("derive keeps the model, seed, dtype, device, window and oracle device of the run it "
                         "derives from")
    if prompts is None and same:
        prompts = tuple(p.prompts)
    if pipeline is None and same:
        pipeline = p.engine.pipeline
    port = p.port if same else None   # another setting's port: build attaches it with its fault
    backend = p.engine.kernel if s.backend == p.settings.backend else None
    return build(s, p.loaded, prompts, pipeline=pipeline, port=port, backend=backend)


class LoadCache:
    """One checkpoint reading held at a time: consecutive settings with the
    same load_key read the checkpoint once (a sweep over an 8B checkpoint, a
    reducer's candidates). Each Prepared says whether it loaded (load_s)."""

    def __init__(self) -> None:
        self.loaded: Loaded | None = None

    def prepare(self, s: RunSettings, prompts: tuple[PromptSpec, ...] | None = None) -> Prepared:
        if self.loaded is not None and self.loaded.key == load_key(s):
            return build(s, self.loaded, prompts)
        self.loaded = None   # the last model goes before the next is read
        self.loaded = load(s)
        return build(s, self.loaded, prompts, load_s=self.loaded.load_s)


def check_finite_weights(weights: dict, model: str) -> None:
    """A checkpoint with NaN or Inf in a tensor is bad input, named before anything runs."""
    for name, w in weights.items():
        if w.is_floating_point() and not bool(torch.isfinite(w).all()):
            raise ModelLoadError(f"--model {model}: tensor {name} holds non-finite values (NaN or Inf)")


def load_oracle_from(directory, model: str, device: str = "cpu", name: str = "dense"):
    """The registered oracle `name` (dense or streamed) over its own reading of
    the checkpoint, computing on `device`; a checkpoint it refuses is a usage error."""
    try:
        # a tensor the oracle's names want and the checkpoint lacks is a load divergence, not a refusal
        return load_oracle_class(name).from_checkpoint(directory, device=device, allow_missing=True)
    except ValueError as e:
        raise ModelLoadError(f"the oracle cannot read --model {model}: {e}") from None
