"""MVPO (spec credit §6: T6.1-T6.7, X4, X10), its cross-batch state, the stateful-Estimator API, and agreement with
the loop reference ``credit_plugins.oracles.mvpo`` (one batch and a multi-batch run)."""

import math
import pickle
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import credit_plugins as cp
from credit_plugins.estimator import BoundEstimator
from credit_plugins.segments import segment_mean_std
from credit_plugins.estimators.mvpo import (MVPO, W0, MVPOParams, amp_update, amp_utilities, depth_bin,
                                            initial_state, kappa_schedule, mvpo_terms, viability_regions)
from credit_plugins.oracles import ORACLES, oracle_values
from credit_plugins.oracles.mvpo import (mvpo_reference, mvpo_reference_batch, mvpo_reference_run,
                                         reference_initial_state, reference_regions)

from tests.helpers.strategies import step_batches

mvpo_est, gigpo = cp.get("mvpo"), cp.get("gigpo")
EPS = 1e-6
SETTINGS = settings(max_examples=50, deadline=None)


# ---- building batches --------------------------------------------------------------------------------------------
def table(rows, milestones=True, loop=True):
    ex = {"signature": [r["signature"] for r in rows]}
    if milestones and rows and rows[0].get("milestones") is not None:
        ex["milestones"] = [r["milestones"] for r in rows]
    if loop and rows and "loop_flag" in rows[0]:
        ex["loop_flag"] = [int(r["loop_flag"]) for r in rows]
    cols = {k: [r[k] for r in rows] for k in ("group", "traj", "t", "state", "reward")}
    if rows and "success" in rows[0]:
        cols["success"] = [r["success"] for r in rows]
    return cp.StepTable(**cols, extras=ex)


@st.composite
def mvpo_batches(draw, max_groups=4, max_rollouts=5, max_len=7):
    """step_batches (revisits, cycles, singleton groups, all-fail groups) plus signatures, milestones, loop flags;
    some groups are forced all-success."""
    rows = draw(step_batches(max_groups=max_groups, max_rollouts=max_rollouts, max_len=max_len))
    n_sig = draw(st.integers(1, 5))  # few signatures: collisions, regions spanning states, cycle merges
    use_depth = draw(st.booleans())
    with_ms = draw(st.booleans())
    groups = sorted({r["group"] for r in rows})
    all_success = set(draw(st.lists(st.sampled_from(groups), max_size=2)))
    rnd = random.Random(draw(st.integers(0, 2**31)))
    last_t = {}
    for r in rows:
        last_t[r["traj"]] = max(last_t.get(r["traj"], -1), r["t"])
    for r in rows:
        s = int(r["state"].split("s")[-1])
        r["signature"] = f"z{s % n_sig}" + (f"|d{depth_bin(r['t'])}" if use_depth else "")
        r["milestones"] = [int(rnd.random() < 0.3) for _ in range(5)] if with_ms else None
        r["loop_flag"] = int(rnd.random() < 0.2)
        if r["group"] in all_success:
            r["success"] = True
            r["reward"] = 10.0 if r["t"] == last_t[r["traj"]] else 0.0
    return rows


def hand_rows(spec, group="g"):
    """rows from {traj: [(state, signature, milestones, loop_flag), ...]} with reward 10 at the end of successes"""
    rows = []
    for traj, (success, steps) in spec.items():
        for t, (state, sig, ms, loop) in enumerate(steps):
            rows.append(dict(group=group, traj=traj, t=t, state=state, signature=sig, milestones=ms, loop_flag=loop,
                             reward=10.0 if success and t == len(steps) - 1 else 0.0, success=success))
    return rows


Z5 = [0, 0, 0, 0, 0]


def run_reference(rows, **params):
    """the loop reference on one batch from the initial state, in the rows' input order (float64)"""
    steps = table(rows)
    return steps.to_input_order(mvpo_reference(steps, MVPOParams(**params)))


# ---- T6.1 / X4 ---------------------------------------------------------------------------------------------------
@SETTINGS
@given(mvpo_batches(), st.sampled_from(["steps", "trajectories"]), st.sampled_from([0.5, 1.0]))
def test_kappa_zero_equals_gigpo(rows, stats, omega):  # T6.1, X4
    steps = table(rows)
    ours = MVPO(kappa=0.0, step_weight=omega, episode_stats=stats)(steps)
    ref = gigpo(steps, step_weight=omega, gamma=0.95, norm_std=True, episode_stats=stats)
    assert torch.allclose(ours, ref, rtol=0, atol=1e-6)
    # bit for bit except in multi-member constant anchor groups, where GiGPO returns its rounding noise (~1e-11)
    terms, _ = mvpo_terms(steps, MVPOParams(kappa=0.0), initial_state(MVPOParams()))
    exact = steps.to_input_order(~terms.route_potential)
    assert torch.equal(ours[exact], ref[exact])


def test_kappa_zero_equals_gigpo_on_a_zero_credit_batch():
    rows = hand_rows({"a": (False, [("s0", "X", Z5, 0), ("s1", "Y", Z5, 0)]),
                      "b": (False, [("s0", "X", Z5, 0), ("s2", "Z", Z5, 0)])})
    steps = table(rows)
    assert torch.equal(MVPO(kappa=0.0)(steps), gigpo(steps, step_weight=0.5))


# ---- T6.2, T6.3, X10 ---------------------------------------------------------------------------------------------
@SETTINGS
@given(mvpo_batches())
def test_informative_anchors_route_to_the_anchor_advantage(rows):  # T6.2
    steps = table(rows)
    p = MVPOParams()
    terms, _ = mvpo_terms(steps, p, initial_state(p))
    anchor, n_anchor = steps.anchor
    g = steps.reward_to_go(p.gamma)
    _, std, count = segment_mean_std(g, anchor, n_anchor)
    informative = (count[anchor] > 1) & (std[anchor] > p.eps_route)
    assert torch.equal(informative, terms.route_anchor)
    assert torch.equal(terms.a_route[informative], terms.a_anchor[informative])
    assert torch.equal(terms.advantage[informative], terms.a_epi[informative] + 0.5 * terms.a_anchor[informative])


@SETTINGS
@given(mvpo_batches())
def test_singleton_anchors_get_no_step_credit(rows):  # T6.3, X10
    steps = table(rows)
    out = MVPO()(steps)
    anchor, n_anchor = steps.anchor
    single = steps.to_input_order(torch.bincount(anchor, minlength=n_anchor)[anchor] == 1)
    episode = cp.get("grpo")(steps, episode_stats="steps")
    assert torch.equal(out[single], episode[single])


# ---- T6.4: kappa schedule ----------------------------------------------------------------------------------------
def test_kappa_schedule_is_one_until_success_improves_and_floors_at_kappa_min():  # T6.4
    for s in (0.0, 0.1, 0.3):
        assert kappa_schedule(s, 0.3, 0.05, EPS) == 1.0
    ks = [kappa_schedule(s, 0.3, 0.05, EPS) for s in (0.3, 0.4, 0.6, 0.8, 0.95, 1.0)]
    assert all(a >= b for a, b in zip(ks, ks[1:])) and ks[-1] == 0.05
    assert kappa_schedule(1.0, 1.0, 0.05, EPS) == 1.0  # s_0 = 1: nothing left to improve, g = 0
    # (0.6 - 0.3) / (0.7 + 1e-6) = 0.428571...; kappa = 0.571429
    assert kappa_schedule(0.6, 0.3, 0.05, EPS) == pytest.approx(1 - 0.3 / (0.7 + 1e-6), abs=1e-12)


def success_batch(n_success, n_traj=4, group="g"):
    spec = {f"{group}t{i}": (i < n_success, [("s0", "X", Z5, 0), (f"s{i + 1}", "Y", Z5, 0)]) for i in range(n_traj)}
    return table(hand_rows(spec, group=group))


def test_kappa_follows_the_success_ema_hand_computed():  # T6.4
    est = MVPO()
    kappas = []
    for n_success in (1, 2, 4):  # batch success rates 0.25, 0.5, 1.0
        est(success_batch(n_success))
        kappas.append(est.state_dict()["kappa"])
    # batch 1: sbar = s_0 = 0.25 -> kappa 1
    # batch 2: sbar = 0.95 * 0.25 + 0.05 * 0.5 = 0.2625; g = 0.0125 / 0.750001; kappa = 1 - g = 0.98333336
    # batch 3: sbar = 0.95 * 0.2625 + 0.05 * 1.0 = 0.299375; g = 0.049375 / 0.750001; kappa = 0.93416675
    assert kappas == pytest.approx([1.0, 1 - 0.0125 / 0.750001, 1 - 0.049375 / 0.750001], abs=1e-12)
    assert est.state_dict()["success_init"] == 0.25
    assert est.state_dict()["success_ema"] == pytest.approx(0.299375, abs=1e-15)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=2, max_size=12), st.sampled_from([0.05, 0.01]))
def test_kappa_is_non_increasing_while_success_improves(increments, kappa_min):  # T6.4
    est = MVPO(kappa_min=kappa_min, alpha_kappa=0.5)
    n_success, kappas = 0, []
    for inc in increments:
        n_success = min(8, n_success + inc)
        est(success_batch(n_success, n_traj=8))
        kappas.append(est.state_dict()["kappa"])
    assert kappas[0] == 1.0
    assert all(a >= b - 1e-15 for a, b in zip(kappas, kappas[1:]))
    assert all(kappa_min <= k <= 1.0 for k in kappas)


def test_kappa_stays_one_while_success_does_not_exceed_the_first_batch():  # T6.4
    est = MVPO()
    for n_success in (3, 2, 3, 0, 1):
        est(success_batch(n_success))
        assert est.state_dict()["kappa"] == 1.0


def test_fixed_kappa_is_used_while_the_state_advances():
    est = MVPO(kappa=0.3)
    est(success_batch(1))
    est(success_batch(4))
    s = est.state_dict()
    assert s["kappa"] == 0.3 and s["batches"] == 2 and s["success_ema"] == pytest.approx(0.95 * 0.25 + 0.05)


# ---- T6.5: regions -----------------------------------------------------------------------------------------------
def partition(steps, region):
    """the regions as a set of frozensets of (traj key, t), independent of row order and label values"""
    out = {}
    for r, traj, t in zip(region.tolist(), steps.traj.tolist(), steps.t.tolist()):
        out.setdefault(r, set()).add((traj, t))
    return {frozenset(v) for v in out.values()}


def regions_of(steps):
    return viability_regions(steps.row_group, steps.row_traj, steps.extra("signature"))


def test_cycle_rule_merges_the_loop_hand_computed():  # T6.5
    rows = (hand_rows({"a": (False, [("s", "A", Z5, 0), ("s", "B", Z5, 0), ("s", "C", Z5, 0), ("s", "B", Z5, 0),
                                     ("s", "D", Z5, 0)]),
                       "b": (False, [("s", "A", Z5, 0), ("s", "C", Z5, 0), ("s", "E", Z5, 0)])})
            + hand_rows({"c": (False, [("s", "B", Z5, 0), ("s", "C", Z5, 0)])}, group="h"))
    steps = table(rows)
    region, n = regions_of(steps)
    # group g: B revisited at a1, a3 -> B and C (a2) merge; C also absorbs b1. Regions {A} {B,C} {D} {E};
    # group h keeps B and C apart (no revisit there, and regions never cross groups): 6 regions
    assert n == 6
    expected = [{("a", 0), ("b", 0)}, {("a", 1), ("a", 2), ("a", 3), ("b", 1)}, {("a", 4)}, {("b", 2)}, {("c", 0)},
                {("c", 1)}]
    assert partition(steps, region) == {frozenset((cp.stable_hash(tr), t) for tr, t in e) for e in expected}
    # overlapping loops chain: A B A C B -> A..A merges {A, B}, B..B merges {B, A, C}: one region
    steps = table(hand_rows({"a": (False, [("s", x, Z5, 0) for x in "ABACB"])}))
    assert regions_of(steps)[1] == 1
    # closure: a = X Y X merges {X, Y}; then b = X Z Y re-enters {X, Y}, so Z joins (one pass on raw signature
    # equality would leave Z apart)
    steps = table(hand_rows({"a": (False, [("s", x, Z5, 0) for x in "XYX"]),
                             "b": (False, [("s", x, Z5, 0) for x in "XZY"])}))
    assert regions_of(steps)[1] == 1
    rows = hand_rows({"a": (False, [("s", x, Z5, 0) for x in "XYX"]), "b": (False, [("s", x, Z5, 0) for x in "XZYW"])})
    assert regions_of(table(rows))[1] == 2  # W, visited once after leaving, stays apart


def sig_rows(spec, group="g"):
    """rows from {traj: signature sequence}; state = signature, no reward"""
    return [dict(group=group, traj=traj, t=t, state=f"s{sig}", signature=sig, reward=0.0)
            for traj, sigs in spec.items() for t, sig in enumerate(sigs)]


def test_cycle_rule_closure_reaches_trajectories_no_earlier_pass_touched():  # T6.5
    # A0 A1 A0 merges {A0, A1}; then A0 A2 A1 re-enters it (A2 joins), then A1 A3 A2 (A3 joins), then A2 A4 A3
    # (A4 joins): one region. Before the fix each pass rescanned only the previous pass's trajectories, so the last
    # one (no row in {A0, A1} when first scanned) was never looked at again: 2 regions, {A0..A3} and {A4}, and the
    # result was not idempotent (running it on its own regions gave 1).
    rows = sig_rows({"a": [0, 1, 0], "b": [0, 2, 1], "c": [1, 3, 2], "d": [2, 4, 3]})
    steps = table(rows)
    region, n = regions_of(steps)
    assert n == 1
    assert viability_regions(steps.row_group, steps.row_traj, region)[1] == 1
    assert len(set(reference_regions(steps))) == 1
    # the same chain with the trajectories in the reverse order, and with the chain's tail in a second group
    assert regions_of(table(sig_rows({"d": [2, 4, 3], "c": [1, 3, 2], "b": [0, 2, 1], "a": [0, 1, 0]})))[1] == 1
    rows = sig_rows({"a": [0, 1, 0], "b": [0, 2, 1], "c": [1, 3, 2]}) + sig_rows({"d": [2, 4, 3]}, group="h")
    assert regions_of(table(rows))[1] == 4  # g: {A0..A3}; h: A2, A4, A3 apart (regions never cross groups)


@st.composite
def cycle_batches(draw):
    """free signature sequences over a small alphabet: revisits, chains of trajectories re-entering merged regions"""
    rows = []
    for g in range(draw(st.integers(1, 3))):
        k = draw(st.integers(2, 6))
        for i in range(draw(st.integers(1, 6))):
            sigs = draw(st.lists(st.integers(0, k - 1), min_size=1, max_size=6))
            rows += [dict(group=f"g{g}", traj=f"g{g}t{i}", t=t, state=f"s{z}", signature=z, reward=0.0)
                     for t, z in enumerate(sigs)]
    return rows


@st.composite
def chain_batches(draw):
    """a loop, then trajectories that each enter a fresh signature between two recent ones (plus a little padding),
    in random order: chains of re-entries that the closure must follow pass after pass (the reproducer's shape;
    free sequences hit it in well under 1% of draws)"""
    rows = []
    for g in range(draw(st.integers(1, 2))):
        seqs, new = [[0, 1, 0]], 2
        for _ in range(draw(st.integers(1, 6))):
            a, b = draw(st.lists(st.integers(max(0, new - 3), new - 1), min_size=2, max_size=2, unique=True))
            seqs.append([a, new, b] + draw(st.lists(st.integers(0, new), max_size=2)))
            new += 1
        for i, k in enumerate(draw(st.permutations(range(len(seqs))))):
            rows += [dict(group=f"g{g}", traj=f"g{g}t{i}", t=t, state=f"s{z}", signature=z, reward=0.0)
                     for t, z in enumerate(seqs[k])]
    return rows


def row_partition(rows, steps, region):
    """the regions as a set of frozensets of (rows' 'name', t), independent of row order and region labels"""
    out = {}
    for r, row in zip(steps.to_input_order(torch.as_tensor(region)).tolist(), rows):
        out.setdefault(r, set()).add((row.get("name", row["traj"]), row["t"]))
    return {frozenset(v) for v in out.values()}


def reference_partition(rows, steps):
    roots = reference_regions(steps)
    ids = {}
    return row_partition(rows, steps, [ids.setdefault(c, len(ids)) for c in roots])


@settings(max_examples=200, deadline=None)
@given(st.one_of(cycle_batches(), chain_batches(), mvpo_batches()))
def test_regions_equal_the_loop_closure(rows):  # T6.5
    steps = table(rows)
    region, n = regions_of(steps)
    assert row_partition(rows, steps, region) == reference_partition(rows, steps)
    assert n == len(set(region.tolist())) and sorted(set(region.tolist())) == list(range(n))
    # closed: each region's visits form one contiguous run in each trajectory
    runs = {}
    for i, (r, tr) in enumerate(zip(region.tolist(), steps.row_traj.tolist())):
        if (tr, r) in runs:
            assert runs[(tr, r)] == i - 1, "a trajectory leaves a region and comes back"
        runs[(tr, r)] = i


@settings(max_examples=200, deadline=None)
@given(st.one_of(cycle_batches(), chain_batches(), mvpo_batches()), st.randoms(use_true_random=False))
def test_regions_are_idempotent_and_invariant_to_order_and_labels(rows, rnd):  # T6.5
    steps = table(rows)
    region, _ = regions_of(steps)
    base = row_partition(rows, steps, region)
    # idempotent: regions used as signatures give the same regions
    again, _ = viability_regions(steps.row_group, steps.row_traj, region)
    assert row_partition(rows, steps, again) == base
    # row order
    shuffled = list(rows)
    rnd.shuffle(shuffled)
    steps2 = table(shuffled)
    assert row_partition(shuffled, steps2, regions_of(steps2)[0]) == base
    # relabelled signatures (an injective map) and trajectories (a permutation of the names: sorted order changes)
    sigs = sorted({r["signature"] for r in rows}, key=str)
    new_sig = dict(zip(sigs, rnd.sample(range(10**6), len(sigs))))
    trajs = sorted({r["traj"] for r in rows})
    new_traj = dict(zip(trajs, rnd.sample(trajs, len(trajs))))
    relabelled = [dict(r, name=r["traj"], traj="T" + new_traj[r["traj"]], signature=new_sig[r["signature"]])
                  for r in rows]
    steps3 = table(relabelled)
    assert row_partition(relabelled, steps3, regions_of(steps3)[0]) == base


@SETTINGS
@given(mvpo_batches(), st.randoms(use_true_random=False))
def test_regions_are_idempotent_and_order_independent(rows, rnd):  # T6.5
    steps = table(rows)
    region, _ = regions_of(steps)
    base = partition(steps, region)
    shuffled = list(rows)
    rnd.shuffle(shuffled)
    steps2 = table(shuffled)
    assert partition(steps2, regions_of(steps2)[0]) == base
    # idempotent: regions used as signatures give the same regions
    again, _ = viability_regions(steps.row_group, steps.row_traj, region)
    assert partition(steps, again) == base
    # every region lies inside one task group, and equal signatures of a group share a region
    sig = steps.extra("signature")
    groups_per_region = {}
    for r, g in zip(region.tolist(), steps.row_group.tolist()):
        groups_per_region.setdefault(r, set()).add(g)
    assert all(len(v) == 1 for v in groups_per_region.values())
    seen = {}
    for r, g, s in zip(region.tolist(), steps.row_group.tolist(), sig.tolist()):
        assert seen.setdefault((g, s), r) == r


# ---- T6.6: potential advantage -----------------------------------------------------------------------------------
def test_transition_to_a_higher_potential_region_is_positive():  # T6.6
    # a fails and enters Y (success region of b); b fails early. gamma close to 1
    rows = hand_rows({"a": (True, [("s0", "X", Z5, 0), ("s1", "Y", Z5, 0)]),
                      "b": (False, [("s0", "X", Z5, 0), ("s2", "Z", Z5, 0)])})
    p = MVPOParams(gamma=0.999)
    terms, _ = mvpo_terms(table(rows), p, initial_state(p))
    # Sbar: X 1/2, Y 1, Z 0 -> Phi~(Y) > Phi~(X) > Phi~(Z)
    ps = terms.phi_smooth[terms.region]  # sorted rows: a0, a1, b0, b1
    assert ps[1] > ps[0] > ps[3]
    assert terms.a_pot_raw[0] > 0 > terms.a_pot_raw[2]


@SETTINGS
@given(mvpo_batches(), st.sampled_from(["eq15", "eq29"]))
def test_raw_potential_advantage_has_the_sign_of_the_potential_step_at_gamma_one(rows, form):  # T6.6
    steps = table(rows)
    p = MVPOParams(gamma=1.0, potential_form=form)
    terms, _ = mvpo_terms(steps, p, initial_state(p))
    here = terms.phi_smooth[terms.region]
    inner = ~steps.is_last
    step = here[1:][inner[:-1]] - here[:-1][inner[:-1]]
    assert torch.equal(terms.a_pot_raw[inner], step)
    assert torch.all(terms.a_pot_raw[steps.is_last] == 0)  # hold: gamma Phi~(c_T) - Phi~(c_T) = 0 at gamma = 1


# ---- T6.7: AMP weights -------------------------------------------------------------------------------------------
def test_amp_utilities_and_update_hand_computed():
    # a succeeds: a0 h=(1,0,0,0,0), a1 h=(0,1,0,1,0); b fails: b0 h=(1,0,0,0,0), b1 h=(0,0,0,0,1)
    # u1 = 1/2 - 1/2 = 0; u2 = 1 - 1/3 = 2/3; u3 = 0 (never on); u4 = 2/3; u5 = [0 - 2/3]_+ = 0; sum = 4/3
    h = torch.tensor([[1, 0, 0, 0, 0], [0, 1, 0, 1, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 1]])
    y = torch.tensor([1, 1, 0, 0])
    u = amp_utilities(h, y)
    assert u == pytest.approx([0, 2 / 3, 0, 2 / 3, 0], abs=1e-15)
    # w = 0.9 w0 + 0.1 u / (4/3 + 1e-6) = (0.18, 0.27 + 0.05, 0.45, 9.0 + 0.05, 0), the 0.05 shrunk by 1e-6 / (4/3)
    share = 0.1 * (2 / 3) / (4 / 3 + 1e-6)
    assert amp_update(list(W0), u, 0.1, EPS) == pytest.approx([0.18, 0.27 + share, 0.45, 9.0 + share, 0.0], abs=1e-12)
    rows = hand_rows({"a": (True, [("s0", "X", [1, 0, 0, 0, 0], 0), ("s1", "Y", [0, 1, 0, 1, 0], 0)]),
                      "b": (False, [("s0", "X", [1, 0, 0, 0, 0], 0), ("s2", "Z", [0, 0, 0, 0, 1], 0)])})
    est = MVPO()
    est(table(rows))
    assert est.state_dict()["milestone_weights"] == pytest.approx([0.18, 0.27 + share, 0.45, 9.0 + share, 0.0])


def test_amp_update_applies_eq13_when_no_milestone_has_utility():
    # Regression: sum u = 0 (an all-fail batch) used to keep w; Eq. 13 as written gives
    # w = 0.9 w + 0.1 * 0 / (0 + 1e-6) = 0.9 w = (0.18, 0.27, 0.45, 9.0, 0.0)
    assert amp_update([0.2, 0.3, 0.5, 10.0, 0.0], [0.0] * 5, 0.1, 1e-6) == pytest.approx(
        [0.18, 0.27, 0.45, 9.0, 0.0], abs=1e-15)
    # the previous rule, kept as an option: the weights stay
    assert amp_update(list(W0), [0.0] * 5, 0.1, EPS, zero_sum="keep") == list(W0)
    # with a contrast the two rules agree
    u = [0.0, 0.5, 0.0, 1.0, 0.0]
    assert amp_update(list(W0), u, 0.1, EPS, zero_sum="keep") == amp_update(list(W0), u, 0.1, EPS)
    with pytest.raises(ValueError, match="zero_sum"):
        amp_update(list(W0), u, 0.1, EPS, zero_sum="decay")


def all_fail_milestone_rows():
    # one all-fail group: a = (s0, X) -> (s1, Y, h1 = 1); b = (s0, X) -> (s2, Z, loop 1)
    return hand_rows({"a": (False, [("s0", "X", Z5, 0), ("s1", "Y", [1, 0, 0, 0, 0], 0)]),
                      "b": (False, [("s0", "X", Z5, 0), ("s2", "Z", Z5, 1)])})


def test_all_fail_batch_with_milestones_hand_computed_under_both_zero_sum_rules():
    # Y = 0 on every row -> u = 0. "eq13": w = 0.9 w0, w1 = 0.18; "keep": w = w0, w1 = 0.2.
    # raw Eq. 15: X 0, Y w1, Z -Lbar = -1 (Sbar = 0). Unlike test_hand_computed_zero_credit_group_eq15 the loop term
    # does not scale with w, so the two rules give different potentials:
    #   eq13: raw (0, .18, -1), mean -0.273333, unbiased std 0.635715 -> Phi = (0.429962, 0.713107, -1.143068)
    #   keep: raw (0, .20, -1), mean -0.266667, unbiased std 0.642910 -> Phi = (0.414780, 0.725865, -1.140645)
    # Phibar = 0 (z-scores); eta X 1/2, Y 1/3, Z 1/3; A^pot raw a0 = .95 Phi~Y - Phi~X, a1 = -.05 Phi~Y,
    # b0 = .95 Phi~Z - Phi~X, b1 = -.05 Phi~Z; group z-score; anchor s0 (G = 0, 0) routes to kappa A^pot with
    # kappa = 1 (first batch), s1 and s2 are singletons (0); A^epi = 0. eq13: A^pot raw = (0.010836, -0.011885,
    # -0.576952, 0.019051) -> A = (0.258034, 0, -0.749243, 0); keep: (0.022467, -0.012098, -0.568594, 0.019011)
    # -> A = (0.271520, 0, -0.748916, 0).
    def expected(w1):
        raw = {"X": 0.0, "Y": w1, "Z": -1.0}
        m = sum(raw.values()) / 3
        sd = math.sqrt(sum((x - m) ** 2 for x in raw.values()) / 2) + EPS
        eta = {"X": 0.5, "Y": 1 / 3, "Z": 1 / 3}
        ps = {c: eta[c] * (raw[c] - m) / sd for c in raw}
        pot = [0.95 * ps["Y"] - ps["X"], -0.05 * ps["Y"], 0.95 * ps["Z"] - ps["X"], -0.05 * ps["Z"]]
        pm = sum(pot) / 4
        psd = math.sqrt(sum((x - pm) ** 2 for x in pot) / 3) + EPS
        return [0.5 * (pot[0] - pm) / psd, 0.0, 0.5 * (pot[2] - pm) / psd, 0.0]

    eq13, keep = expected(0.18), expected(0.2)
    assert eq13 == pytest.approx([0.258034, 0.0, -0.749243, 0.0], abs=1e-6)
    assert keep == pytest.approx([0.271520, 0.0, -0.748916, 0.0], abs=1e-6)
    steps = table(all_fail_milestone_rows())
    for rule, want, w in (("eq13", eq13, [0.18, 0.27, 0.45, 9.0, 0.0]), ("keep", keep, list(W0))):
        est = MVPO(amp_zero_sum=rule)
        assert est(steps).double().tolist() == pytest.approx(want, abs=1e-6)
        assert est.state_dict()["milestone_weights"] == pytest.approx(w, abs=1e-15)
        p = MVPOParams(amp_zero_sum=rule)
        assert steps.to_input_order(mvpo_reference(steps, p)).tolist() == pytest.approx(want, abs=1e-9)
    assert MVPO().params.amp_zero_sum == "eq13"  # the default is the paper's Eq. 13


def test_a_run_of_all_fail_batches_decays_the_weights_geometrically_under_eq13():
    steps = table(all_fail_milestone_rows())
    decay, keep = MVPO(), MVPO(amp_zero_sum="keep")
    for _ in range(5):
        decay(steps)
        keep(steps)
    assert decay.state_dict()["milestone_weights"] == pytest.approx([0.9 ** 5 * w for w in W0], abs=1e-12)
    assert keep.state_dict()["milestone_weights"] == list(W0)


@SETTINGS
@given(st.lists(mvpo_batches(max_groups=2), min_size=1, max_size=4), st.sampled_from([0.1, 0.5, 1.0]),
       st.sampled_from(["eq13", "keep"]))
def test_amp_weights_stay_nonnegative_and_sum_to_one_at_beta_one(batches, beta, rule):  # T6.7
    est = MVPO(beta_amp=beta, amp_zero_sum=rule)
    for rows in batches:
        steps = table(rows)
        before = est.state_dict()["milestone_weights"]
        est(steps)
        w = est.state_dict()["milestone_weights"]
        assert all(x >= 0 for x in w)
        ms = steps.extra("milestones", None)
        total = sum(amp_utilities(ms, steps.success)) if ms is not None else 0.0
        if total == 0:  # no contrast: Eq. 13 gives (1 - beta) w (0 at beta = 1), "keep" leaves w
            assert w == (before if rule == "keep" else pytest.approx([(1 - beta) * x for x in before], abs=1e-15))
        elif beta == 1.0:  # w = u / (sum u + eps): sums to 1 up to eps / sum u
            assert sum(w) == pytest.approx(total / (total + EPS), abs=1e-12)
            assert 1 - sum(w) <= EPS / total


# ---- hand-computed batches ---------------------------------------------------------------------------------------
def test_hand_computed_zero_credit_group_eq15():
    # one all-fail group: a = (s0, X) -> (s1, Y, h1 = 1); b = (s0, X) -> (s2, Z). Returns all 0 -> A^epi = 0.
    # anchor s0: G = (0, 0), std 0 <= eps_route -> potential route; s1, s2 singletons -> 0.
    # AMP: Y = 0 everywhere -> u = 0 -> Eq. 13 as written (the default since amp_zero_sum): w = 0.9 w0.
    # raw: X 0, Y 0.18 * 1 = 0.18, Z 0 (Sbar = Lbar = 0): 0.9 times the raw values under w0 ("keep"), and the
    # z-score cancels the 0.9 up to eps.
    # Norm over the 3 regions: mean 0.06, unbiased std 0.9/sqrt(75):
    #   Phi = 0.9 (-1/15, 2/15, -1/15) / (0.9/sqrt(75) + eps) = (-0.57735, 1.15470, -0.57735). Phibar = 0.
    #   eta: X 2/4, Y 1/3, Z 1/3 -> Phi~ = (-0.288673, 0.384897, -0.192448)
    # A^pot raw: a0 = .95 Phi~Y - Phi~X = 0.654325, a1 = -.05 Phi~Y = -0.019245,
    #            b0 = .95 Phi~Z - Phi~X = 0.105847, b1 = -.05 Phi~Z = 0.009622
    # group z-score: mean 0.187637, std 0.315688 -> a0 1.478315, b0 -0.259086; kappa = 1 (first batch)
    # A = 0 + 0.5 * A^pot at a0, b0; 0 at a1, b1
    rows = hand_rows({"a": (False, [("s0", "X", Z5, 0), ("s1", "Y", [1, 0, 0, 0, 0], 0)]),
                      "b": (False, [("s0", "X", Z5, 0), ("s2", "Z", Z5, 0)])})
    sd = 0.9 / math.sqrt(75) + EPS
    ps = {"X": 0.5 * 0.9 * (-1 / 15) / sd, "Y": 0.9 * (2 / 15) / sd / 3, "Z": 0.9 * (-1 / 15) / sd / 3}
    raw = [0.95 * ps["Y"] - ps["X"], -0.05 * ps["Y"], 0.95 * ps["Z"] - ps["X"], -0.05 * ps["Z"]]
    m = sum(raw) / 4
    s = math.sqrt(sum((x - m) ** 2 for x in raw) / 3)
    expected = [0.5 * (raw[0] - m) / (s + EPS), 0.0, 0.5 * (raw[2] - m) / (s + EPS), 0.0]
    assert expected == pytest.approx([0.739157, 0.0, -0.129543, 0.0], abs=1e-6)
    out = MVPO()(table(rows))
    assert out.tolist() == pytest.approx(expected, abs=1e-6)
    assert run_reference(rows).tolist() == pytest.approx(expected, abs=1e-9)


def test_hand_computed_eq29_potential():
    # all-fail group: u = 0, so w = 0.9 w0 (Eq. 13); pbar and r_rec do not change under a common scale of w, so
    # the numbers are those of w0. a: X (h 0) -> Y (h3 = 1, score 0.5 under w0) -> Z (loop); b: X -> Z.
    # milestone return-to-go (gamma .95): a = (0.475, 0.5, 0), b = (0, 0); min-max by 0.5 -> (0.95, 1, 0), (0, 0)
    # improves: a0 (later best 0.5 > 0) only. Regions X {a0, b0}, Y {a1}, Z {a2, b1}.
    # pbar = (0.475, 1, 0); r_rec = (1/2, 0, 0); r_loop = (0, 0, 1/2)
    # Phi = pbar + 0.2 (r_rec - r_loop) = (0.575, 1.0, -0.1); Phibar = 1.475 / 3 = 0.491667
    # Phi~ = eta Phi + (1 - eta) Phibar, eta = (1/2, 1/3, 1/2) -> (0.533333, 0.661111, 0.195833)
    rows = hand_rows({"a": (False, [("s0", "X", Z5, 0), ("s1", "Y", [0, 0, 1, 0, 0], 0), ("s2", "Z", Z5, 1)]),
                      "b": (False, [("s0", "X", Z5, 0), ("s3", "Z", Z5, 0)])})
    steps = table(rows)
    p = MVPOParams(potential_form="eq29")
    terms, _ = mvpo_terms(steps, p, initial_state(p))
    phi = terms.phi[terms.region].tolist()  # sorted rows a0 a1 a2 b0 b1
    # (1e-8: segments.discounted_cumsum rounds gamma to float32)
    assert phi == pytest.approx([0.575, 1.0, -0.1, 0.575, -0.1], abs=1e-7)
    bar = 1.475 / 3
    smooth = terms.phi_smooth[terms.region].tolist()
    assert smooth == pytest.approx([0.5 * 0.575 + 0.5 * bar, 1 / 3 + 2 / 3 * bar, -0.05 + 0.5 * bar,
                                    0.5 * 0.575 + 0.5 * bar, -0.05 + 0.5 * bar], abs=1e-7)
    assert MVPO(potential_form="eq29")(steps).double().tolist() == pytest.approx(
        run_reference(rows, potential_form="eq29").tolist(), abs=1e-6)


def test_outcome_terminal_potential_uses_success():
    rows = hand_rows({"a": (True, [("s0", "X", Z5, 0), ("s1", "Y", Z5, 0)]),
                      "b": (False, [("s0", "X", Z5, 0), ("s2", "Z", Z5, 0)])})
    p = MVPOParams(terminal_potential="outcome")
    terms, _ = mvpo_terms(table(rows), p, initial_state(p))
    here = terms.phi_smooth[terms.region]
    assert terms.a_pot_raw[1] == pytest.approx(0.95 * 1.0 - here[1])  # a succeeded: next potential 1
    assert terms.a_pot_raw[3] == pytest.approx(0.95 * 0.0 - here[3])  # b failed: next potential 0


def test_all_fail_group_gets_signal_where_gigpo_has_none():  # spec credit §6.4
    rows = hand_rows({"a": (False, [("s0", "X", Z5, 0), ("s1", "Y", [1, 0, 0, 0, 0], 0)]),
                      "b": (False, [("s0", "X", Z5, 0), ("s2", "Z", Z5, 1)])})
    steps = table(rows)
    assert torch.all(gigpo(steps, step_weight=0.5) == 0)
    out = MVPO()(steps)
    assert out[0] > 0 > out[2]  # the prefix into the milestone region beats the one into the loop region


def test_missing_milestones_equal_all_zero_milestones():
    # also for the weights: both have u = 0, so Eq. 13 decays w alike ("eq13") or leaves it ("keep")
    rows = hand_rows({"a": (True, [("s0", "X", Z5, 0), ("s1", "Y", Z5, 1)]),
                      "b": (False, [("s0", "X", Z5, 0), ("s2", "Z", Z5, 0), ("s0", "X", Z5, 1)])})
    for form in ("eq15", "eq29"):
        for rule in ("eq13", "keep"):
            with_zero = MVPO(potential_form=form, amp_zero_sum=rule)
            without = MVPO(potential_form=form, amp_zero_sum=rule)
            assert torch.equal(with_zero(table(rows)), without(table(rows, milestones=False)))
            assert without.state_dict() == with_zero.state_dict()
            assert torch.allclose(run_reference(rows, potential_form=form, amp_zero_sum=rule),
                                  with_zero(table(rows)).double(), atol=1e-6)
    # no loop_flag block means 0 everywhere
    no_loop = [dict(r, loop_flag=0) for r in rows]
    assert torch.equal(MVPO()(table(no_loop)), MVPO()(table(rows, loop=False)))


# ---- state ------------------------------------------------------------------------------------------------------
@settings(max_examples=20, deadline=None)
@given(st.lists(mvpo_batches(max_groups=3), min_size=2, max_size=5), st.sampled_from(["eq15", "eq29"]))
def test_state_dict_resume_matches_uninterrupted_run(batches, form):
    full = MVPO(potential_form=form)
    outs = [full(table(rows)) for rows in batches]
    k = len(batches) - 1
    part = MVPO(potential_form=form)
    for rows in batches[:k]:
        part(table(rows))
    saved = pickle.loads(pickle.dumps(part.state_dict()))
    resumed = cp.get("mvpo").create(potential_form=form)
    resumed.load_state_dict(saved)
    assert torch.equal(resumed(table(batches[k])), outs[k])
    assert resumed.state_dict() == full.state_dict()


def test_state_dict_is_plain_python_and_validated():
    est = MVPO()
    est(success_batch(2))
    s = est.state_dict()
    assert set(s) == set(MVPO.STATE_SCHEMA)
    assert all(isinstance(v, (int, float, list, type(None))) for v in s.values())
    with pytest.raises(ValueError, match="missing keys"):
        MVPO().load_state_dict({"kappa": 1.0})
    with pytest.raises(ValueError, match="milestone weights"):
        MVPO().load_state_dict(dict(s, milestone_weights=[1.0, 2.0]))
    est.reset()
    assert est.state_dict() == MVPO().state_dict()


def test_first_batch_of_a_fresh_instance_equals_the_estimator_fn():
    steps = success_batch(1)
    p = MVPOParams()
    assert torch.equal(MVPO()(steps), steps.to_input_order(mvpo_est.fn(steps, p)).float())


# ---- against the loop reference, and invariances -----------------------------------------------------------------
PARAMS = st.fixed_dictionaries({}, optional={
    "potential_form": st.sampled_from(["eq15", "eq29"]), "terminal_potential": st.sampled_from(["hold", "outcome"]),
    "episode_stats": st.sampled_from(["steps", "trajectories"]), "lambda_cnt": st.sampled_from([0.0, 1.0, 4.0]),
    "beta_amp": st.sampled_from([0.1, 1.0]), "alpha_kappa": st.sampled_from([0.05, 0.5]),
    "gamma": st.sampled_from([0.9, 0.95, 1.0]), "amp_zero_sum": st.sampled_from(["eq13", "keep"])})

# every parameter of MVPOParams (test_all_params_covers_every_field keeps this list complete)
ALL_PARAMS = st.fixed_dictionaries({
    "step_weight": st.sampled_from([0.5, 1.0, 2.5]), "gamma": st.sampled_from([0.9, 0.95, 1.0]),
    "norm_std": st.booleans(), "eps": st.sampled_from([1e-6, 1e-3]),
    "episode_stats": st.sampled_from(["steps", "trajectories"]), "eps_route": st.sampled_from([1e-6, 0.5, 3.0]),
    "kappa": st.sampled_from([None, None, 0.0, 0.3, 1.0]), "kappa_min": st.sampled_from([0.01, 0.05, 0.5]),
    "alpha_kappa": st.sampled_from([0.05, 0.5, 1.0]),
    "milestone_weights": st.one_of(st.just(W0), st.lists(st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0, 3.0]),
                                                         min_size=5, max_size=5).map(tuple)),
    "beta_amp": st.sampled_from([0.1, 0.5, 1.0]), "amp_zero_sum": st.sampled_from(["eq13", "keep"]),
    "potential_form": st.sampled_from(["eq15", "eq29"]), "alpha_s": st.sampled_from([0.0, 1.0, 2.0]),
    "alpha_l": st.sampled_from([0.0, 1.0, 0.5]), "delta": st.sampled_from([0.0, 0.2, 1.0]),
    "lambda_cnt": st.sampled_from([0.0, 1.0, 2.0, 4.0]), "terminal_potential": st.sampled_from(["hold", "outcome"]),
    # exact anchors, as the reference groups them; similar anchors: tests/credit/test_similarity.py (X4 vs gigpo)
    "similarity_thresh": st.just(None)})


def test_all_params_covers_every_field():
    import dataclasses

    assert set(ALL_PARAMS.wrapped_strategy.mapping) == {f.name for f in dataclasses.fields(MVPOParams)}


@st.composite
def reference_batches(draw):
    """mvpo_batches with loop flags present or absent, or a free-signature cycle batch with random rewards"""
    if draw(st.booleans()):
        return draw(mvpo_batches()), draw(st.booleans()), True
    rows = draw(st.one_of(cycle_batches(), chain_batches()))
    rnd = random.Random(draw(st.integers(0, 2**31)))
    with_ms = draw(st.booleans())
    last = {}
    for r in rows:
        last[r["traj"]] = max(last.get(r["traj"], -1), r["t"])
    ok = {tr: rnd.random() < 0.4 for tr in last}
    for r in rows:
        r["state"] = f"s{rnd.randrange(3)}"  # anchors that cut across signatures
        r["reward"] = 10.0 if ok[r["traj"]] and r["t"] == last[r["traj"]] else 0.0
        r["milestones"] = [int(rnd.random() < 0.3) for _ in range(5)] if with_ms else None
        r["loop_flag"] = int(rnd.random() < 0.2)
    return rows, draw(st.booleans()), with_ms


@settings(max_examples=150, deadline=None)
@given(reference_batches(), ALL_PARAMS, st.randoms(use_true_random=False))
def test_one_batch_matches_the_loop_reference_with_every_parameter(batch, params, rnd):
    rows, loop, _ = batch
    rows = list(rows)
    rnd.shuffle(rows)
    steps = table(rows, loop=loop)
    p = MVPOParams(**params)
    ours = mvpo_terms(steps, p, initial_state(p))[0].advantage
    ref = mvpo_reference(steps, p)
    assert torch.all(torch.isfinite(ours))
    assert torch.allclose(ours, ref, rtol=1e-5, atol=1e-5)
    # oracle_values (input order, float32) against the estimator's first batch
    assert torch.allclose(oracle_values(mvpo_est, steps, **params), MVPO(**params)(steps), rtol=1e-5, atol=1e-5)


@SETTINGS
@given(st.lists(reference_batches(), min_size=3, max_size=4), ALL_PARAMS)
def test_a_run_of_batches_matches_the_reference_run(batches, params):
    # the stateful instance: kappa schedule (sbar, s_0), AMP weight EMA, across 3-4 batches
    est = MVPO(**params)
    tables = [table(rows, loop=loop) for rows, loop, _ in batches]
    p = MVPOParams(**params)
    refs, ref_state = mvpo_reference_run(tables, p)
    for steps, ref in zip(tables, refs):
        ours = est(steps)
        assert torch.allclose(ours.double(), steps.to_input_order(ref), rtol=1e-5, atol=1e-5)
    ours_state = est.state_dict()
    assert set(ref_state) == set(ours_state) and ref_state["batches"] == ours_state["batches"] == len(batches)
    for key in ("success_ema", "success_init", "kappa"):
        assert ours_state[key] == pytest.approx(ref_state[key], abs=1e-12)
    assert ours_state["milestone_weights"] == pytest.approx(ref_state["milestone_weights"], abs=1e-12)
    # and batch by batch from a saved state
    state = reference_initial_state(p)
    est2 = MVPO(**params)
    for steps in tables:
        ref, state = mvpo_reference_batch(steps, p, state)
        est2(steps)
        assert est2.state_dict()["milestone_weights"] == pytest.approx(state["milestone_weights"], abs=1e-12)
        assert est2.state_dict()["kappa"] == pytest.approx(state["kappa"], abs=1e-12)


@SETTINGS
@given(mvpo_batches(), PARAMS, st.randoms(use_true_random=False))
def test_deterministic_and_row_permutation_equivariant(rows, params, rnd):
    a = MVPO(**params)(table(rows))
    assert torch.equal(a, MVPO(**params)(table(rows)))
    perm = list(range(len(rows)))
    rnd.shuffle(perm)
    b = MVPO(**params)(table([rows[i] for i in perm]))
    assert torch.allclose(b, a[perm], rtol=1e-5, atol=1e-5)


@SETTINGS
@given(mvpo_batches(), PARAMS)
def test_invariant_to_relabelling_keys(rows, params):
    relabel = [dict(r, group="G" + r["group"][::-1], traj=f"T{r['traj']}", state="S" + r["state"][::-1],
                    signature=r["signature"] + "#") for r in rows]
    a = MVPO(**params)(table(rows))
    b = MVPO(**params)(table(relabel))
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_empty_batch_leaves_the_state_alone():
    est = MVPO()
    steps = cp.StepTable(group=[], traj=[], t=[], state=[], reward=[],
                         extras={"signature": torch.zeros(0, dtype=torch.int64)})
    assert est(steps).shape == (0,)
    assert est.state_dict() == MVPO().state_dict()


# ---- bad input ---------------------------------------------------------------------------------------------------
def test_missing_signature_names_the_extra():
    steps = cp.StepTable(group=[0, 0], traj=[0, 1], t=[0, 0], state=["s", "s"], reward=[1.0, 0.0])
    with pytest.raises(ValueError, match=r"extras\['signature'\]"):
        MVPO()(steps)


def test_missing_state_names_the_field():
    steps = cp.StepTable(group=[0, 0], traj=[0, 1], t=[0, 0], reward=[1.0, 0.0], extras={"signature": ["a", "b"]})
    with pytest.raises(ValueError, match="state"):
        MVPO()(steps)


def test_milestones_of_the_wrong_width_are_rejected():
    rows = hand_rows({"a": (True, [("s0", "X", [0, 1, 0], 0)]), "b": (False, [("s0", "X", [1, 0, 0], 0)])})
    with pytest.raises(ValueError, match=r"milestones.*M=5"):
        MVPO()(table(rows))
    MVPO(milestone_weights=[1.0, 1.0, 1.0])(table(rows))  # fine with weights of that width
    bad = hand_rows({"a": (True, [("s0", "X", [0, 2, 0, 0, 0], 0)])})
    with pytest.raises(ValueError, match="0/1"):
        MVPO()(table(bad))


@pytest.mark.parametrize("name,value", [
    ("gamma", 1.5), ("eps", 0.0), ("kappa", 1.2), ("kappa_min", -0.1), ("alpha_kappa", 0.0), ("beta_amp", 2.0),
    ("alpha_s", -1.0), ("alpha_l", float("nan")), ("lambda_cnt", -1.0), ("delta", -0.2), ("eps_route", -1.0),
    ("potential_form", "eq16"), ("terminal_potential", "zero"), ("episode_stats", "rows"),
    ("milestone_weights", [0.2, -0.3]), ("milestone_weights", []), ("step_weight", float("inf"))])
def test_params_out_of_range_name_the_parameter(name, value):
    with pytest.raises(ValueError, match=name):
        MVPO(**{name: value})
    with pytest.raises(ValueError, match=name):
        cp.get("mvpo").create(**{name: value})


def test_unknown_parameter_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown parameter.*omega"):
        MVPO(omega=0.5)


# ---- the stateful Estimator API ----------------------------------------------------------------------------------
def test_stateful_estimator_called_as_a_function_points_to_create():
    with pytest.raises(ValueError, match=r"create\("):
        mvpo_est(success_batch(1))
    est = mvpo_est.create(step_weight=1.0)
    assert isinstance(est, MVPO) and est.params.step_weight == 1.0
    assert "mvpo" in cp.available()


def test_create_on_a_stateless_estimator_binds_its_params():
    steps = success_batch(2)
    bound = gigpo.create(step_weight=0.7)
    assert isinstance(bound, BoundEstimator)
    assert torch.equal(bound(steps), gigpo(steps, step_weight=0.7))
    assert bound.state_dict() == {}
    bound.load_state_dict({})
    with pytest.raises(ValueError, match="unknown parameter"):
        gigpo.create(kappa=0.1)


def test_describe_says_the_estimator_is_stateful():
    text = cp.describe("mvpo")
    assert "stateful: keeps the success EMA" in text and "milestone weights" in text
    assert "extras: signature [S] (required)" in text
    assert "stateful" not in cp.describe("gigpo")


def test_the_record_carries_the_loop_reference():
    assert ORACLES["mvpo"] is mvpo_reference
    steps = table(all_fail_milestone_rows())
    assert torch.allclose(oracle_values(mvpo_est, steps), MVPO()(steps), atol=1e-6)
    assert mvpo_reference_run([], MVPOParams()) == ([], reference_initial_state(MVPOParams()))
    empty = cp.StepTable(group=[], traj=[], t=[], state=[], reward=[],
                         extras={"signature": torch.zeros(0, dtype=torch.int64)})
    assert mvpo_reference_batch(empty, MVPOParams(), None)[0].shape == (0,)


def test_depth_bin():
    assert [depth_bin(t) for t in range(8)] == [0, 0, 0, 3, 3, 3, 6, 6]
    assert depth_bin(torch.arange(7), width=2).tolist() == [0, 0, 2, 2, 4, 4, 6]
    with pytest.raises(ValueError, match="width"):
        depth_bin(3, width=0)


def test_defaults_are_plain_config_values_that_round_trip():
    d = mvpo_est.defaults()
    assert d["milestone_weights"] == list(W0) and d["kappa"] is None
    assert mvpo_est.make_params(**d) == MVPOParams()


def test_default_signature_is_the_state_and_its_depth_bin():
    from credit_plugins.estimators.mvpo import default_signature

    assert [default_signature("s", t) for t in (0, 2, 3, 7)] == ["s|d0", "s|d0", "s|d3", "s|d6"]
    assert default_signature(42, 5, width=5) == "42|d5"


@pytest.mark.slow
@pytest.mark.parametrize("credit,params", [("mvpo", {}), ("mix", {"parts": {"grpo": 0.5, "mvpo": 0.5}})])
def test_mvpo_trains_in_a_real_grpo_trainer_on_a_turn_rollout_without_signatures(tmp_path, credit, params):
    """The TRL turn rollout gives no ``signature``; the bridge derives MVPO's from the state and the depth bin, as
    the verl env loop does (a run used to stop with "estimator 'mvpo' needs extras['signature']")."""
    pytest.importorskip("trl")
    from tests.helpers.trl_runs import train_turn_rollout_step

    seen = train_turn_rollout_step(credit, params, str(tmp_path), max_turns=4)
    steps = seen[0]
    # the signature is a function of (state, depth bin): equal states in one bin share it, bins 0 and 3 differ
    sig, state, t = steps.extra("signature"), steps.state, steps.t
    for i in range(steps.n_steps):
        for j in range(steps.n_steps):
            same = bool(state[i] == state[j]) and int(t[i]) // 3 == int(t[j]) // 3
            assert bool(sig[i] == sig[j]) == same
