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
from harness.engine.ddtree.mask import kernel_visible, request_mask_block
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


def test_a_mask_reaches_the_kernel_with_the_ports_dtype_and_values():
    """No intent reading: an additive bias keeps its dtype and values, and the
    kernel's rule (nonzero = visible) reads it inverted; 0/7 uint8 reads as 0/1."""
    block = request_mask_block(CHAIN, 3)                                    # [5, 8]
    additive = torch.where(block, 0.0, torch.finfo(torch.bfloat16).min).to(torch.bfloat16)
    km = kernel_mask(PortMask(additive, "flat"), 5, [3])
    assert km.custom_mask.dtype == torch.bfloat16 and torch.equal(km.custom_mask, additive.reshape(-1))
    assert torch.equal(kernel_visible(km.custom_mask), ~block.reshape(-1))
    km = kernel_mask(PortMask(block.to(torch.uint8) * 7, "flat"), 5, [3])
    assert torch.equal(kernel_visible(km.custom_mask), block.reshape(-1))


def test_kernel_visible_is_sglangs_nonzero_rule():
    mask = torch.tensor([0.0, 1.0, -float("inf"), float("nan"), 0.5, -0.0])
    assert kernel_visible(mask).tolist() == [False, True, True, True, True, False]
    assert kernel_visible(torch.tensor([True, False])).tolist() == [True, False]


@pytest.mark.parametrize("backend", ["torch", "sglang-triton", "sglang-unified"])
def test_every_backend_reads_an_additive_mask_inverted(backend):
    """The same bf16 additive mask on each backend: the output equals that of the
    complement mask handed over as bool, on the kernel's own arithmetic."""
    from harness.engine.attn.registry import make_backend
    from harness.engine.ddtree.verify_inputs import AttnMetadata
    if backend != "torch":
        pytest.importorskip("sglang")
    be = make_backend(backend, "cpu", torch.float32)
    tree, p = BRANCH, 3
    allow = request_mask_block(tree, p)                                     # [4, 7]
    additive = torch.where(allow, 0.0, torch.finfo(torch.bfloat16).min).to(torch.bfloat16).reshape(-1)
    g = torch.Generator().manual_seed(0)
    n, heads, d, slots = tree.q_len, 2, 16, 16
    q, k, v = (torch.randn(n, heads, d, generator=g) for _ in range(3))
    kb, vb = torch.randn(slots, heads, d, generator=g), torch.randn(slots, heads, d, generator=g)
    loc = torch.arange(p, p + n)
    kb[loc], vb[loc] = k, v

    def meta(mask):
        return AttnMetadata(qo_indptr=torch.tensor([0, n]), kv_indptr=torch.tensor([0, p]),
                            kv_indices=torch.arange(p), out_cache_loc=loc, custom_mask=mask,
                            mask_indptr=torch.tensor([0, n * (p + n)]), max_len_extend=n)
    complement = ~allow
    complement[:, :p] = True     # the kernel under skip_prefix never reads these; make every backend agree
    additive_prefix_visible = additive.clone().view(n, p + n)
    additive_prefix_visible[:, :p] = 1.0
    got = be.forward(q, k, v, 0, kb, vb, meta(additive_prefix_visible.reshape(-1)))
    want = be.forward(q, k, v, 0, kb, vb, meta(complement.reshape(-1)))
    assert torch.allclose(got, want, atol=1e-5)
    right = be.forward(q, k, v, 0, kb, vb, meta(allow.reshape(-1)))
    assert not torch.allclose(got, right, atol=1e-3)


def test_rectangle_reaches_the_kernel_shifted_for_unequal_prefixes():
    """A [bs, q, max_P+q] rectangle read flat through the server's indptr:
    request 0 (longest prefix) is right, request 1 reads shifted rows."""
    prefixes, q = [4, 2], CHAIN.q_len
    rect = torch.zeros((2, q, 4 + q), dtype=torch.bool)
    for b, p in enumerate(prefixes):
        rect[b, :, :p] = True
        rect[b, :, 4:] = request_mask_block(CHAIN, p)[:, p:]
    km = kernel_mask(PortMask(rect, "rectangle"), q, prefixes)
    ip = km.mask_indptr.tolist()
    assert torch.equal(km.custom_mask[:ip[1]], request_mask_block(CHAIN, 4).reshape(-1))
    assert not torch.equal(km.custom_mask[ip[1]:ip[2]], request_mask_block(CHAIN, 2).reshape(-1))
    assert km.port_numel != km.expected_numel


def test_short_mask_hides_keys_and_is_counted():
    block = request_mask_block(CHAIN, 3).reshape(-1)
    km = kernel_mask(PortMask(block[:-6], "flat"), 5, [3])
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


def test_audit_names_an_inverted_mask_once_and_only_when_nine_in_ten_real_entries_are_flipped():
    block = request_mask_block(BRANCH, 2)                   # [4, 6]
    inverted = block.clone()
    inverted[:, 2:] = ~block[:, 2:]
    found = audit_mask(0, 0, BRANCH, 2, inverted, reads_prefix=False, encoding="bfloat16, values -3.39e+38, 0")
    assert [f.check for f in found] == ["mask-inverted"]
    assert "bfloat16" in found[0].detail and "16 of 16" in found[0].detail
    one_off = inverted.clone()
    one_off[3, 2 + 3] = True                                # 15 of 16 flipped (94%): still the inversion, said so
    (f,) = audit_mask(0, 0, BRANCH, 2, one_off, reads_prefix=False)
    assert f.check == "mask-inverted" and "15 of 16" in f.detail and "other 1 entries" in f.detail
    two_off = one_off.clone()
    two_off[2, 2 + 2] = True                                # 14 of 16 (87.5%): below the rule, not an inversion
    assert "mask-inverted" not in [f.check for f in audit_mask(0, 0, BRANCH, 2, two_off, reads_prefix=False)]


def test_a_row_that_sees_no_key_is_judged_by_what_the_backend_produced():
    block = request_mask_block(CHAIN, 3)
    block[4].fill_(False)                                   # padding row 4 sees nothing
    finite = [True] * 5
    (warn,) = audit_mask(0, 0, CHAIN, 3, block, reads_prefix=True, produced=("sglang-triton", finite))
    assert (warn.check, warn.severity) == ("padding-row-empty", "warning") and "stayed finite" in warn.detail
    nan = finite[:4] + [False]
    (err,) = audit_mask(0, 0, CHAIN, 3, block, reads_prefix=True, produced=("torch", nan))
    assert (err.check, err.severity) == ("padding-row-empty", "error") and "torch backend produced non-finite" in err.detail
