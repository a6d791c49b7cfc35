"""credit_plugins.scaling: the advantage scale both bridges apply after the estimator (adv_scale)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import credit_plugins as cp
from credit_plugins.scaling import ADV_SCALES, DEFAULT_ADV_SCALE, EPS, STD_FLOOR, adv_scale_factor, check_adv_scale


# ---- hand-computed cases -------------------------------------------------------------------------------------------
def test_batch_rms_divides_by_the_root_mean_square_over_the_decisions():
    adv = torch.tensor([1.0, -3.0, 0.0, 2.0])  # mean A^2 = 14 / 4
    out, factor = cp.scale_advantages(adv, "batch_rms")
    assert factor == pytest.approx(1 / (math.sqrt(3.5) + EPS), rel=1e-12)
    assert torch.allclose(out, adv / math.sqrt(3.5), rtol=1e-6)
    assert out.dtype == adv.dtype and out.shape == adv.shape


def test_batch_std_is_not_recentred_and_keeps_signs():
    adv = torch.tensor([1.0, 3.0])  # mean 2, population std 1: divided by 1, not shifted to (-1, 1)
    out, factor = cp.scale_advantages(adv, "batch_std")
    assert factor == pytest.approx(1 / (1 + EPS), rel=1e-12)
    assert torch.allclose(out, adv, rtol=1e-5)
    centred = torch.tensor([2.0, -2.0, 0.0, 0.0])  # mean 0: std == rms == sqrt(2)
    assert cp.adv_scale_factor(centred, "batch_std") == pytest.approx(cp.adv_scale_factor(centred, "batch_rms"))
    assert cp.adv_scale_factor(centred, "batch_std") == pytest.approx(1 / (math.sqrt(2) + EPS))


def test_batch_std_of_a_constant_batch_is_floored_at_a_tenth_of_the_rms():
    out, factor = cp.scale_advantages(torch.tensor([2.0, 2.0, 2.0]), "batch_std")  # std 0, rms 2
    assert factor == pytest.approx(1 / (STD_FLOOR * 2 + EPS))
    assert torch.allclose(out, torch.full((3,), 10.0), rtol=1e-5)


def test_token_level_statistic_runs_over_the_mask_tokens_only():
    adv = torch.tensor([[1.0, 5.0, 7.0], [-1.0, 3.0, 0.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 0]])  # decisions 1, -1, 3: mean A^2 = 11 / 3
    out, factor = cp.scale_advantages(adv, "batch_rms", mask)
    assert factor == pytest.approx(1 / (math.sqrt(11 / 3) + EPS))
    assert torch.allclose(out, adv * factor)  # one number for the whole tensor
    assert cp.adv_scale_factor(adv, "batch_rms", mask.bool()) == factor


def test_none_empty_and_all_zero_batches_keep_factor_one_without_nan():
    big = torch.tensor([1e30, -2e30])
    out, factor = cp.scale_advantages(big, "none")
    assert factor == 1.0 and out is big
    for mode in ADV_SCALES:
        zeros, f0 = cp.scale_advantages(torch.zeros(5), mode)
        assert f0 == 1.0 and torch.equal(zeros, torch.zeros(5))
        empty, fe = cp.scale_advantages(torch.zeros(0), mode)
        assert fe == 1.0 and empty.numel() == 0
        nothing_scored = cp.adv_scale_factor(torch.ones(2, 3), mode, torch.zeros(2, 3, dtype=torch.bool))
        assert nothing_scored == 1.0


def test_eps_keeps_a_batch_of_numerical_noise_small():
    noise = torch.tensor([1e-9, -1e-9])
    out, factor = cp.scale_advantages(noise, "batch_rms")
    assert factor == pytest.approx(1 / (1e-9 + EPS)) and out.abs().max() < 1e-2


def test_extreme_float32_magnitudes_neither_overflow_nor_underflow():
    for x in (3e38, 1e-44):
        out, factor = cp.scale_advantages(torch.tensor([x, -x], dtype=torch.float32), "batch_rms", eps=0.0)
        assert torch.isfinite(out).all() and out.abs().max().item() == pytest.approx(1.0, rel=1e-3)
        assert math.isfinite(factor) and factor > 0


def test_default_is_one_of_the_valid_values_and_none_means_the_default():
    assert DEFAULT_ADV_SCALE in ADV_SCALES
    assert check_adv_scale(None) == DEFAULT_ADV_SCALE
    assert all(check_adv_scale(m) == m for m in ADV_SCALES)


# ---- hostile input -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["batch-rms", "RMS", "", 1, True, ["batch_rms"]])
def test_unknown_mode_names_adv_scale_and_the_valid_values(mode):
    with pytest.raises(ValueError, match=r"adv_scale=.* is not an advantage scale; valid: none, batch_rms, batch_std"):
        cp.adv_scale_factor(torch.ones(3), mode)
    with pytest.raises(ValueError, match=r"agentcredit\.adv_scale="):
        check_adv_scale(mode, where="agentcredit.adv_scale")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("mode", ADV_SCALES)
def test_nan_or_inf_among_the_decisions_is_a_value_error(bad, mode):
    with pytest.raises(ValueError, match=r"1 of 3 scored advantage\(s\) are NaN or inf"):
        cp.scale_advantages(torch.tensor([1.0, bad, -1.0]), mode)


def test_nan_in_padding_is_ignored():
    adv = torch.tensor([[1.0, float("nan")], [-1.0, float("inf")]])
    mask = torch.tensor([[True, False], [True, False]])
    assert cp.adv_scale_factor(adv, "batch_rms", mask) == pytest.approx(1 / (1 + EPS))


@pytest.mark.parametrize("adv,mask,match", [
    (torch.ones(2, 2, 2), None, r"\[S\] \(per step\) or \[S, L\] \(per token\), got shape \(2, 2, 2\)"),
    (torch.ones(3, dtype=torch.long), None, "floating-point tensor, got torch.int64"),
    ([1.0, 2.0], None, "must be a torch.Tensor, got list"),
    (torch.ones(2, 3), torch.ones(2, 2), r"mask must be a tensor of the advantages' shape \(2, 3\), got \(2, 2\)"),
    (torch.ones(3), [1, 1, 1], "mask must be a tensor of the advantages' shape"),
    (torch.ones(3), torch.tensor([0, 1, 2]), "mask must hold 0/1 or bools"),
])
def test_bad_shapes_and_types_are_value_errors(adv, mask, match):
    with pytest.raises(ValueError, match=match):
        cp.adv_scale_factor(adv, "batch_rms", mask)


@pytest.mark.parametrize("eps", [-1e-6, float("nan"), float("inf"), "1e-6", True])
def test_bad_eps_is_a_value_error(eps):
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        cp.adv_scale_factor(torch.ones(3), "batch_rms", eps=eps)


# ---- invariants ------------------------------------------------------------------------------------------------------
values = st.floats(-100.0, 100.0, allow_nan=False, width=32)


@st.composite
def batches(draw, max_rows: int = 12, max_len: int = 6):
    """A non-degenerate ``[S]`` or ``[S, L]`` batch (some scored |A| >= 1) with its mask; padding may hold anything."""
    token = draw(st.booleans())
    shape = (draw(st.integers(1, max_rows)),) + ((draw(st.integers(1, max_len)),) if token else ())
    n = math.prod(shape)
    adv = torch.tensor(draw(st.lists(values, min_size=n, max_size=n)), dtype=torch.float32).reshape(shape)
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n))).reshape(shape)
    first = int(draw(st.integers(0, n - 1)))
    mask.view(-1)[first] = True
    adv.view(-1)[first] = draw(st.sampled_from([1.0, -1.0])) * draw(st.floats(1.0, 100.0, width=32))
    return adv, mask


@settings(max_examples=200, deadline=None)
@given(batches(), st.sampled_from(["batch_rms", "batch_std"]), st.floats(1e-3, 1e3))
def test_scaled_output_is_invariant_to_the_estimators_scale(batch, mode, c):
    adv, mask = batch
    a, _ = cp.scale_advantages(adv, mode, mask, eps=0.0)
    b, _ = cp.scale_advantages(adv * c, mode, mask, eps=0.0)
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)


@settings(max_examples=200, deadline=None)
@given(batches(), st.sampled_from(ADV_SCALES))
def test_signs_are_kept_and_the_factor_is_positive(batch, mode):
    adv, mask = batch
    out, factor = cp.scale_advantages(adv, mode, mask)
    assert factor > 0 and math.isfinite(factor)
    assert (torch.sign(out) * torch.sign(adv) >= 0).all()  # never flipped ...
    underflow = (adv.double() * factor).abs() < torch.finfo(torch.float32).tiny
    assert ((out != 0) | (adv == 0) | underflow).all()  # ... and not lost, but to float32 underflow


@settings(max_examples=200, deadline=None)
@given(batches())
def test_batch_rms_output_has_rms_one_over_the_decisions(batch):
    adv, mask = batch
    out, _ = cp.scale_advantages(adv, "batch_rms", mask)
    assert out[mask].double().square().mean().sqrt().item() == pytest.approx(1.0, rel=1e-4)
    assert out[mask].abs().max().item() <= math.sqrt(int(mask.sum())) * (1 + 1e-5)  # bounded by sqrt(n)


@settings(max_examples=200, deadline=None)
@given(batches())
def test_batch_std_output_has_std_one_unless_floored_and_stays_bounded(batch):
    adv, mask = batch
    out, _ = cp.scale_advantages(adv, "batch_std", mask)
    x = adv[mask].double()
    y = out[mask].double()
    if x.std(unbiased=False) > STD_FLOOR * x.square().mean().sqrt():
        assert y.std(unbiased=False).item() == pytest.approx(1.0, rel=1e-4)
    assert y.abs().max().item() <= math.sqrt(x.numel()) / STD_FLOOR * (1 + 1e-5)


@settings(max_examples=200, deadline=None)
@given(batches(), st.sampled_from(ADV_SCALES), st.floats(allow_nan=True, allow_infinity=True, width=32))
def test_padding_values_never_change_the_factor(batch, mode, junk):
    adv, mask = batch
    other = torch.where(mask, adv, torch.full_like(adv, junk))
    assert cp.adv_scale_factor(other, mode, mask) == adv_scale_factor(adv, mode, mask)
