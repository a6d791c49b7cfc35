"""AdviSD's pure core (distill_plugins.advisd): advice influence, decision selection, the selective
self-distillation loss: hand-computed cases, invariants, fuzzing, hostile inputs, and a synthetic task where only
some turns' advice changes the executor's action (magnitude selection vs matched-count random selection)."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from distill_plugins.advisd import (AdviSDParams, advice_influence, advice_text, advisd_loss, feedback_text,
                                    flatten_parts, select_across, select_count, select_decisions)


def t(x, dtype=torch.float64):
    return torch.tensor(x, dtype=dtype)


# ---- advice_influence -------------------------------------------------------------------------------------------
def test_influence_hand_computed_mean_and_sum():
    with_ = t([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5], [-3.0, 0.0, 0.0]])
    without = t([[-2.0, -1.0, 99.0], [-1.5, -2.5, -0.5], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    # row 0: (+1 - 1)/2 = 0 (the padded third token is never read); row 1: (1 + 2 + 0)/3 = 1; row 2: |-2|
    assert advice_influence(with_, without, mask).tolist() == pytest.approx([0.0, 1.0, 2.0])
    assert advice_influence(with_, without, mask, reduce="sum").tolist() == pytest.approx([0.0, 3.0, 2.0])


def test_influence_is_a_magnitude_and_detached():
    a = t([[-1.0, -1.0]]).requires_grad_()
    b = t([[-3.0, -3.0]])
    m = torch.ones(1, 2)
    assert float(advice_influence(a, b, m)) == pytest.approx(2.0)
    assert float(advice_influence(b, a, m)) == pytest.approx(2.0)  # the sign of the change does not matter
    assert not advice_influence(a, b, m).requires_grad
    # a decision without a response token: influence 0
    assert advice_influence(a, b, torch.zeros(1, 2)).tolist() == [0.0]


def test_influence_refuses_bad_input():
    m = torch.ones(2, 3)
    with pytest.raises(ValueError, match="must all be"):
        advice_influence(torch.zeros(2, 3), torch.zeros(2, 4), m)
    with pytest.raises(ValueError, match="must all be"):
        advice_influence(torch.zeros(6), torch.zeros(6), torch.ones(6))
    bad = torch.zeros(2, 3)
    bad[1, 2] = math.nan
    with pytest.raises(ValueError, match="NaN/inf"):
        advice_influence(bad, torch.zeros(2, 3), m)
    m2 = m.clone()
    m2[1, 2] = 0  # the NaN is padding: fine
    assert advice_influence(bad, torch.zeros(2, 3), m2).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="reduce"):
        advice_influence(torch.zeros(2, 3), torch.zeros(2, 3), m, reduce="max")
    with pytest.raises(ValueError, match="logp_with must be a torch.Tensor"):
        advice_influence([[0.0]], torch.zeros(1, 1), torch.ones(1, 1))


# ---- select_decisions ---------------------------------------------------------------------------------------------
def test_select_count_is_ceil_of_fraction():
    assert [select_count(n, 0.25) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert select_count(7, 1.0) == 7 and select_count(3, 1e-12) == 1


def test_magnitude_takes_the_largest_magnitudes_ties_to_the_earlier():
    x = t([0.1, 3.0, 0.5, 3.0, 2.0, 0.0])
    assert select_decisions(x, count=2).tolist() == [False, True, False, True, False, False]
    # three-way pick: 3.0, 3.0, then 2.0
    assert torch.nonzero(select_decisions(x, fraction=0.5)).flatten().tolist() == [1, 3, 4]
    # a tie at the boundary goes to the earlier index
    y = t([1.0, 2.0, 1.0, 1.0])
    assert torch.nonzero(select_decisions(y, count=2)).flatten().tolist() == [0, 1]
    # negative values rank by magnitude
    assert torch.nonzero(select_decisions(t([-5.0, 1.0, 2.0]), count=1)).flatten().tolist() == [0]


def test_valid_mask_restricts_the_pool_and_the_count():
    x = t([9.0, 1.0, 2.0, 3.0, 0.5])
    valid = torch.tensor([False, True, True, True, True])
    sel = select_decisions(x, fraction=0.5, valid=valid)  # ceil(0.5 * 4) = 2 of the 4 valid ones
    assert torch.nonzero(sel).flatten().tolist() == [2, 3]
    r = select_decisions(x, fraction=0.5, valid=valid, mode="random", generator=torch.Generator().manual_seed(1))
    assert int(r.sum()) == 2 and not bool(r[0])


def test_random_mode_matches_the_count_and_is_seeded():
    x = torch.arange(20, dtype=torch.float64)
    for frac in (0.05, 0.25, 0.5, 1.0):
        k = select_count(20, frac)
        mag = select_decisions(x, fraction=frac)
        draws = [select_decisions(x, fraction=frac, mode="random", generator=torch.Generator().manual_seed(s))
                 for s in range(5)]
        assert int(mag.sum()) == k and all(int(d.sum()) == k for d in draws)
    a = select_decisions(x, fraction=0.25, mode="random", generator=torch.Generator().manual_seed(7))
    b = select_decisions(x, fraction=0.25, mode="random", generator=torch.Generator().manual_seed(7))
    c = select_decisions(x, fraction=0.25, mode="random", generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    # random mode does not read the values: NaN influence is fine there, not in magnitude mode
    nan = torch.full((4,), math.nan)
    assert int(select_decisions(nan, count=2, mode="random", generator=torch.Generator().manual_seed(0)).sum()) == 2
    with pytest.raises(ValueError, match="NaN/inf"):
        select_decisions(nan, count=2)


@pytest.mark.parametrize("kwargs, match", [
    ({"fraction": 0.0}, r"fraction=0.0 must lie in \(0, 1\]"),
    ({"fraction": 1.5}, r"fraction=1.5 must lie in \(0, 1\]"),
    ({"fraction": math.nan}, r"must lie in \(0, 1\]"),
    ({"fraction": "half"}, "fraction must be a number"),
    ({}, "exactly one of fraction"),
    ({"fraction": 0.5, "count": 1}, "exactly one of fraction"),
    ({"count": 9}, r"count=9 must be an int in \[0, 4\]"),
    ({"count": -1}, r"count=-1 must be an int"),
    ({"count": 1.0}, "must be an int"),
    ({"fraction": 0.5, "mode": "top"}, "mode='top'; choose one of"),
])
def test_select_refuses_hostile_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        select_decisions(t([1.0, 2.0, 3.0, 4.0]), **kwargs)


def test_select_refuses_bad_shapes():
    with pytest.raises(ValueError, match="1-D"):
        select_decisions(torch.zeros(2, 3), fraction=0.5)
    with pytest.raises(ValueError, match="valid"):
        select_decisions(torch.zeros(3), fraction=0.5, valid=torch.ones(4, dtype=torch.bool))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-50, 50, allow_nan=False), min_size=1, max_size=30), st.floats(0.01, 1.0),
       st.randoms(use_true_random=False))
def test_selection_is_permutation_invariant(values, fraction, rnd):
    x = t(values)
    perm = list(range(len(values)))
    rnd.shuffle(perm)
    p = torch.tensor(perm)
    sel = select_decisions(x, fraction=fraction)
    sel_p = select_decisions(x[p], fraction=fraction)
    # the multiset of selected magnitudes never depends on the order (ties may pick other indices of equal value)
    assert sorted(x[sel].abs().tolist()) == sorted(x[p][sel_p].abs().tolist())
    assert int(sel.sum()) == int(sel_p.sum()) == select_count(len(values), fraction)
    # with distinct magnitudes the selected set is equivariant: the same decisions, permuted
    if len(set(abs(v) for v in values)) == len(values):
        assert torch.equal(sel[p], sel_p)
    # and every selected magnitude is >= every unselected one
    if bool((~sel).any()):
        assert float(x[sel].abs().min()) >= float(x[~sel].abs().max())


def test_selection_across_processes_hand_computed():
    """Two processes, 3 + 2 decisions of which 4 are valid. Fraction 0.6: k = ceil(0.6 * 4) = 3 over the round,
    the three largest valid magnitudes 5, -4 and 2 across both processes; the invalid 9 never counts. Fraction 0.5:
    k = ceil(0.5 * 4) = 2 (counting all 5 would give 3), both on process 0, none on process 1 although it holds a
    local top (2)."""
    parts = [([5.0, 0.1, -4.0], [True, True, True]), ([2.0, 9.0], [True, False])]
    assert [m.tolist() for m in select_across(parts, 0.6)] == [[True, False, True], [True, False]]
    assert [m.tolist() for m in select_across(parts, 0.5)] == [[True, False, True], [False, False]]
    # ties go to the lower rank: equal magnitudes on both processes, k = 1
    assert [m.tolist() for m in select_across([([1.0], [True]), ([-1.0], [True])], 0.5)] == [[True], [False]]
    # a process without decisions still gets its (empty) share
    assert [m.tolist() for m in select_across([([], []), ([3.0], [True])], 1.0)] == [[], [True]]
    with pytest.raises(ValueError, match="same length"):
        select_across([([1.0, 2.0], [True])], 0.5)


def test_flatten_parts_concatenates_in_rank_order():
    """The round table the mixin logs from: rank order, float64 influence, bool valid, one size per process (an
    empty process keeps its 0); unequal lists are refused."""
    influence, valid, sizes = flatten_parts([([1, -2.5], [1, 0]), ([], []), ([4.0], [True])])
    assert influence.dtype == torch.float64 and influence.tolist() == [1.0, -2.5, 4.0]
    assert valid.dtype == torch.bool and valid.tolist() == [True, False, True]
    assert sizes == [2, 0, 1]
    with pytest.raises(ValueError, match="same length"):
        flatten_parts([([1.0], [True, False])])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(st.floats(-9, 9, allow_nan=False), st.booleans()), max_size=8), min_size=1,
                max_size=4), st.floats(0.01, 1.0), st.sampled_from(["magnitude", "random"]), st.integers(0, 99))
def test_selection_across_processes_is_the_global_selection_sliced(procs, fraction, mode, seed):
    """Every process computing the shares from the all-gathered parts (the random mode from the same seed) yields
    exactly the single-process selection over the whole round: k counts every process's valid decisions."""
    parts = [([x for x, _ in p], [v for _, v in p]) for p in procs]
    shares = select_across(parts, fraction, mode=mode, generator=torch.Generator().manual_seed(seed))
    assert [len(m) for m in shares] == [len(p) for p in procs]
    flat_x = t([x for p in procs for x, _ in p])
    flat_v = torch.tensor([v for p in procs for _, v in p], dtype=torch.bool)
    whole = select_decisions(flat_x, fraction=fraction, mode=mode, generator=torch.Generator().manual_seed(seed),
                             valid=flat_v)
    assert torch.equal(torch.cat(shares), whole)
    assert int(whole.sum()) == select_count(int(flat_v.sum()), fraction)
    assert not bool((whole & ~flat_v).any())


# ---- advisd_loss --------------------------------------------------------------------------------------------------
def test_loss_hand_computed_reverse_kl_over_selected_tokens():
    # student [ln 3, 0] -> p = [3/4, 1/4]; teacher [0, 0] -> q = [1/2, 1/2]
    kl = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    s = t([[[math.log(3), 0.0], [0.0, 0.0]], [[5.0, -5.0], [0.0, 0.0]]])
    q = t([[[0.0, 0.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]]])
    mask = torch.tensor([[1, 1], [1, 0]])
    # only decision 0 selected: its two tokens, KL kl and 0 -> mean kl / 2
    assert float(advisd_loss(s, q, mask, torch.tensor([True, False]))) == pytest.approx(kl / 2)
    # both selected: decision 1's masked second token is not counted (3 tokens)
    p1 = torch.softmax(t([5.0, -5.0]), 0)
    kl1 = float((p1 * (p1.log() - math.log(0.5))).sum())
    assert float(advisd_loss(s, q, mask, torch.tensor([True, True]))) == pytest.approx((kl + kl1) / 3)


def test_loss_zero_without_selection_and_when_teacher_equals_student():
    s = torch.randn(3, 4, 7, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(3, 4)
    none = advisd_loss(s, torch.randn(3, 4, 7, dtype=torch.float64), mask, torch.zeros(3, dtype=torch.bool))
    assert float(none.detach()) == 0.0 and none.requires_grad
    same = advisd_loss(s, s.detach().clone(), mask, torch.ones(3, dtype=torch.bool))
    assert float(same) == pytest.approx(0.0, abs=1e-12)
    same.backward()
    assert float(s.grad.abs().max()) < 1e-10


def test_gradient_only_through_selected_tokens_and_never_the_teacher():
    s = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
    q = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    sel = torch.tensor([True, False, True, False])
    advisd_loss(s, q, mask, sel).backward()
    assert q.grad is None
    nonzero = s.grad.abs().sum(-1) > 0
    assert torch.equal(nonzero, mask.bool() & sel.unsqueeze(1))


def test_loss_refuses_bad_shapes():
    s = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="selected"):
        advisd_loss(s, s, torch.ones(2, 3), torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask"):
        advisd_loss(s, s, torch.ones(2, 4), torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\[decisions, advice tokens, vocab\]"):
        advisd_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="vocabular"):
        advisd_loss(s, torch.zeros(2, 3, 5), torch.ones(2, 3), torch.ones(2, dtype=torch.bool))


# ---- the parameters and the feedback template ---------------------------------------------------------------------
def test_params_and_feedback_template():
    assert feedback_text("{outcome} {ret:.1f} {turns} {t} {action} {reward:.1f}", success=False, ret=-1.0, turns=3,
                         t=1, action=None, reward=0.5) == "failed -1.0 3 1 an invalid answer 0.5"
    assert "succeeded" in feedback_text(AdviSDParams().feedback, success=True, ret=1, turns=2, t=0, action="up",
                                        reward=1)
    with pytest.raises(ValueError, match=r"feedback uses the field\(s\) \['score'\]"):
        AdviSDParams(feedback="{score}")
    with pytest.raises(ValueError, match="positional"):
        AdviSDParams(feedback="{}")
    with pytest.raises(ValueError, match="not a format string"):
        AdviSDParams(feedback="{outcome")
    with pytest.raises(ValueError, match="does not format"):
        AdviSDParams(feedback="{turns:.2s}")
    with pytest.raises(ValueError, match="fraction"):
        AdviSDParams(fraction=0.0)
    with pytest.raises(ValueError, match="mode"):
        AdviSDParams(mode="top")
    assert advice_text(AdviSDParams().advice_format, "go {left}") == "\nAdvice: go {left}"
    for bad in ("no field", "{advice} and {advice}"):
        with pytest.raises(ValueError, match=r"advice_format=.* must hold \{advice\} exactly once"):
            AdviSDParams(advice_format=bad)


def test_registry_record_and_recipe_block():
    from agentcredit.recipe import RecipeError, check_terms
    from credit_plugins import registry
    from distill_plugins.terms.advisd import SPEC

    assert registry.get("advisd", kind="terms") is SPEC and SPEC.bridges == ("trl",)
    assert "influence_i" in SPEC.describe() and "executor" in SPEC.describe()
    assert check_terms({"advisd": None}) == {"advisd": {}}
    assert SPEC.make_params(fraction=1.0, mode="random").mode == "random"
    with pytest.raises(RecipeError, match=r"agentcredit.terms.advisd: .*fraction"):
        check_terms({"advisd": {"fraction": 0}})
    with pytest.raises(RecipeError, match=r"agentcredit.terms.advisd: .*mode"):
        check_terms({"advisd": {"mode": "top"}})
    with pytest.raises(RecipeError, match=r"agentcredit.terms.advisd: .*feedback"):
        check_terms({"advisd": {"feedback": "{score}"}})


# ---- a task where advice can change the executor's action ------------------------------------------------------------
def _advice_task(n_turns=40, n_pivotal=10, n_actions=5, seed=0):
    """Per turn: the executor's default policy softmax(base) (peaked on a default action) and one piece of advice (an
    action). On the pivotal turns the advice names another action and the executor follows it (the advice changed
    the action); on the others the advice repeats the default and the executor plays the default (no change). The
    advisor's own model of the executor scores the recorded response with the advice (its logit +2) and without.
    Returns logp_with, logp_without (``[N, 2]``: the action token and a stop token both score alike), mask, pivotal."""
    g = torch.Generator().manual_seed(seed)
    pivotal = torch.zeros(n_turns, dtype=torch.bool)
    pivotal[torch.randperm(n_turns, generator=g)[:n_pivotal]] = True
    lw, lo = torch.zeros(n_turns, 2, dtype=torch.float64), torch.zeros(n_turns, 2, dtype=torch.float64)
    for i in range(n_turns):
        default = int(torch.randint(n_actions, (1,), generator=g))
        base = 0.3 * torch.randn(n_actions, generator=g, dtype=torch.float64)
        base[default] += 3.0
        advice = default
        if pivotal[i]:
            advice = (default + 1 + int(torch.randint(n_actions - 1, (1,), generator=g))) % n_actions
        response = advice  # pivotal: follows the advice; else: the default (= the advice)
        shift = torch.zeros(n_actions, dtype=torch.float64)
        shift[advice] = 2.0
        lw[i, 0] = torch.log_softmax(base + shift, 0)[response]
        lo[i, 0] = torch.log_softmax(base, 0)[response]
        lw[i, 1] = lo[i, 1] = -0.01  # the stop token: advice does not change it
    return lw, lo, torch.ones(n_turns, 2), pivotal


def test_magnitude_selection_catches_the_turns_where_advice_changed_the_action():
    recall_mag, recall_rand = [], []
    for seed in range(5):
        lw, lo, mask, pivotal = _advice_task(seed=seed)
        infl = advice_influence(lw, lo, mask)
        k = int(pivotal.sum())
        mag = select_decisions(infl, fraction=k / len(infl))
        assert int(mag.sum()) == k
        recall_mag.append(float((mag & pivotal).sum()) / k)
        for s in range(40):
            r = select_decisions(infl, fraction=k / len(infl), mode="random",
                                 generator=torch.Generator().manual_seed(1000 * seed + s))
            assert int(r.sum()) == k
            recall_rand.append(float((r & pivotal).sum()) / k)
    assert min(recall_mag) == 1.0  # every turn whose action the advice changed is supervised
    mean_rand = sum(recall_rand) / len(recall_rand)
    assert abs(mean_rand - 0.25) < 0.05  # matched-count random: about k/n of them in expectation
    assert mean_rand < 0.5 < min(recall_mag)
