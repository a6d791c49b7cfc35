"""SPrPO's verl configuration (:mod:`agentcredit.verl.sprpo`): ``algorithm.agentcredit_sprpo`` is checked at start-up
by the preflight, with the term's own parameter rules. The real run (perturbed actor forward, measured sensitivity,
controller state through checkpoint and resume) is ``tests/verl/test_verl_e2e.py``'s MVPO checkpoint test."""

from __future__ import annotations

import pytest

pytest.importorskip("verl")

from omegaconf import OmegaConf  # noqa: E402

from agentcredit.verl import sprpo  # noqa: E402
from agentcredit.verl.preflight import BLOCKS, check_config  # noqa: E402


def _check(block):
    check_config(OmegaConf.create({"algorithm": {"adv_estimator": "gigpo", "agentcredit_sprpo": block},
                                   "trainer": {"total_training_steps": 10}}))


def test_the_block_is_an_agentcredit_entry_and_gives_the_terms_params():
    assert sprpo.CONFIG_KEY in BLOCKS
    p = sprpo.sprpo_params(OmegaConf.create({"agentcredit_sprpo": {"sigma": 0.2, "layers": [0, -1]}}))
    assert p.sigma == 0.2 and list(p.layers) == [0, -1]
    assert sprpo.sprpo_params(OmegaConf.create({})) is None
    _check({"sigma": 0.1})


@pytest.mark.parametrize("block, words", [
    ({"sigma": -1.0}, "algorithm.agentcredit_sprpo: term 'sprpo': sigma=-1.0"),
    ({"kl_max": 1e-4}, "kl_max=0.0001 is below target_kl"),
    ({"sigmaa": 0.1}, "sigmaa"),
    (0.1, "must be a mapping of the sprpo term's parameters"),
])
def test_a_bad_block_fails_at_start_naming_the_key(block, words):
    with pytest.raises(ValueError) as e:
        _check(block)
    assert words in str(e.value)
