"""SPrPO on TRL (:mod:`agentcredit.trl.sprpo`): real GRPOTrainer steps on the tiny model with the term on, the noise
active in the loss's forward only, the metrics logged, the trust-region guard, and the controller state through
checkpoint and resume."""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")

from agentcredit.trl import make_trainer  # noqa: E402
from distill_plugins.sprpo import decoder_layers  # noqa: E402
from tests.helpers.trl_runs import train_plain  # noqa: E402


def _logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


def test_noise_is_on_in_the_loss_forward_only_and_the_controller_logs(tmp_path):
    cls = make_trainer(trl.GRPOTrainer, credit="grpo", terms={"sprpo": {"sigma": 0.2, "kl_max": 10.0}})
    trainer = train_plain(cls, str(tmp_path), steps=2, save_strategy="steps", save_steps=1)
    n_layers = len(decoder_layers(trainer.model))
    # one micro-batch per step: the loss's forward perturbs every layer once; generation (many forwards) is clean
    assert _logged(trainer, "agentcredit_sprpo/perturbed_forwards") == [n_layers, n_layers]
    sigmas, sens = _logged(trainer, "agentcredit_sprpo/sigma"), _logged(trainer, "agentcredit_sprpo/sensitivity")
    assert sigmas[0] == pytest.approx(0.2) and len(sens) == 2 and all(d > 0 for d in sens)
    c = trainer.sprpo
    assert c.step == 2 and c.sigma == pytest.approx(
        min(max(sigmas[1] * min(max((0.01 / sens[1]) ** 0.5, 0.5), 2.0), 1e-3), 1.0))  # the controller's update
    assert all(not layer._forward_hooks for layer in decoder_layers(trainer.model))
    saved = torch.load(tmp_path / "checkpoint-1" / "agentcredit_sprpo.pt", weights_only=True)
    assert saved["term"] == "sprpo" and saved["state"]["step"] == 1 and saved["state"]["sigma"] == pytest.approx(
        sigmas[1])

    # resume from step 1: the restored controller continues with the checkpoint's sigma, step and noise stream, so
    # step 2 measures what the uninterrupted run measured
    resumed = train_plain(cls, str(tmp_path), steps=2, resume="checkpoint-1")
    assert _logged(resumed, "agentcredit_sprpo/sigma")[-1] == pytest.approx(sigmas[1])
    assert _logged(resumed, "agentcredit_sprpo/sensitivity")[-1] == pytest.approx(sens[1], rel=1e-5)
    assert resumed.sprpo.step == 2 and resumed.sprpo.sigma == pytest.approx(c.sigma, rel=1e-5)
    (tmp_path / "checkpoint-1" / "agentcredit_sprpo.pt").unlink()
    with pytest.raises(ValueError, match="has no agentcredit_sprpo.pt"):
        train_plain(cls, str(tmp_path), steps=2, resume="checkpoint-1")


def test_a_step_over_the_hard_bound_trains_clean(tmp_path):
    cls = make_trainer(trl.GRPOTrainer, credit="grpo",
                       terms={"sprpo": {"sigma": 5.0, "sigma_max": 10.0, "target_kl": 1e-6, "kl_max": 1e-6}})
    trainer = train_plain(cls, str(tmp_path), steps=1)
    assert trainer.sprpo.rejected == 1 and _logged(trainer, "agentcredit_sprpo/rejected") == [1.0]
    assert trainer.sprpo.sigma == pytest.approx(2.5)  # the controller still halves sigma (factor 1/max_change)


def test_bad_term_settings_fail_before_training(tmp_path):
    with pytest.raises(ValueError, match="kl_max"):
        make_trainer(trl.GRPOTrainer, terms={"sprpo": {"kl_max": 1e-5}})
    cls = make_trainer(trl.GRPOTrainer, terms={"sprpo": {"layers": [99]}})
    with pytest.raises(ValueError, match="out of range"):
        train_plain(cls, str(tmp_path), steps=1)
