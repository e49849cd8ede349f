"""Where a run's prompts come from, in order: a prompt file
(`--prompt-file`), lengths (`--prompt-len`), else the seed's. A case file's
prompts (`--case`) are the case's, read by the workflows that know cases
(harness/workflows/cases.py `prompts_for`), which hand them to prepare.

A prompt file is either JSON token ids (a list of ints for one prompt, or a
list of such lists) or any other text, which is one prompt tokenized by the
checkpoint directory's own `tokenizer.json`. Prompts drawn by length take
the seed's prompts' drafter accuracies in turn (0.9, 0.3, 0.8, 0.2).


Layer: check. Imports ports, faults, the engine and below; never report, workflows or cli."""
from __future__ import annotations

import json
from pathlib import Path

from harness.engine.settings import DEFAULT_PROMPTS, PromptSpec, RunSettings, UsageError

MAX_PROMPT_LEN = 1 << 17


# A model with a tokenizer (a trained one) is run on real text by default: short prompts of different kinds,
# with the stand-in drafter's accuracy on each (code and lists are predictable, prose less so).
TEXT_PROMPTS = (("prose", "The capital of France is", 0.3),
                ("code", "def fibonacci(n):\n    ", 0.9),
                ("list", "Monday, Tuesday, Wednesday,", 0.8),
                ("question", "Q: Why is the sky blue?\nA:", 0.2))


def text_prompts(tokenizer) -> tuple[PromptSpec, ...]:
    out = []
    for name, text, accuracy in TEXT_PROMPTS:
        ids = tuple(tokenizer.encode(text).ids)
        out.append(PromptSpec(name, len(ids), accuracy, ids))
    return tuple(out)


def prompts_of(s: RunSettings, tokenizer=None) -> tuple[PromptSpec, ...]:
    """The run's prompts; `tokenizer` (the checkpoint's, None for a preset) makes the default ones real text."""
    if s.case:
        raise ValueError(f"--case {s.case}: its prompts come from the case (harness.workflows.cases.prompts_for)")
    if s.prompt_file:
        return read_prompt_file(Path(s.prompt_file), s.model)
    if s.prompt_lens:
        return tuple(PromptSpec(f"len{n}", n, DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)].accuracy)
                     for i, n in enumerate(s.prompt_lens))
    return text_prompts(tokenizer) if tokenizer is not None else DEFAULT_PROMPTS


def parse_prompt_lens(text: str | None) -> tuple[int, ...] | None:
    """'600' or '520,900' -> (600,) / (520, 900); a usage error otherwise."""
    if text is None:
        return None
    try:
        lens = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise UsageError(f"--prompt-len takes lengths like 600 or 520,900, got {text!r}") from None
    if not lens or any(not 1 <= n <= MAX_PROMPT_LEN for n in lens):
        raise UsageError(f"--prompt-len: each length must be in [1, {MAX_PROMPT_LEN}], got {text!r}")
    return lens


def read_prompt_file(path: Path, model: str) -> tuple[PromptSpec, ...]:
    if not path.is_file():
        raise UsageError(f"--prompt-file {path}: not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--prompt-file {path}: cannot read it ({type(e).__name__})") from None
    try:
        ids = json.loads(text)
    except ValueError:
        return (_tokenized(path, text, model),)
    if isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        ids = [ids]
    if not (isinstance(ids, list) and ids and all(isinstance(p, list) and p and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p) for p in ids)):
        raise UsageError(f"--prompt-file {path}: JSON must be token ids: [1, 2, ...] or [[1, 2], [3, 4, 5]]")
    return tuple(PromptSpec(f"{path.stem}[{i}]", len(p), DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)].accuracy,
                            tuple(p)) for i, p in enumerate(ids))


def _tokenized(path: Path, text: str, model: str) -> PromptSpec:
    from harness.engine.model.presets import model_dir
    tokenizer_file = (model_dir(model) or Path(model)) / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise UsageError(f"--prompt-file {path}: not JSON token ids, and --model {model} has no tokenizer.json "
                         "to tokenize text with")
    from tokenizers import Tokenizer
    ids = Tokenizer.from_file(str(tokenizer_file)).encode(text).ids
    if not ids:
        raise UsageError(f"--prompt-file {path}: the text tokenizes to nothing")
    return PromptSpec(path.stem, len(ids), DEFAULT_PROMPTS[0].accuracy, tuple(ids))
