"""agentcredit.stats' comparison statistics against hand-computed values: the t-interval of a mean over seeds,
differences paired by seed, and steps to a threshold with censoring."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentcredit.stats import censored_steps, paired_by_seed, steps_to_threshold, t_interval

T975 = {1: 12.706204736174704, 2: 4.302652729749464}  # Student-t 0.975 quantiles, 1 and 2 degrees of freedom


def test_t_interval_by_hand():
    # mean 0.2, sd 0.1 (n - 1), half-width t_{0.975,2} * 0.1 / sqrt(3)
    lo, hi = t_interval([0.1, 0.2, 0.3])
    h = T975[2] * 0.1 / math.sqrt(3)
    assert lo == pytest.approx(0.2 - h, abs=1e-9) and hi == pytest.approx(0.2 + h, abs=1e-9)
    assert t_interval([0.4, 0.4]) == pytest.approx((0.4, 0.4))  # no spread: a point
    assert t_interval([0.7]) is None and t_interval([]) is None  # one seed has no spread to estimate
    lo90, hi90 = t_interval([0.1, 0.2, 0.3], level=0.90)
    assert lo < lo90 < 0.2 < hi90 < hi


def test_paired_by_seed_uses_common_seeds_only():
    d = paired_by_seed({0: 0.5, 1: 0.7, 2: 0.4}, {0: 0.3, 1: 0.6, 3: 0.9})
    assert d["seeds"] == [0, 1] and d["differences"] == pytest.approx([0.2, 0.1])
    assert d["mean"] == pytest.approx(0.15)
    h = T975[1] * math.sqrt(0.005) / math.sqrt(2)  # sd of (0.2, 0.1) is sqrt(0.005)
    assert d["t95"] == pytest.approx((0.15 - h, 0.15 + h))
    none = paired_by_seed({0: 0.5}, {1: 0.5})
    assert none["seeds"] == [] and none["mean"] is None and none["t95"] is None


def test_steps_to_threshold():
    curve = [(3, 0.9), (1, 0.2), (2, 0.5)]  # any order
    assert steps_to_threshold(curve, 0.5) == 2
    assert steps_to_threshold(curve, 0.95) is None
    assert steps_to_threshold(curve, 0.0) == 1
    assert steps_to_threshold([], 0.5) is None
    assert steps_to_threshold([(1, None), (2, 0.6)], 0.5) == 2


def test_censored_steps_by_hand():
    s = censored_steps([2, None, 4], budget=10)
    assert (s["runs"], s["reached"], s["budget"]) == (3, 2, 10)
    assert s["mean_reached"] == 3.0
    h = T975[1] * math.sqrt(2) / math.sqrt(2)  # (2, 4): sd sqrt(2)
    assert s["t95_reached"] == pytest.approx((3 - h, 3 + h))
    assert s["restricted_mean"] == pytest.approx(16 / 3)  # the unreached run counted at the budget
    none = censored_steps([None, None], budget=5)
    assert none["reached"] == 0 and none["mean_reached"] is None and none["restricted_mean"] == 5
    with pytest.raises(ValueError, match="budget"):
        censored_steps([1], budget=0)


@given(st.integers(1, 50).flatmap(lambda b: st.tuples(
    st.just(b), st.lists(st.one_of(st.none(), st.integers(1, b)), min_size=1, max_size=12))))
def test_censored_steps_invariants(case):
    budget, values = case
    s = censored_steps(values, budget)
    assert s["runs"] == len(values) and s["reached"] == sum(v is not None for v in values)
    assert 1 <= s["restricted_mean"] <= budget
    if s["reached"]:
        # censored runs count at the budget, above every step a run reached within it
        assert s["restricted_mean"] >= s["mean_reached"] - 1e-9
        if s["reached"] == s["runs"]:
            assert s["restricted_mean"] == pytest.approx(s["mean_reached"])


@given(st.lists(st.floats(0, 1), min_size=2, max_size=20))
def test_t_interval_contains_the_mean(xs):
    lo, hi = t_interval(xs)
    m = sum(xs) / len(xs)
    assert lo <= m + 1e-12 and m - 1e-12 <= hi and hi - m == pytest.approx(m - lo, abs=1e-9)

