"""verl honours ``similarity_thresh`` from the algorithm config: the agent loop's ``anchor_key`` texts reach the
StepTable unhashed, so the estimator merges near-identical states (v1 path: RowMeta.from_v1 + adapter.publish)."""

import numpy as np
import pytest
import torch

pytest.importorskip("verl", reason="the [verl] extra is not installed")

from omegaconf import OmegaConf  # noqa: E402

from agentcredit.verl import adapter  # noqa: E402
from agentcredit.verl.contract import RowMeta  # noqa: E402
import credit_plugins as cp  # noqa: E402
from credit_plugins.hashing import stable_hash  # noqa: E402
from tests.helpers.similar_anchors import TEXTS, expected_gigpo  # noqa: E402

pytestmark = pytest.mark.verl

def run(name, anchors, **params):
    """tests/helpers/similar_anchors.py's two rollouts of task "a" (rollout 0 scores 1, rollout 1 scores 0; verl
    puts the score on the last step), anchors given per row."""
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
    assert run("gigpo", TEXTS).tolist() == pytest.approx(expected_gigpo(merged=False))
    assert run("gigpo", TEXTS, similarity_thresh=0.95).tolist() == pytest.approx(expected_gigpo(merged=True))
    assert torch.equal(run("gigpo", TEXTS, similarity_thresh=1.0), run("gigpo", TEXTS))


def test_hashed_anchor_keys_are_refused_with_the_fix():
    anchors = [stable_hash(a) for a in TEXTS]
    with pytest.raises(ValueError, match="similarity_thresh=0.95 merges states by their text.*pass the state texts"):
        run("gigpo", anchors, similarity_thresh=0.95)
    with pytest.raises(ValueError, match="similarity_thresh"):
        run("gigpo", TEXTS, similarity_thresh=1.5)
