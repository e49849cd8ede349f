"""Router near ties (harness/check/compare/router_tie.py): a flip inside the
noise on both sides is a router tie, outside it on either side a divergence;
a node with no flip is not explained; a tied committed position carries the
tie to later nodes of its request."""
from __future__ import annotations

import torch

from harness.check.compare.router_tie import RouterTies, flips, noise_band

BAND = noise_band(torch.bfloat16)
LAYERS = (1,)


def _flips(oracle_margin: float, engine_gap: float, same: bool = False):
    eng = torch.tensor([[[0, 1]], [[2, 3]]])                       # [n=2, L=1, k=2]
    ora = torch.tensor([[[0, 1]], [[2, 3] if same else [2, 4]]])
    return flips(eng, torch.tensor([[1.0], [engine_gap]]), ora, torch.tensor([[1.0], [oracle_margin]],
                 dtype=torch.float64), LAYERS, [0, 1], BAND)


def test_band_is_four_eps_of_the_dtype():
    assert BAND == 4 * 2 ** -7 and noise_band(torch.float32) == 4 * 2 ** -23


def test_a_flip_inside_the_noise_on_both_sides_is_a_tie():
    found = _flips(BAND / 2, BAND / 3)
    assert [(f.row, f.layer, f.in_noise) for f in found] == [(1, 1, True)]
    assert RouterTies(BAND).judge(0, found) == "router-tie"


def test_a_flip_outside_the_noise_on_either_side_stays_a_divergence():
    assert RouterTies(BAND).judge(0, _flips(BAND * 3, BAND / 3)) == "router-flip"
    assert RouterTies(BAND).judge(0, _flips(BAND / 3, BAND * 3)) == "router-flip"


def test_no_flip_is_no_explanation_unless_a_tied_position_is_in_the_prefix():
    ties = RouterTies(BAND)
    assert _flips(BAND / 2, BAND / 2, same=True) == [] and ties.judge(0, []) is None
    ties.commit(0, 10, [0, 3, 5], {3})
    assert ties.tied_positions == {0: {11}}
    assert ties.judge(0, []) == "router-tie" and ties.judge(1, []) is None


def test_a_flip_in_a_later_layer_than_a_tie_inherits_it_and_a_first_flip_outside_the_noise_does_not():
    """tiny-kimi-k2 in bf16: a layer-1 flip of margin 2.3e-4 moved the row's layer-2 scores to a flip of
    margin 0.093; the later flip is the tie's consequence. A flip outside the noise in the first flipping
    layer, or in a layer before the tie, stays a divergence."""
    from harness.check.compare.router_tie import Flip
    tie, later = Flip(12, 1, 2.3e-4, 9e-5, True), Flip(12, 2, 0.093, 0.036, False)
    assert RouterTies(BAND).judge(0, [tie, later]) == "router-tie"
    assert RouterTies(BAND).judge(0, [later]) == "router-flip"
    assert RouterTies(BAND).judge(0, [Flip(12, 2, 2.3e-4, 9e-5, True), Flip(12, 1, 0.093, 0.036, False)]) \
        == "router-flip"
