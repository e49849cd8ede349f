"""The port machinery itself: loading by path, SGLang-rule mask reading, the structural audit."""
from __future__ import annotations

import textwrap

import pytest
import torch

from harness.ports.audit import audit_commit, audit_mask
from harness.ports.loading import load_port_module, require
from harness.ports.mask_reading import kernel_mask
from harness.ports.protocol import PortError, PortMask
from harness.engine.ddtree.accept import Acceptance
from harness.engine.ddtree.mask import request_mask_block
from harness.engine.ddtree.tree import DraftTree

CHAIN = DraftTree((5, 6, 7), (None, 0, 1), (0, 1, 2), q_len=5)      # 2 drafts, 2 padding rows
BRANCH = DraftTree((5, 6, 7, 8), (None, 0, 0, 1), (0, 1, 1, 2), q_len=4)


def test_loader_stubs_only_missing_server_imports(tmp_path):
    f = tmp_path / "port.py"
    f.write_text(textwrap.dedent("""
        import torch
        from sglang.srt.managers.no_such_module_here import ScheduleBatch
        from sglang.srt.also_missing import helper

        @helper
        def build(x: "ScheduleBatch"):
            return x + 1
    """))
    loaded = load_port_module(f)
    assert loaded.module.build(1) == 2                       # the stub decorator returns the function
    assert "sglang.srt.managers.no_such_module_here" in loaded.stubbed
    assert require(loaded.module, f, "build") is loaded.module.build


def test_loader_errors_are_one_line(tmp_path):
    f = tmp_path / "port.py"
    f.write_text("def build():\n    pass\n")
    with pytest.raises(PortError, match=r"no function compile\(\)"):
        require(load_port_module(f).module, f, "build", "compile")
    bad = tmp_path / "bad.py"
    bad.write_text("raise RuntimeError('boom\\nsecond line')\n")
    with pytest.raises(PortError) as e:
        load_port_module(bad)
    assert "boom" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(PortError, match="does not exist"):
        load_port_module(tmp_path / "nope.py")


def test_additive_mask_reads_zero_as_visible():
    block = request_mask_block(CHAIN, 3)                                    # [5, 8]
    additive = torch.where(block, 0.0, float("-inf"))
    km = kernel_mask(PortMask(additive, "additive", "flat"), 5, [3])
    assert torch.equal(km.custom_mask, block.reshape(-1))
    km = kernel_mask(PortMask(block.to(torch.uint8) * 7, "nonzero", "flat"), 5, [3])
    assert torch.equal(km.custom_mask, block.reshape(-1))


def test_rectangle_reaches_the_kernel_shifted_for_unequal_prefixes():
    """A [bs, q, max_P+q] rectangle read flat through the server's indptr:
    request 0 (longest prefix) is right, request 1 reads shifted rows."""
    prefixes, q = [4, 2], CHAIN.q_len
    rect = torch.zeros((2, q, 4 + q), dtype=torch.bool)
    for b, p in enumerate(prefixes):
        rect[b, :, :p] = True
        rect[b, :, 4:] = request_mask_block(CHAIN, p)[:, p:]
    km = kernel_mask(PortMask(rect, "allow", "rectangle"), q, prefixes)
    ip = km.mask_indptr.tolist()
    assert torch.equal(km.custom_mask[:ip[1]], request_mask_block(CHAIN, 4).reshape(-1))
    assert not torch.equal(km.custom_mask[ip[1]:ip[2]], request_mask_block(CHAIN, 2).reshape(-1))
    assert km.port_numel != km.expected_numel


def test_short_mask_hides_keys_and_is_counted():
    block = request_mask_block(CHAIN, 3).reshape(-1)
    km = kernel_mask(PortMask(block[:-6], "allow", "flat"), 5, [3])
    assert km.port_numel == block.numel() - 6 and not km.custom_mask[-6:].any()


@pytest.mark.parametrize("edit, check, severity", [
    (lambda b: b[1].__setitem__(3 + 3, True), "mask-padding-visible", "error"),   # row 1 sees padding column 3
    (lambda b: b[2].__setitem__(3 + 1, False), "mask-missing-key", "error"),      # row 2 misses its parent
    (lambda b: b[4].fill_(False), "padding-row-empty", "warning"),
    (lambda b: b[1].__setitem__(0, False), "mask-prefix-blocked", "error"),
])
def test_audit_names_each_mask_defect(edit, check, severity):
    block = request_mask_block(CHAIN, 3)
    assert audit_mask(0, 0, CHAIN, 3, block, reads_prefix=True) == []
    edit(block)
    found = audit_mask(0, 0, CHAIN, 3, block, reads_prefix=True)
    assert [(f.check, f.severity) for f in found] == [(check, severity)]


def test_audit_sibling_visibility_is_an_extra_key():
    block = request_mask_block(BRANCH, 2)
    block[2, 2 + 1] = True                                  # row 2 sees its sibling row 1
    found = audit_mask(0, 0, BRANCH, 2, block, reads_prefix=False)
    assert [f.check for f in found] == ["mask-extra-key"] and found[0].rows == (2,)


def test_commit_audit_checks_kv_per_committed_position():
    from ddschema import ModelConfig
    from harness.engine.mem.pool import KVPool, ReqToTokenPool
    cfg = ModelConfig(vocab_size=16, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
                      intermediate_size=16, max_position=64)
    pool, req = KVPool(cfg, 40, torch.float32, "cpu"), ReqToTokenPool(2, 32, "cpu")
    loc = pool.allocator.alloc(4)
    for layer in range(2):
        pool.set_kv(layer, loc, torch.randn(4, 1, 4), torch.randn(4, 1, 4))
    before = [(pool.k_buffer[l][loc].clone(), pool.v_buffer[l][loc].clone()) for l in range(2)]
    acc = Acceptance((0, 1, 3), 9)
    req.req_to_token[0, 5:8] = loc[[0, 1, 3]]
    freed = {int(loc[2])}
    pool.allocator.free(loc[[2]])
    assert audit_commit(0, req, pool, [0], [5], loc, 4, [acc], before, [8], freed) == []
    req.req_to_token[0, 7] = loc[2]                         # position 7 points at row 2's (freed) slot
    checks = {f.check for f in audit_commit(0, req, pool, [0], [5], loc, 4, [acc], before, [8], freed)}
    assert checks == {"commit-kv", "commit-slot", "slot-leak"}


def test_padding_inputs_against_the_declared_convention():
    from harness.ports.audit import audit_padding_inputs
    ids = [5, 6, 7, 0, 0]
    pos = [3, 4, 5, 3, 3]
    assert audit_padding_inputs(0, 0, CHAIN, 3, ids, pos, (0, 3)) == []
    found = audit_padding_inputs(0, 0, CHAIN, 3, ids, pos, (5, 3))      # declared: the root's token
    assert [(f.check, f.severity, f.rows) for f in found] == [("padding-convention", "warning", (3, 4))]
    assert audit_padding_inputs(0, 0, CHAIN, 3, ids, [3, 4, 5, 3, 0], (None, 3))[0].rows == (4,)


def test_loader_registers_the_module_while_it_runs(tmp_path):
    """A port defining dataclasses needs its module in sys.modules during import."""
    f = tmp_path / "port.py"
    f.write_text("from dataclasses import dataclass\n@dataclass\nclass Tree:\n    n: int\n")
    assert load_port_module(f).module.Tree(3).n == 3
