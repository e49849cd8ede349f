"""The self-draft (harness/engine/ddtree/drafter.py): the target's first k layers +
final norm + head along its greedy chain give the per-depth distributions."""
from __future__ import annotations

import pytest
import torch

from harness.engine.model.llama import _rms_norm
from harness.engine.model.presets import PRESETS
from harness.check.prepare import prepare
from harness.engine.settings import RunSettings, UsageError


def prefilled(**kw):
    s = RunSettings(model="small", backend="torch", max_new_tokens=6, batch=2, **kw)
    engine = prepare(s).engine
    engine.prefill()
    return engine


def direct_drafts(engine, r, k: int) -> torch.Tensor:
    """The residual stream after layer k of the FULL target (its hidden_out), normed and through the head."""
    model, L = engine.model, engine.s.block_size - 1
    chain = list(r.prompt) + list(r.continuation)
    hidden: list[torch.Tensor] = []
    from harness.engine.attn.torch_backend import TorchBackend
    from harness.engine.ddtree.verify_inputs import prefill_metadata
    from harness.engine.mem.pool import KVPool
    n = len(chain)
    model.forward(torch.tensor(chain), torch.arange(n), prefill_metadata([n], torch.arange(1, n + 1)),
                  KVPool(model.cfg, n + 1, model.dtype, "cpu"), TorchBackend("cpu", model.dtype), hidden_out=hidden)
    h = _rms_norm(hidden[k], model.w["model.norm.weight"], model.cfg.rms_norm_eps)   # [n, hidden]
    logits = h @ model.w["lm_head.weight"].T
    start = len(r.prompt) + len(r.emitted) - 1
    return torch.log_softmax(logits.double(), -1)[start:start + L]


@pytest.mark.parametrize("k", [1, 3])
def test_self_draft_is_the_first_k_layers_early_exit(k):
    engine = prefilled(drafter="self", draft_layers=k)
    for r in engine.requests:
        r.emitted += r.continuation[1:3]   # two rounds on: the window moves along the chain
        got = engine.drafter.propose(r, 0)
        assert got.shape == (engine.s.block_size - 1, PRESETS["small"].vocab_size)
        torch.testing.assert_close(got, direct_drafts(engine, r, k), atol=1e-5, rtol=1e-5)


def test_full_depth_self_draft_proposes_the_greedy_chain_and_beats_the_stand_in():
    """k = every layer: the early exit IS the target, so its top-1 at depth d is the greedy token d
    after the root; the noisy stand-in at a low accuracy hits it far less often."""
    L = PRESETS["small"].num_layers
    self_engine, noisy = prefilled(drafter="self", draft_layers=L), prefilled(drafter="noisy")
    hits = {"self": 0, "noisy": 0}
    for name, engine in (("self", self_engine), ("noisy", noisy)):
        for r in engine.requests:
            r.spec = type(r.spec)(r.spec.name, r.spec.length, 0.2, r.spec.tokens)
            e = len(r.emitted)
            top1 = engine.drafter.propose(r, 0).argmax(-1).tolist()
            hits[name] += sum(t == r.continuation[e - 1 + d] for d, t in enumerate(top1, start=1))
    assert hits["self"] == 2 * (self_engine.s.block_size - 1)
    assert hits["noisy"] < hits["self"] // 2


def test_drafter_defaults_and_bad_names():
    assert RunSettings(model="tiny").drafter_config(2).kind == "noisy"          # presets keep their records
    cfg = RunSettings(model="some/checkpoint").drafter_config(30)
    assert (cfg.kind, cfg.layers) == ("self", 28)
    assert "--drafter self --draft-layers 4" in RunSettings(drafter="self", draft_layers=4).command()
    with pytest.raises(UsageError, match="--drafter"):
        RunSettings(drafter="eagle")


def test_case_file_names_its_drafter(tmp_path):
    from harness.workflows.cases import CaseError, load_case
    case = tmp_path / "c.toml"
    case.write_text('model = "tiny"\ndrafter = "self"\ndraft_layers = 1\n[[matrix]]\nbudget = [4]\n')
    s = load_case(case).settings()[0]
    assert (s.drafter, s.draft_layers) == ("self", 1)
    case.write_text('model = "tiny"\ndrafter = "eagle"\n[[matrix]]\nbudget = [4]\n')
    with pytest.raises(CaseError, match=r"c\.toml: key 'drafter'"):
        load_case(case)
