"""The SGLang adapter's environment contract: a missing or too-old SGLang is a
one-line usage error naming the install command (exit 2, nothing written)."""
from __future__ import annotations

import sys
import types

import pytest
from typer.testing import CliRunner

from harness.engine.attn import registry, sglang_triton
from harness.engine.attn.base import BackendUnavailable
from harness.engine.ddtree import accept_sglang

MISSING = ("ddcheck_no_such.sglang.extend_attention", "ddcheck_no_such.sglang.old_extend_attention")


@pytest.fixture
def no_sglang(monkeypatch):
    monkeypatch.setattr(sglang_triton, "MODULE_PATHS", MISSING)


@pytest.fixture
def cli():
    from harness.cli import _register, app
    _register()
    return lambda *args: CliRunner().invoke(app, ["run", *args])


def test_missing_sglang_is_one_line_naming_the_install_command(no_sglang):
    with pytest.raises(BackendUnavailable) as e:
        sglang_triton.SGLangTritonBackend("cpu", __import__("torch").float32)
    msg = str(e.value)
    assert "\n" not in msg
    assert "pip install --no-deps sglang==0.5.23" in msg
    assert MISSING[0] in msg
    assert not sglang_triton.available()
    assert registry.default_backend() == "torch"


def test_too_old_sglang_is_refused(monkeypatch):
    def extend_attention_fwd(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr,
                             kv_indptr, kv_indices, custom_mask, is_causal, mask_indptr, max_len_extend):
        raise AssertionError("never called")
    old = types.ModuleType("ddcheck_fake_old_sglang")
    old.extend_attention_fwd = extend_attention_fwd
    monkeypatch.setitem(sys.modules, old.__name__, old)
    monkeypatch.setattr(sglang_triton, "MODULE_PATHS", (old.__name__,))
    with pytest.raises(BackendUnavailable, match="too old.*skip_prefix_custom_mask.*sglang==0.5.23"):
        sglang_triton.SGLangTritonBackend("cpu", __import__("torch").float32)


def test_installed_sglang_is_the_default_backend():
    assert sglang_triton.available()
    assert registry.default_backend() == "sglang-triton"


def test_cli_backend_sglang_without_sglang_exits_2_and_writes_nothing(no_sglang, cli, tmp_path):
    out = tmp_path / "reports" / "run.jsonl"
    r = cli("--backend", "sglang-triton", "--budget", "4", "--max-new-tokens", "2", "--out", str(out))
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install --no-deps sglang==0.5.23" in lines[0]
    assert not out.exists() and not out.parent.exists()


def test_cli_accept_sglang_without_sglang_exits_2(monkeypatch, cli, tmp_path):
    monkeypatch.setattr(accept_sglang, "SPEC_TREE_MODULE", "ddcheck_no_such.spec_tree")
    out = tmp_path / "run.jsonl"
    r = cli("--backend", "torch", "--accept", "sglang", "--budget", "4", "--max-new-tokens", "2", "--out", str(out))
    assert r.exit_code == 2, r.output
    assert "verify_tree_greedy_triton" in r.stderr and "sglang==0.5.23" in r.stderr
    assert not out.exists()


def test_cli_unknown_acceptor_exits_2(cli, tmp_path):
    out = tmp_path / "run.jsonl"
    r = cli("--backend", "torch", "--accept", "bogus", "--out", str(out))
    assert r.exit_code == 2
    assert "--accept must be walk or sglang" in r.stderr
    assert not out.exists()
