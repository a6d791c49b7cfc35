"""EVOKE's ranking loss and accuracy (distill_plugins.evoke): hand-computed cases, invariants, the weight schedule,
bad input and the recipe block."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from distill_plugins.evoke import EVOKEParams, evoke_loss, ranking_accuracy, weight_at
from distill_plugins.terms.evoke import SPEC


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def test_listwise_hand_computed():
    # softmax([0, ln 3]) = [1/4, 3/4]; the best action is the first: -log(1/4)
    assert float(evoke_loss(t([[0.0, math.log(3)]]), t([[1.0, 0.0]]))) == pytest.approx(math.log(4))
    # two best actions share the target: -(1/2 log 1/3 + 1/2 log 1/3) = log 3
    assert float(evoke_loss(t([[0.0, 0.0, 0.0]]), t([[1.0, 1.0, 0.5]]))) == pytest.approx(math.log(3))


def test_pairwise_hand_computed():
    assert float(evoke_loss(t([[0.0, 0.0]]), t([[1.0, 0.0]]), form="pairwise")) == pytest.approx(math.log(2))
    # values 2 > 1 > 0, scores [1, 0, 0]: pairs (0,1), (0,2): log(1 + e^-1); (1,2): log 2
    want = (2 * math.log1p(math.exp(-1)) + math.log(2)) / 3
    got = evoke_loss(t([[1.0, 0.0, 0.0]]), t([[2.0, 1.0, 0.0]]), form="pairwise")
    assert float(got) == pytest.approx(want)


def test_groups_mean_ties_and_padding():
    scores = t([[0.0, math.log(3), 0.0], [5.0, -2.0, 0.0], [1.0, 2.0, 99.0]])
    values = t([[1.0, 0.0, 0.0], [0.3, 0.3, 0.0], [0.0, 1.0, 7.0]])
    mask = torch.tensor([[True, True, False], [True, True, False], [True, True, False]])
    # group 1 ties (left out); the padded column of group 2 (score 99, value 7) is ignored
    want = (math.log(4) + (-math.log(math.exp(2) / (math.exp(1) + math.exp(2))))) / 2
    assert float(evoke_loss(scores, values, mask)) == pytest.approx(want)
    acc = ranking_accuracy(scores, values, mask)
    assert acc == {"rank_acc": pytest.approx(0.5), "top1_acc": pytest.approx(0.5), "groups": 2.0}


def test_all_ties_give_zero_attached_loss_and_nan_accuracy():
    scores = t([[0.3, 0.1]]).requires_grad_()
    loss = evoke_loss(scores, t([[0.5, 0.5]]))
    assert float(loss.detach()) == 0.0 and loss.requires_grad
    loss.backward()
    assert scores.grad.abs().sum() == 0
    acc = ranking_accuracy(scores, t([[0.5, 0.5]]))
    assert math.isnan(acc["rank_acc"]) and acc["groups"] == 0.0


def test_accuracy_perfect_reversed_and_score_ties():
    values = t([[0.9, 0.81, 0.729, 0.0]])
    assert ranking_accuracy(t([[4.0, 3.0, 2.0, 1.0]]), values) == {"rank_acc": 1.0, "top1_acc": 1.0, "groups": 1.0}
    assert ranking_accuracy(t([[1.0, 2.0, 3.0, 4.0]]), values)["rank_acc"] == 0.0
    assert ranking_accuracy(t([[1.0, 1.0, 1.0, 1.0]]), values) == {"rank_acc": 0.5, "top1_acc": 0.25, "groups": 1.0}
    # two top-scored actions, one of them the best: half a hit, whichever column comes first
    assert ranking_accuracy(t([[2.0, 2.0, 0.0, 0.0]]), values)["top1_acc"] == 0.5
    assert ranking_accuracy(t([[0.0, 2.0, 2.0, 0.0]]), values)["top1_acc"] == 0.0


groups = st.integers(1, 4).flatmap(lambda g: st.integers(2, 6).flatmap(lambda a: st.tuples(
    st.lists(st.lists(st.floats(-5, 5), min_size=a, max_size=a), min_size=g, max_size=g),
    st.lists(st.lists(st.sampled_from([0.0, 0.59, 0.729, 0.81, 0.9, 1.0]), min_size=a, max_size=a), min_size=g,
             max_size=g),
    st.permutations(range(a)))))


@settings(max_examples=60, deadline=None)
@given(groups, st.sampled_from(["listwise", "pairwise"]))
def test_permuting_candidates_with_their_targets_changes_nothing(case, form):
    scores, values, perm = t(case[0]), t(case[1]), list(case[2])
    assert float(evoke_loss(scores[:, perm], values[:, perm], form=form)) == pytest.approx(
        float(evoke_loss(scores, values, form=form)), abs=1e-9)
    a, b = ranking_accuracy(scores, values), ranking_accuracy(scores[:, perm], values[:, perm])
    assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], nan_ok=True) for k in a)


@settings(max_examples=40, deadline=None)
@given(groups, st.sampled_from(["listwise", "pairwise"]))
def test_loss_decreases_along_its_gradient(case, form):
    scores, values = t(case[0]).requires_grad_(), t(case[1])
    loss = evoke_loss(scores, values, form=form)
    if not loss.requires_grad or float(loss.detach()) == 0.0:
        return
    loss.backward()
    if float(scores.grad.norm()) < 1e-5:  # below that the step's gain 1e-3 |g|^2 nears float64 rounding of the loss
        return
    # a step of -1e-3 g: its gain 1e-3 |g|^2 beats the curvature's 0.5e-6 |g|^2 H at any |g| (a step of fixed length
    # along g / |g| loses to the curvature where two top scores nearly tie and |g| is ~1e-4)
    stepped = evoke_loss((scores - 1e-3 * scores.grad).detach(), values, form=form)
    assert float(stepped) < float(loss.detach())


def test_sorting_scores_by_value_maximises_accuracy_and_lowers_loss():
    values = t([[0.0, 0.9, 0.81, 1.0]])
    good, bad = values * 10, -values * 10
    assert ranking_accuracy(good, values)["rank_acc"] == 1.0
    for form in ("listwise", "pairwise"):
        assert float(evoke_loss(good, values, form=form)) < float(evoke_loss(bad, values, form=form))


def test_weight_schedules():
    p = EVOKEParams(weight=0.4, schedule_steps=10)
    assert [weight_at(p, k) for k in (0, 5, 50)] == [0.4, 0.4, 0.4]
    p = EVOKEParams(weight=0.4, schedule="warmup", schedule_steps=10)
    assert [weight_at(p, k) for k in (0, 5, 10, 50)] == pytest.approx([0.0, 0.2, 0.4, 0.4])
    p = EVOKEParams(weight=0.4, schedule="linear", schedule_steps=10)
    assert [weight_at(p, k) for k in (0, 5, 10, 50)] == pytest.approx([0.4, 0.2, 0.0, 0.0])


@pytest.mark.parametrize("bad, field", [({"weight": -0.1}, "weight"), ({"goals": 0}, "goals"),
                                        ({"states": 0}, "states"), ({"loss": "listnet"}, "loss"),
                                        ({"schedule": "cosine"}, "schedule"), ({"schedule_steps": 0}, "schedule_steps"),
                                        ({"gamma": 0.9}, "gamma")])
def test_bad_params_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        SPEC.make_params(**bad)


def test_bad_tensors():
    with pytest.raises(ValueError, match="groups, actions"):
        evoke_loss(t([0.0, 1.0]), t([0.0, 1.0]))
    with pytest.raises(ValueError, match="NaN"):
        evoke_loss(t([[0.0, 1.0]]), t([[math.nan, 1.0]]))
    with pytest.raises(ValueError, match="mask"):
        evoke_loss(t([[0.0, 1.0]]), t([[0.0, 1.0]]), torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="loss='hinge'"):
        evoke_loss(t([[0.0, 1.0]]), t([[0.0, 1.0]]), form="hinge")

