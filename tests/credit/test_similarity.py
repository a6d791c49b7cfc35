"""Similarity anchors (credit_plugins.similarity, StepTable.anchor_at) and GiGPO's / MVPO's ``similarity_thresh``."""

from difflib import SequenceMatcher

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import credit_plugins as cp
from credit_plugins import similarity
from credit_plugins.estimators.gigpo import GiGPOParams
from credit_plugins.estimators.mvpo import MVPO
from credit_plugins.hashing import stable_hash
from credit_plugins.similarity import cluster_leaders, similar_anchor_keys

from tests.helpers.similar_anchors import DRAWER2, DRAWER3, REWARDS, TEXTS, expected_gigpo
from tests.helpers.strategies import columns, step_batches

gigpo = cp.get("gigpo")
SETTINGS = settings(max_examples=60, deadline=None)


def reference_clusters(texts, threshold):
    """verl-agent's build_step_group loop (enable_similarity=True) for one group: rows in the given order."""
    clusters = []
    for obs in texts:
        for c in clusters:
            if SequenceMatcher(None, obs, c["rep"]).ratio() >= threshold:
                c["members"].add(obs)
                break
        else:
            clusters.append({"rep": obs, "members": {obs}})
    return {frozenset(c["members"]) for c in clusters}


def partition(leaders):
    """The clusters of a {text: leader} map, as a set of frozensets."""
    out = {}
    for text, lead in leaders.items():
        out.setdefault(lead, set()).add(text)
    return {frozenset(v) for v in out.values()}


# ---- hand-computed clustering --------------------------------------------------------------------------------------
def test_difflib_ratios_by_hand():
    # ratio = 2 M / (|a| + |b|), M = the matched characters
    assert SequenceMatcher(None, "abcd", "abce").ratio() == 6 / 8  # "abc"
    assert SequenceMatcher(None, "abce", "abef").ratio() == 6 / 8  # "ab" + "e"
    assert SequenceMatcher(None, "abcd", "abef").ratio() == 4 / 8  # "ab"
    assert SequenceMatcher(None, DRAWER2, DRAWER3).ratio() == 68 / 70  # 35 characters each, one differs


def test_greedy_clusters_in_sorted_order():
    texts = ["abef", "abce", "abcd", "abce"]
    # sorted: abcd leads; abce joins it (0.75); abef does not reach abcd (0.5) and leads its own cluster
    assert cluster_leaders(texts, 0.75) == {"abcd": "abcd", "abce": "abcd", "abef": "abef"}
    assert cluster_leaders(texts, 0.5) == dict.fromkeys(["abcd", "abce", "abef"], "abcd")
    assert cluster_leaders(texts, 0.76) == {t: t for t in ("abcd", "abce", "abef")}
    assert cluster_leaders(texts, 1.0) == cluster_leaders(texts, None) == {t: t for t in ("abcd", "abce", "abef")}
    assert cluster_leaders(texts, 0.0) == dict.fromkeys(["abcd", "abce", "abef"], "abcd")
    assert cluster_leaders([], 0.9) == {} and cluster_leaders(["x"], 0.9) == {"x": "x"}


def test_the_reference_depends_on_row_order_and_ours_does_not():
    # abce ~ abcd and abce ~ abef (0.75) but abcd !~ abef (0.5): the reference's leader is whichever row comes first
    a = reference_clusters(["abce", "abcd", "abef"], 0.75)
    b = reference_clusters(["abcd", "abce", "abef"], 0.75)
    assert a == {frozenset({"abcd", "abce", "abef"})} and b == {frozenset({"abcd", "abce"}), frozenset({"abef"})}
    for order in (["abce", "abcd", "abef"], ["abcd", "abce", "abef"], ["abef", "abce", "abcd"]):
        assert partition(cluster_leaders(order, 0.75)) == b  # = the reference on the sorted distinct texts


texts_st = st.lists(st.text(alphabet="abc ", min_size=0, max_size=7), min_size=1, max_size=12)
thresh_st = st.sampled_from([0.0, 0.3, 0.5, 0.6, 0.75, 0.8, 0.9, 1.0])


@SETTINGS
@given(texts_st, thresh_st)
def test_equals_the_reference_loop_on_sorted_distinct_texts(texts, threshold):
    assert partition(cluster_leaders(texts, threshold)) == reference_clusters(sorted(set(texts)), threshold)


@SETTINGS
@given(texts_st, st.lists(st.integers(0, 2), min_size=12, max_size=12), thresh_st, st.randoms(use_true_random=False))
def test_keys_are_invariant_to_row_order(texts, groups, threshold, rnd):
    groups = groups[:len(texts)]
    keys = similar_anchor_keys(texts, groups, threshold)
    perm = list(range(len(texts)))
    rnd.shuffle(perm)
    shuffled = similar_anchor_keys([texts[i] for i in perm], [groups[i] for i in perm], threshold)
    assert np.array_equal(shuffled, keys[perm])
    # identical texts of one group always share a key; each key is the hash of a text of that group
    for i in range(len(texts)):
        for j in range(len(texts)):
            if texts[i] == texts[j] and groups[i] == groups[j]:
                assert keys[i] == keys[j]
        assert keys[i] in {stable_hash(texts[j]) for j in range(len(texts)) if groups[j] == groups[i]}


def test_threshold_one_and_none_are_the_exact_keys():
    texts = [DRAWER2, DRAWER3, DRAWER2, "x"]
    exact = np.array([stable_hash(t) for t in texts], dtype=np.int64)
    assert np.array_equal(similar_anchor_keys(texts, [0, 0, 1, 1], None), exact)
    assert np.array_equal(similar_anchor_keys(texts, [0, 0, 1, 1], 1.0), exact)


def test_groups_are_never_merged():
    # the same two near-identical texts in two groups: merged inside each group, never across
    keys = similar_anchor_keys([DRAWER2, DRAWER3, DRAWER3, DRAWER2], ["g", "g", "h", "h"], 0.9)
    assert keys[0] == keys[1] and keys[2] == keys[3]
    steps = cp.StepTable(group=["g", "g", "h", "h"], traj=[0, 1, 2, 3], t=[0] * 4, reward=[0.0] * 4,
                         state=[DRAWER2, DRAWER3, DRAWER3, DRAWER2])
    ids, n = steps.anchor_at(0.9)
    assert n == 2 and ids[0] == ids[1] != ids[2] == ids[3]
    ids, n = steps.anchor_at(0.0)  # threshold 0: one anchor per task group
    assert n == steps.n_groups == 2 and torch.equal(ids, steps.row_group)
    assert steps.anchor_at(None) == steps.anchor_at(1.0) == steps.anchor


def test_a_groups_keys_do_not_depend_on_other_groups():
    base = similar_anchor_keys(["abcd", "abce", "zz"], ["g", "g", "h"], 0.7)
    more = similar_anchor_keys(["abcd", "abce", "abcd", "abce", "abcf"], ["g", "g", "h", "h", "h"], 0.7)
    assert np.array_equal(base[:2], more[:2])


# ---- GiGPO -----------------------------------------------------------------------------------------------------
def drawer_batch(state_type=str):
    """tests/helpers/similar_anchors.py's case: two rollouts whose first observations differ in one character."""
    return cp.StepTable(group=[0] * 4, traj=[0, 0, 1, 1], t=[0, 1, 0, 1], reward=REWARDS,
                        state=TEXTS if state_type is str else [stable_hash(s) for s in TEXTS])


def test_gigpo_merges_two_near_identical_observations_by_hand():
    steps = drawer_batch()
    exact = gigpo(steps)  # every anchor is a singleton: A^S = 0
    assert exact.tolist() == pytest.approx(expected_gigpo(merged=False))
    # ratio 68/70 >= 0.95: the two t=0 rows share an anchor
    assert gigpo(steps, similarity_thresh=0.95).tolist() == pytest.approx(expected_gigpo(merged=True))
    assert torch.equal(gigpo(steps, similarity_thresh=0.98), exact)  # 68/70 < 0.98: not merged
    assert torch.equal(gigpo(steps, similarity_thresh=1.0), exact)


@SETTINGS
@given(step_batches(n_states=6), st.sampled_from([None, 0.0, 0.75, 1.0]), st.randoms(use_true_random=False))
def test_gigpo_is_invariant_to_the_order_of_the_rollouts(rows, threshold, rnd):
    words = ["q", "abcd", "abce", "abef", "wxyz", "wxyq"]  # at 0.75 a chain abcd ~ abce ~ abef, abcd !~ abef
    for r in rows:
        r["state"] = words[int(r["state"].split("s")[-1])]
    ids = sorted({r["traj"] for r in rows})
    relabel = dict(zip(ids, rnd.sample(ids, len(ids))))  # the rollouts of the batch in another order
    moved = [dict(r, traj=relabel[r["traj"]]) for r in rows]
    a = gigpo(cp.StepTable(**columns(rows)), similarity_thresh=threshold)
    b = gigpo(cp.StepTable(**columns(moved)), similarity_thresh=threshold)
    assert torch.equal(a, b)
    if threshold in (None, 1.0):  # exact: identical to today's hashed-key path
        hashed = cp.StepTable(**{**columns(rows), "state": [stable_hash(r["state"]) for r in rows]})
        assert torch.equal(a, gigpo(hashed))


@SETTINGS
@given(step_batches(n_states=6), st.sampled_from([0.6, 0.85, 0.95]))
def test_mvpo_at_kappa_zero_equals_gigpo_with_the_same_similarity(rows, threshold):  # X4 with similar anchors
    words = ["kitchen: apple", "kitchen: apples", "kitchen: knife", "hall: door", "hall: doors", "garden"]
    for r in rows:
        r["state"] = words[int(r["state"].split("s")[-1])]
    steps = cp.StepTable(**columns(rows), extras={"signature": [r["state"] for r in rows]})
    ours = MVPO(kappa=0.0, step_weight=1.0, similarity_thresh=threshold)(steps)
    ref = gigpo(steps, step_weight=1.0, similarity_thresh=threshold)
    assert torch.allclose(ours, ref, rtol=0, atol=1e-6)


# ---- bad input ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), float("inf"), "0.9", True])
def test_bad_thresholds_name_the_field(bad):
    with pytest.raises(ValueError, match="similarity_thresh"):
        gigpo.make_params(similarity_thresh=bad)
    with pytest.raises(ValueError, match="similarity_thresh"):
        GiGPOParams(similarity_thresh=bad)
    with pytest.raises(ValueError, match="similarity_thresh"):
        similar_anchor_keys(["a"], [0], bad)
    with pytest.raises(ValueError, match="similarity_thresh"):
        drawer_batch().anchor_at(bad)


def test_hashed_states_cannot_be_compared():
    steps = drawer_batch(state_type=int)
    with pytest.raises(ValueError, match="similarity_thresh=0.9 merges states by their text.*pass the state texts"):
        gigpo(steps, similarity_thresh=0.9)
    assert torch.equal(gigpo(steps, similarity_thresh=1.0), gigpo(drawer_batch()))
    mixed = cp.StepTable(group=[0, 0], traj=[0, 1], t=[0, 0], reward=[0.0, 1.0], state=["abc", 7])
    with pytest.raises(ValueError, match=r"holds a non-text key \(int\) \(input row 1\)"):
        mixed.anchor_at(0.5)
    tensor = cp.StepTable(group=[0], traj=[0], t=[0], reward=[0.0], state=torch.tensor([3]))
    with pytest.raises(ValueError, match="hashed keys"):
        tensor.anchor_at(0.5)
    with pytest.raises(ValueError, match=r"compares state texts, got 3 \(int\)"):
        cluster_leaders(["a", 3], 0.5)
    with pytest.raises(ValueError, match="2 texts but 1 groups"):
        similar_anchor_keys(["a", "b"], [0], 0.5)


def test_too_many_distinct_texts_fail_before_any_comparison(monkeypatch):
    monkeypatch.setattr(similarity, "MAX_DISTINCT", 3)
    monkeypatch.setattr(similarity, "SequenceMatcher", None)  # a comparison would raise TypeError
    with pytest.raises(ValueError, match="4 distinct state texts, more than 3"):
        cluster_leaders(["a", "b", "c", "d", "a"], 0.5)
    assert cluster_leaders(["a", "b", "c", "a"], 0.0) == dict.fromkeys("abc", "a")


def test_state_texts_survive_with_extras():
    steps = drawer_batch().with_extras({"x": [1.0, 2.0, 3.0, 4.0]})
    assert steps.anchor_at(0.95)[1] == 3


# ---- the record: which estimators read state texts -------------------------------------------------------------
def test_reads_state_text_follows_the_threshold():
    assert not gigpo.reads_state_text() and not gigpo.reads_state_text(similarity_thresh=1.0)
    assert gigpo.reads_state_text(similarity_thresh=0.9) and cp.get("mvpo").reads_state_text(similarity_thresh=0)
    assert cp.get("uniopsd").reads_state_text(similarity_thresh=0.95)
    assert not cp.get("grpo").reads_state_text() and not cp.get("graphhca").reads_state_text()
    mix = cp.get("mix")
    assert not mix.reads_state_text()
    assert mix.reads_state_text(parts={"grpo": 0.5, "gigpo": 0.5}, params={"gigpo": {"similarity_thresh": 0.9}})
    assert not mix.reads_state_text(parts={"grpo": 1.0, "gigpo": 0}, params={"gigpo": {"similarity_thresh": 0.9}})
    with pytest.raises(ValueError, match="similarity_thresh"):
        gigpo.reads_state_text(similarity_thresh=2.0)
    with pytest.raises(ValueError, match="similarity='nope' is not a field of GiGPOParams"):
        cp.Estimator(name="x", fn=None, params=GiGPOParams, paper="-", formula="-", similarity="nope")
