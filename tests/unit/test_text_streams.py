"""A checkpoint with a tokenizer.json runs on text prompts by default, and its
streams are decoded into the records, the printed summary and the HTML
report, engine beside oracle."""
from __future__ import annotations

import json

from typer.testing import CliRunner

from harness.engine.model.presets import PRESETS, random_weights, write_checkpoint
from harness.report.svg import esc
from harness.check.prompts import TEXT_PROMPTS


def tokenizer_for(vocab: int):
    """One character per token id, "!" at id 0 (as GPT-2's vocabulary has it)."""
    from tokenizers import Tokenizer, decoders, models
    chars = [chr(33 + i) for i in range(94)] + [chr(0xC0 + i) for i in range(vocab - 94)]
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(chars)}, []))
    tok.decoder = decoders.Fuse()
    return tok


def test_streams_are_text_in_records_summary_and_report(tmp_path):
    from harness.cli import _register, app
    _register()
    ckpt = write_checkpoint(tmp_path / "ckpt", PRESETS["tiny"], random_weights(PRESETS["tiny"], 0))
    tok = tokenizer_for(PRESETS["tiny"].vocab_size)
    tok.save(str(ckpt / "tokenizer.json"))
    out, html = tmp_path / "run.jsonl", tmp_path / "run.html"
    r = CliRunner().invoke(app, ["run", "--model", str(ckpt), "--backend", "torch", "--batch", "2",
                                 "--max-new-tokens", "5", "--drafter", "noisy", "--out", str(out), "--html", str(html)])
    assert r.exit_code == 0, r.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    streams = [x for x in records if x["kind"] == "stream"]
    assert len(streams) == 2
    for st, (name, text, _) in zip(streams, TEXT_PROMPTS):   # the default prompts are the text ones
        assert st["prompt"] == name and st["prompt_text"] == tok.decode(tok.encode(text).ids)
        assert st["engine_text"] == tok.decode(st["engine_tokens"])
        assert st["reference_text"] == tok.decode(st["reference_tokens"])
    summary = next(x for x in records if x["kind"] == "summary")
    assert [s["engine_text"] for s in summary["streams"]] == [s["engine_text"] for s in streams]
    page = html.read_text()
    for st in streams:
        assert repr(st["engine_text"]) in r.output
        assert f"<pre>{esc(st['engine_text'])}</pre>" in page and f"<pre>{esc(st['reference_text'])}</pre>" in page


def test_preset_streams_carry_no_text(tmp_path):
    from harness.cli import _register, app
    _register()
    out = tmp_path / "run.jsonl"
    r = CliRunner().invoke(app, ["run", "--backend", "torch", "--max-new-tokens", "3", "--out", str(out)])
    assert r.exit_code == 0, r.output
    st = next(json.loads(x) for x in out.read_text().splitlines() if '"kind": "stream"' in x)
    assert st["engine_text"] is None and st["prompt"] == "code"
