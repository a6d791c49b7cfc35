"""verl honours ``similarity_thresh`` from the algorithm config: the agent loop's ``anchor_key`` texts reach the
StepTable unhashed, so the estimator merges near-identical states (v1 path: RowMeta.from_v1 + adapter.publish)."""

import math

import numpy as np
import pytest
import torch

pytest.importorskip("verl", reason="the [verl] extra is not installed")

from omegaconf import OmegaConf  # noqa: E402

from agentcredit.verl import adapter  # noqa: E402
from agentcredit.verl.contract import RowMeta  # noqa: E402
import credit_plugins as cp  # noqa: E402
from credit_plugins.hashing import stable_hash  # noqa: E402

pytestmark = pytest.mark.verl

DRAWER2, DRAWER3 = "You see a cabinet 1 and a drawer 2.", "You see a cabinet 1 and a drawer 3."  # ratio 68/70


def run(name, anchors, **params):
    """Two rollouts of task "a" (rollout 0 scores 1 at t=1, rollout 1 scores 0), anchors given per row."""
    keys = ["a_0_0", "a_0_1", "a_1_0", "a_1_1"]
    meta = RowMeta.from_v1(keys, None, [{"anchor_key": k} for k in anchors])
    rewards = torch.zeros(4, 3)
    rewards[:2, -1] = 1.0  # verl copies the trajectory's score to each of its rows
    mask = torch.ones(4, 3)
    config = OmegaConf.create({"adv_estimator": name, name: params})
    fn = adapter.make_verl_estimator(cp.get(name))
    with adapter.publish(meta):
        adv, _ = fn(token_level_rewards=rewards, response_mask=mask, index=np.array(["a"] * 4, dtype=object),
                    config=config)
    return adv[:, 0]


def test_gigpo_merges_near_identical_anchor_texts_on_verl():
    a_e = 0.5 / (math.sqrt(1 / 3) + 1e-6)  # episode term over steps: returns [1, 1, 0, 0]
    a_s = 0.475 / (0.475 * math.sqrt(2) + 1e-6)  # the merged t=0 anchor: R_0 = [0.95, 0]
    anchors = [DRAWER2, "x", DRAWER3, "y"]
    assert run("gigpo", anchors).tolist() == pytest.approx([a_e, a_e, -a_e, -a_e])
    assert run("gigpo", anchors, similarity_thresh=0.95).tolist() == pytest.approx([a_e + a_s, a_e, -a_e - a_s, -a_e])
    assert torch.equal(run("gigpo", anchors, similarity_thresh=1.0), run("gigpo", anchors))


def test_hashed_anchor_keys_are_refused_with_the_fix():
    anchors = [stable_hash(a) for a in (DRAWER2, "x", DRAWER3, "y")]
    with pytest.raises(ValueError, match="similarity_thresh=0.95 merges states by their text.*pass the state texts"):
        run("gigpo", anchors, similarity_thresh=0.95)
    with pytest.raises(ValueError, match="similarity_thresh"):
        run("gigpo", [DRAWER2, "x", DRAWER3, "y"], similarity_thresh=1.5)
