"""The TRL bridge honours ``similarity_thresh``: rollouts record each state's text, and the mixin builds the
StepTable's state column from the texts (the same keys once hashed) for an estimator that compares them."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

pytest.importorskip("trl")

import credit_plugins as cp  # noqa: E402
from credit_plugins.hashing import stable_hash  # noqa: E402
from credit_plugins.similarity import similar_anchor_keys  # noqa: E402
from tests.helpers.similar_anchors import REWARDS, TEXTS, expected_gigpo  # noqa: E402
from agentcredit.trl.credit import (CreditMixin, StepRow, _step_rows_from_envs, _step_rows_per_turn,  # noqa: E402
                                   _step_rows_plain)


class _Env:
    def __init__(self, turns, final_text):
        self.agentcredit_turns, self.agentcredit_final_state = turns, stable_hash(final_text)
        self.agentcredit_final_state_text = final_text
        self.agentcredit_success, self.agentcredit_done = True, True


def test_env_records_carry_their_state_texts_only_when_asked():
    rec = [{"state": stable_hash("room a"), "state_text": "room a", "action": 5, "reward": 0.0, "valid": True}]
    env = _Env(rec, "room b")
    rows = _step_rows_from_envs([env], torch.tensor([1.0]), [2], texts=True)
    assert [(r.state, r.state_text) for r in rows] == [(stable_hash("room a"), "room a"),
                                                     (stable_hash("room b"), "room b")]  # the final answer's state
    assert [r.state_text for r in _step_rows_from_envs([env], torch.tensor([1.0]), [2])] == [None, None]
    plain = _step_rows_plain(["p0"], torch.tensor([1.0]), texts=True)
    assert plain[0].state_text == repr("p0") and plain[0].state == stable_hash(repr("p0"))


def test_the_state_column_is_the_texts_exactly_when_the_estimator_compares_them():
    rows = [StepRow(row=0, turn=0, traj=0, t=0, state=stable_hash("s"), action=-1, reward=0.0, success=False,
                    truncated=False, state_text="s")]
    wants = types.SimpleNamespace(_agentcredit_texts=True, credit="gigpo")
    assert CreditMixin._agentcredit_states(wants, rows) == ["s"]
    assert CreditMixin._agentcredit_states(types.SimpleNamespace(_agentcredit_texts=False), rows) == [rows[0].state]
    with pytest.raises(ValueError, match="gave step 0 of row -1 no state text.*TurnRollout"):
        CreditMixin._agentcredit_states(wants, [dataclasses.replace(rows[0], state_text=None)])


def test_turn_rows_with_near_identical_state_texts_share_an_anchor():
    """Turn rows as TurnRollout writes them (tests/helpers/similar_anchors.py's case) through the mixin's row
    collection and table: at 0.95 the two first observations are one anchor, with GiGPO's hand-computed advantages."""
    inputs = [{"agentcredit_traj": traj, "agentcredit_t": t, "agentcredit_state": stable_hash(text),
               "agentcredit_state_text": text, "agentcredit_action": -1, "agentcredit_success": traj == 0,
               "agentcredit_truncated": False, "agentcredit_valid": True}
              for (traj, t), text in zip([(0, 0), (0, 1), (1, 0), (1, 1)], TEXTS)]

    class Bare(CreditMixin):
        credit, credit_params = "gigpo", {"similarity_thresh": 0.95}

    bare = object.__new__(Bare)  # no trainer: only the table-building methods run
    bare._agentcredit_texts = cp.get("gigpo").reads_state_text(**Bare.credit_params)
    rows = [r.placed(0, 4, 4) for r in _step_rows_per_turn(inputs, torch.tensor(REWARDS), True)]
    steps = bare._agentcredit_table(None, rows, inputs, "train")
    assert steps.anchor[1] == 4 and steps.anchor_at(0.95)[1] == 3
    assert cp.get("gigpo")(steps, similarity_thresh=0.95).tolist() == pytest.approx(expected_gigpo(merged=True))


def test_a_real_grpo_step_builds_the_table_from_state_texts(tmp_path):
    """One GRPOTrainer step on MiniGrid (TurnRollout) with gigpo(similarity_thresh=0.9): the estimator ran on the
    env's state texts (it raises without them), whose hashes are the rollout's state keys."""
    from tests.helpers.trl_runs import train_turn_rollout_step

    seen = train_turn_rollout_step("gigpo", {"similarity_thresh": 0.9}, str(tmp_path), max_turns=3)
    steps = seen[0]
    texts = [steps._state_values[int(i)] for i in steps.order]
    assert all(isinstance(s, str) and s.startswith("You are at row") for s in texts)
    assert torch.equal(steps.state, torch.tensor([stable_hash(s) for s in texts]))
    # the same advantages as exact anchors on the cluster leaders' keys (credit_plugins.similarity's pure function)
    leaders = similar_anchor_keys(texts, steps.group.numpy(), 0.9)
    keyed = cp.StepTable(group=steps.group, traj=steps.traj, t=steps.t, reward=steps.reward, state=leaders,
                         success=steps.success, truncated=steps.truncated)
    assert torch.equal(cp.get("gigpo")(steps, similarity_thresh=0.9), cp.get("gigpo")(keyed))
