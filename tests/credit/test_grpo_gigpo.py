"""GRPO (spec credit §2, T2.1-T2.4) and GiGPO (spec credit §3, T3.1-T3.5, X1, X10, X12, X13)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import credit_plugins as cp
from credit_plugins.oracles import oracle_values

from tests.helpers.strategies import columns, step_batches

grpo, gigpo = cp.get("grpo"), cp.get("gigpo")


def table(rows):
    return cp.StepTable(**columns(rows))


def one_step_group(rewards, group="g"):
    n = len(rewards)
    return cp.StepTable(group=[group] * n, traj=list(range(n)), t=[0] * n, state=["s"] * n, reward=rewards)


# ---- GRPO ------------------------------------------------------------------------------------------------------
def test_grpo_hand_computed():
    # R = [1, 0, 0]: mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3)
    adv = grpo(one_step_group([1.0, 0.0, 0.0]))
    std = math.sqrt(1 / 3)
    assert adv.tolist() == pytest.approx([(2 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6)])
    assert grpo(one_step_group([1.0, 0.0, 0.0]), norm_std=False).tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3])


@pytest.mark.parametrize("norm_std", [True, False])
def test_grpo_all_equal_rewards_give_zero(norm_std):  # T2.1
    assert torch.all(grpo(one_step_group([3.0, 3.0, 3.0, 3.0]), norm_std=norm_std) == 0)


@settings(max_examples=80, deadline=None)
@given(step_batches(), st.sampled_from(["trajectories", "steps"]), st.booleans())
def test_grpo_sums_to_zero_per_group(rows, stats, norm_std):  # T2.2
    steps = table(rows)
    adv = grpo(steps, episode_stats=stats, norm_std=norm_std).double()[steps.order]
    if stats == "trajectories":
        per_traj = adv[steps.first_row]
        sums = torch.zeros(steps.n_groups, dtype=torch.float64).index_add_(0, steps.traj_group, per_traj)
        sizes = torch.bincount(steps.traj_group)
    else:
        sums = torch.zeros(steps.n_groups, dtype=torch.float64).index_add_(0, steps.row_group, adv)
        sizes = torch.bincount(steps.row_group)
    assert torch.allclose(sums[sizes > 1], torch.zeros_like(sums[sizes > 1]), atol=1e-4)


@given(st.lists(st.floats(-5, 5), min_size=2, max_size=8), st.floats(0.1, 10), st.floats(-3, 3))
@settings(max_examples=60, deadline=None)
def test_grpo_std_is_invariant_to_positive_affine_rewards(rewards, scale, shift):  # T2.3, X13
    base = grpo(one_step_group(rewards), eps=1e-12)
    moved = grpo(one_step_group([scale * r + shift for r in rewards]), eps=1e-12)
    spread = np.std(rewards)
    if spread > 1e-2:  # rewards are stored as float32: at a spread of 1e-3 and scale 0.1 storage moves z by ~1e-3
        assert torch.allclose(base, moved, atol=1e-3)


def test_grpo_singleton_group_keeps_raw_return():  # T2.4: verl's convention, mean 0 std 1
    assert grpo(one_step_group([4.0])).tolist() == pytest.approx([4.0 / (1 + 1e-6)])
    assert grpo(one_step_group([4.0]), norm_std=False).tolist() == [4.0]


def test_grpo_steps_mode_weighs_trajectories_by_length():
    # traj a: 2 steps, return 1; traj b: 1 step, return 0. Steps mode: samples [1, 1, 0], mean 2/3
    steps = cp.StepTable(group=[0, 0, 0], traj=["a", "a", "b"], t=[0, 1, 0], reward=[0.0, 1.0, 0.0])
    adv = grpo(steps, episode_stats="steps", norm_std=False)
    assert adv.tolist() == pytest.approx([1 / 3, 1 / 3, -2 / 3])
    adv = grpo(steps, episode_stats="trajectories", norm_std=False)
    assert adv.tolist() == pytest.approx([0.5, 0.5, -0.5])


# ---- GiGPO -----------------------------------------------------------------------------------------------------
def test_gigpo_hand_computed():
    # a: s -(0)-> x -(10)-> end, b: s -> y -> z -> end with 0 reward. gamma 0.95, steps-mode episode stats.
    # episode samples per row [10, 10, 0, 0, 0]: mean 4, std sqrt(30); A^E(a) = 6/sqrt(30), A^E(b) = -4/sqrt(30)
    # anchor s: R_t = [9.5 (a, t=0), 0 (b, t=0)], mean 4.75, std 4.75*sqrt(2); A^S = +-1/sqrt(2); x, y, z singletons
    steps = cp.StepTable(group=["g"] * 5, traj=["a", "a", "b", "b", "b"], t=[1, 0, 0, 1, 2],
                         state=["x", "s", "s", "y", "z"], reward=[10.0, 0.0, 0.0, 0.0, 0.0])
    e = 1e-6
    ae_a, ae_b = 6 / (math.sqrt(30) + e), -4 / (math.sqrt(30) + e)
    a_s = 4.75 / (4.75 * math.sqrt(2) + e)
    assert gigpo(steps).tolist() == pytest.approx([ae_a, ae_a + a_s, ae_b - a_s, ae_b, ae_b], rel=1e-6)
    # mean_norm: A^E = [6, -4], A^S = +-4.75
    assert gigpo(steps, norm_std=False).tolist() == pytest.approx([6, 10.75, -8.75, -4, -4], rel=1e-6)


@settings(max_examples=80, deadline=None)
@given(step_batches(), st.sampled_from(["trajectories", "steps"]), st.booleans())
def test_step_weight_zero_equals_grpo(rows, stats, norm_std):  # T3.1, X1
    steps = table(rows)
    a = gigpo(steps, step_weight=0.0, episode_stats=stats, norm_std=norm_std)
    b = grpo(steps, episode_stats=stats, norm_std=norm_std)
    assert torch.equal(a, b)


@settings(max_examples=80, deadline=None)
@given(step_batches(), st.floats(0.0, 1.0))
def test_step_term_sums_to_zero_over_each_anchor_group(rows, gamma):  # T3.2 (mean_norm)
    steps = table(rows)
    step = gigpo(steps, norm_std=False, gamma=gamma).double() - grpo(steps, norm_std=False, episode_stats="steps").double()
    anchor, n = steps.anchor
    sums = torch.zeros(n, dtype=torch.float64).index_add_(0, anchor, step[steps.order])
    assert torch.allclose(sums, torch.zeros_like(sums), atol=1e-4)


def test_singleton_anchors_get_zero_step_term():  # T3.3, X10
    steps = cp.StepTable(group=[0, 0, 0], traj=[0, 0, 1], t=[0, 1, 0], state=["s", "u", "s"], reward=[0, 10, 0])
    step = gigpo(steps) - grpo(steps, episode_stats="steps")
    assert step[1] == 0  # "u" is visited once
    assert step[0] != 0 and step[2] != 0


@settings(max_examples=60, deadline=None)
@given(step_batches())
def test_all_distinct_anchors_equal_grpo(rows):  # T3.4
    for i, r in enumerate(rows):
        r["state"] = f"unique{i}"
    steps = table(rows)
    assert torch.equal(gigpo(steps), grpo(steps, episode_stats="steps"))


def test_gamma_one_with_terminal_reward_gives_episode_return_at_every_step():  # T3.5
    steps = cp.StepTable(group=[0] * 5, traj=[0, 0, 0, 1, 1], t=[0, 1, 2, 0, 1], state=list("abcab"),
                         reward=[0, 0, 10, 0, 0])
    assert steps.reward_to_go(1.0).tolist() == [10, 10, 10, 0, 0]


def test_revisits_inside_one_trajectory_are_separate_members():
    # traj 0 visits s at t=0 and t=2 (R_t = 0.9^2*1, 1), traj 1 visits s once (0): anchor group of 3 members
    steps = cp.StepTable(group=[0] * 4, traj=[0, 0, 0, 1], t=[0, 1, 2, 0], state=["s", "u", "s", "s"],
                         reward=[0, 0, 1, 0])
    step = (gigpo(steps, gamma=0.9, norm_std=False) - grpo(steps, norm_std=False, episode_stats="steps")).tolist()
    mean = (0.81 + 1 + 0) / 3
    assert step == pytest.approx([0.81 - mean, 0.0, 1 - mean, -mean], abs=1e-6)


@settings(max_examples=100, deadline=None)
@given(step_batches(), st.floats(0.0, 1.0), st.floats(0.0, 2.0), st.booleans(),
       st.sampled_from(["trajectories", "steps"]))
def test_gigpo_matches_per_row_reference(rows, gamma, w, norm_std, stats):
    # the loop references of credit_plugins.oracles.gigpo (random parameters: tests/credit/test_oracles_flat.py)
    params = dict(gamma=gamma, step_weight=w, norm_std=norm_std, episode_stats=stats)
    got, want = gigpo(table(rows), **params), oracle_values(gigpo, table(rows), **params)
    assert got.dtype == torch.float32 and got.shape == (len(rows),)
    assert np.allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
    got = grpo(table(rows), norm_std=norm_std, episode_stats=stats)
    want = oracle_values(grpo, table(rows), norm_std=norm_std, episode_stats=stats)
    assert np.allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(step_batches(), st.randoms(use_true_random=False))
def test_row_permutation_equivariance(rows, rnd):  # X12
    perm = list(range(len(rows)))
    rnd.shuffle(perm)
    a = gigpo(table(rows))
    b = gigpo(table([rows[i] for i in perm]))
    assert torch.allclose(a[perm], b, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(step_batches())
def test_invariant_to_relabelling_keys(rows):
    relabel = [dict(r, state="S" + r["state"][::-1], traj=f"T{r['traj']}x", group=f"G{r['group']}")
               for r in rows]
    assert torch.allclose(gigpo(table(rows)), gigpo(table(relabel)), atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(step_batches(max_groups=3))
def test_group_locality(rows):  # X11: adding another group leaves this group's advantages unchanged
    other = [dict(r, group="other", traj="o" + r["traj"]) for r in rows]
    alone = gigpo(table(rows))
    together = gigpo(table(rows + other))[: len(rows)]
    assert torch.allclose(alone, together, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(step_batches(), st.floats(0.1, 100.0))
def test_std_mode_invariant_to_positive_reward_scaling(rows, scale):  # X13
    scaled = [dict(r, reward=r["reward"] * scale) for r in rows]
    # eps scales with the rewards, so the invariance is exact in real arithmetic: a group of equal returns whose float
    # mean lands an ulp off gets z ~ ulp / (std ~ ulp + eps), which a fixed tiny eps leaves at 1e-3..1e-1 on one side
    a, b = gigpo(table(rows), eps=1e-8), gigpo(table(scaled), eps=1e-8 * scale)
    # a group with a single step row keeps its raw return (verl's singleton convention, T2.4): it scales
    sizes = {g: sum(r["group"] == g for r in rows) for g in {r["group"] for r in rows}}
    shared = torch.tensor([sizes[r["group"]] > 1 for r in rows])
    assert torch.allclose(a[shared], b[shared], rtol=1e-3, atol=1e-3)
    assert torch.allclose(a[~shared] * scale, b[~shared], rtol=1e-3, atol=1e-3)


@settings(max_examples=60, deadline=None)
@given(step_batches())
def test_output_is_finite_and_deterministic(rows):
    steps = table(rows)
    a, b = gigpo(steps), gigpo(table(rows))
    assert torch.isfinite(a).all() and torch.equal(a, b)


def test_all_fail_group_has_no_step_signal():
    steps = cp.StepTable(group=[0] * 4, traj=[0, 0, 1, 1], t=[0, 1, 0, 1], state=list("abab"), reward=[0] * 4)
    assert torch.all(gigpo(steps) == 0)


@pytest.mark.parametrize("params, match", [
    (dict(gamma=1.5), r"gamma=1.5"), (dict(eps=0.0), r"eps=0.0"), (dict(episode_stats="rows"), r"episode_stats"),
    (dict(step_wieght=1.0), r"unknown parameter\(s\) \['step_wieght'\].*valid parameters are"),
])
def test_bad_parameters_raise_value_error_naming_them(params, match):
    with pytest.raises(ValueError, match=match):
        gigpo(one_step_group([1.0, 0.0]), **params)


def test_gigpo_without_state_names_the_field():
    steps = cp.StepTable(group=[0, 0], traj=[0, 1], t=[0, 0], reward=[1.0, 0.0])
    with pytest.raises(ValueError, match=r"estimator 'gigpo' needs StepTable field\(s\) \['state'\]"):
        gigpo(steps)
