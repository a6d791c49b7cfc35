"""SPrPO's pure part (:mod:`distill_plugins.sprpo`): layer discovery, hidden-state noise hooks that vanish without a
trace, pruning / fake quantisation that restore the weights bit for bit, the sensitivity controller's hand-computed
updates and invariants, its state round trip, and the parameter checks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from credit_plugins import registry
from distill_plugins import sprpo
from distill_plugins.sprpo import SensitivityController, SPrPOParams


class Block(nn.Module):
    def __init__(self, d: int, tuple_out: bool):
        super().__init__()
        self.lin, self.tuple_out = nn.Linear(d, d), tuple_out

    def forward(self, h):
        out = torch.tanh(self.lin(h)) + h
        return (out, None) if self.tuple_out else out


class Tiny(nn.Module):
    """Embedding, four decoder blocks (tuple outputs, as transformers layers may return), two heads in a shorter
    ModuleList, an LM head."""

    def __init__(self, d: int = 8, vocab: int = 11, tuple_out: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, tuple_out) for _ in range(4))
        self.heads = nn.ModuleList([nn.Linear(d, d), nn.Linear(d, d)])
        self.out = nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
            h = h[0] if isinstance(h, tuple) else h
        return self.out(h)


IDS = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])


def test_decoder_layers_is_the_longest_list_of_identical_blocks():
    m = Tiny()
    assert sprpo.decoder_layers(m) is m.layers
    assert sprpo.select_layers(m, [-1, 0, 4 - 1]) == [m.layers[0], m.layers[3]]
    with pytest.raises(ValueError, match=r"\[4\] out of range for a model of 4 decoder layers"):
        sprpo.select_layers(m, [4])
    with pytest.raises(ValueError, match="no nn.ModuleList"):
        sprpo.decoder_layers(nn.Sequential(nn.Linear(2, 2)))


@pytest.mark.parametrize("tuple_out", [True, False])
def test_noise_changes_outputs_and_leaves_no_trace(tuple_out):
    m = Tiny(tuple_out=tuple_out)
    clean = m(IDS)
    with sprpo.hidden_noise(m, 0.0) as count:
        assert torch.equal(m(IDS), clean) and count["calls"] == 0
    gen = torch.Generator().manual_seed(3)
    with sprpo.hidden_noise(m, 0.1, layers=[1, 2], generator=gen) as count:
        noisy = m(IDS)
    assert count["calls"] == 2 and not torch.allclose(noisy, clean)
    assert all(not layer._forward_hooks for layer in m.layers)
    assert torch.equal(m(IDS), clean)  # bit-identical after the block


def test_noise_is_sigma_times_the_token_rms_times_the_generators_draw():
    m = Tiny()
    h_in = m.emb(IDS)
    clean = m.layers[0](h_in)[0]
    with sprpo.hidden_noise(m, 0.3, layers=[0], generator=torch.Generator().manual_seed(5)):
        noisy = m.layers[0](h_in)[0]
    eps = torch.randn(clean.shape, generator=torch.Generator().manual_seed(5))
    token_rms = clean.detach().pow(2).mean(-1, keepdim=True).sqrt()
    torch.testing.assert_close(noisy - clean, 0.3 * token_rms * eps)


def test_noise_rejects_a_bad_sigma():
    with pytest.raises(ValueError, match="sigma"):
        with sprpo.hidden_noise(Tiny(), -0.1):
            pass


def _params(m):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("mode", ["magnitude", "random"])
def test_pruning_zeroes_the_fraction_and_restores_exactly(mode):
    m = Tiny()
    before, clean = _params(m), m(IDS)
    with sprpo.pruned(m, 0.5, mode, generator=torch.Generator().manual_seed(1)):
        for i, layer in enumerate(m.layers):
            w, w0 = layer.lin.weight, before[f"layers.{i}.lin.weight"].abs()
            assert int((w == 0).sum()) == 32  # half of 8 x 8
            if mode == "magnitude":  # the kept entries are the largest
                assert w0[w != 0].min() >= w0[w == 0].max()
        assert torch.equal(m.out.weight, before["out.weight"])  # outside the decoder layers: untouched
        assert not torch.allclose(m(IDS), clean)
    after = _params(m)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_weights_are_restored_even_when_the_block_raises():
    m = Tiny()
    before = _params(m)
    with pytest.raises(RuntimeError):
        with sprpo.fake_quantized(m, 2):
            raise RuntimeError("boom")
    assert all(torch.equal(before[k], v) for k, v in _params(m).items())


@pytest.mark.parametrize("bits", [2, 3, 8])
def test_fake_quantisation_uses_the_symmetric_grid_and_restores_exactly(bits):
    m = Tiny()
    before = _params(m)
    levels = 2 ** (bits - 1) - 1
    with sprpo.fake_quantized(m, bits, layers=[0]):
        w, w0 = m.layers[0].lin.weight, before["layers.0.lin.weight"]
        scale = w0.abs().amax(dim=1, keepdim=True) / levels
        q = w / scale
        torch.testing.assert_close(q, q.round(), atol=1e-4, rtol=0)  # on the grid
        assert q.abs().max() <= levels + 1e-4
        assert (w - w0).abs().max() <= scale.max() / 2 + 1e-6  # round to nearest
        assert torch.equal(m.layers[1].lin.weight, before["layers.1.lin.weight"])  # other layers untouched
    assert all(torch.equal(before[k], v) for k, v in _params(m).items())


@pytest.mark.parametrize("call, words", [
    (lambda m: sprpo.pruned(m, 1.0), "fraction"), (lambda m: sprpo.pruned(m, 0.1, "smallest"), "mode"),
    (lambda m: sprpo.fake_quantized(m, 1), "bits"), (lambda m: sprpo.fake_quantized(m, True), "bits"),
    (lambda m: sprpo.perturbed(m, "blur", 0.1), "unknown perturbation type 'blur'"),
    (lambda m: sprpo.perturbed(m, "quant", 4.5), "bit width"),
])
def test_bad_perturbations_are_value_errors(call, words):
    with pytest.raises(ValueError, match=words):
        with call(Tiny()):
            pass


def test_k3_sensitivity_hand_computed():
    lp = torch.zeros(1, 3)
    pert = torch.tensor([[math.log(2.0), 0.0, 5.0]])
    mask = torch.tensor([[1, 1, 0]])
    assert sprpo.k3_sensitivity(lp, pert, mask) == pytest.approx((2 - 1 - math.log(2)) / 2)
    assert sprpo.k3_sensitivity(lp, pert, torch.zeros(1, 3)) == 0.0
    assert sprpo.k3_sensitivity(lp, lp, mask) == 0.0


def test_controller_hand_computed_updates():
    c = SensitivityController(SPrPOParams(sigma=0.05, target_kl=0.01, rate=0.5, max_change=2.0))
    assert c.update(0.04) == pytest.approx(0.025)       # (0.01 / 0.04)^0.5 = 0.5
    assert c.update(0.0025) == pytest.approx(0.05)      # (4)^0.5 = 2
    assert c.update(1e-6) == pytest.approx(0.1)         # (1e4)^0.5 = 100, clipped to max_change 2
    assert c.update(0.0) == pytest.approx(0.2)          # no measurable change: factor max_change
    assert c.update(None) == pytest.approx(0.2)         # not measured this step: unchanged
    assert c.step == 5 and c.last_sensitivity == 0.0
    top = SensitivityController(SPrPOParams(sigma=0.8, sigma_max=1.0))
    assert top.update(0.0) == 1.0                       # clipped to sigma_max
    fixed = SensitivityController(SPrPOParams(adaptive=False))
    assert fixed.update(5.0) == 0.05 and fixed.last_sensitivity == 5.0
    assert c.over_bound(0.051) and not c.over_bound(0.05)
    with pytest.raises(ValueError, match="sensitivity"):
        c.update(float("nan"))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 10.0), min_size=1, max_size=20), st.floats(0.01, 1.0), st.floats(1.01, 5.0))
def test_controller_stays_in_its_clip_and_moves_against_the_excess(ds, rate, gamma):
    p = SPrPOParams(sigma=0.05, rate=rate, max_change=gamma, sigma_min=1e-3, sigma_max=1.0)
    c = SensitivityController(p)
    for d in ds:
        before = c.sigma
        after = c.update(d)
        assert p.sigma_min <= after <= p.sigma_max
        assert before / gamma * (1 - 1e-12) <= after <= before * gamma * (1 + 1e-12)
        if d > p.target_kl:
            assert after <= before
        elif d < p.target_kl:
            assert after >= before


def test_controller_state_round_trip_and_bad_state():
    c = SensitivityController(SPrPOParams())
    for d in (0.02, 0.001, 0.3):
        c.update(d)
    c.rejected = 2
    fresh = SensitivityController(SPrPOParams())
    fresh.load_state_dict(c.state_dict())
    assert fresh.state_dict() == c.state_dict()
    assert fresh.update(0.01) == c.update(0.01)
    with pytest.raises(ValueError, match="lacks"):
        fresh.load_state_dict({"sigma": 0.1})
    with pytest.raises(ValueError, match=">= 0"):
        fresh.load_state_dict({"sigma": -1.0, "step": 0})


@pytest.mark.parametrize("values, words", [
    ({"kl_max": 0.001}, "kl_max=0.001 is below target_kl"),
    ({"sigma": 2.0}, "outside [sigma_min, sigma_max]"),
    ({"sigma_min": 0.5, "sigma_max": 0.2}, "sigma_min=0.5 exceeds"),
    ({"sigma": -0.1}, "sigma=-0.1"),
    ({"rate": 0.0}, "rate=0.0"),
    ({"layers": [0.5]}, "layers"),
    ({"measure_every": 0}, "measure_every=0"),
    ({"sigmaa": 0.1}, "sigmaa"),
])
def test_bad_params_are_value_errors_naming_the_field(values, words):
    with pytest.raises(ValueError) as e:
        registry.get("sprpo", kind="terms").make_params(**values)
    assert words in str(e.value)


def test_sprpo_is_a_registered_term():
    spec = registry.get("sprpo", kind="terms")
    assert spec.params is SPrPOParams and spec.formula == sprpo.FORMULA and "trl" in spec.bridges
