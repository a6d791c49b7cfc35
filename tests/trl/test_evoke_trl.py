"""EVOKE on TRL (agentcredit.trl.evoke): real GRPOTrainer steps on the tiny model: the term enters the loss, its
metrics are logged, its gradient reaches the weights, its sampling state survives resume; refusals."""

import os
import shutil

import pytest
import torch

pytest.importorskip("trl")

from agentcredit.trl.evoke import score_groups  # noqa: E402
from distill_plugins.evoke import evoke_loss  # noqa: E402
from tests.helpers.trl_runs import turn_rollout_trainer  # noqa: E402


def _evoke_trainer(evoke: dict, output_dir, **kwargs):
    from trl import GRPOTrainer

    from agentcredit.trl import make_trainer

    rounds = []

    class Spy(make_trainer(GRPOTrainer, credit="grpo", terms={"evoke": evoke})):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            rounds.append([[dict(g) for g in chunk] for chunk in self._evoke_chunks])
            return out

    trainer = turn_rollout_trainer(Spy, str(output_dir), **kwargs)
    return trainer, rounds


def _logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


def test_evoke_term_is_added_to_the_loss_and_trains_the_policy(tmp_path):
    runs = {}
    for w in (0.0, 1.0):  # same rollouts and states (seeded); weight 0 only measures
        trainer, rounds = _evoke_trainer({"weight": w, "states": 3, "goals": 2}, tmp_path / str(w))
        trainer.train()
        runs[w] = trainer, rounds
    (t0, r0), (t1, r1) = runs[0.0], runs[1.0]
    assert r0 == r1 and sum(len(c) for c in r1[0]) >= 3  # 3 states, 1-2 goals each: same groups in both runs
    assert _logged(t1, "agentcredit_evoke/states") == [3.0]
    for key in ("agentcredit_evoke/rank_acc", "agentcredit_evoke/top1_acc"):
        assert 0.0 <= _logged(t1, key)[0] <= 1.0
    term = _logged(t1, "agentcredit_evoke/loss")[0]
    assert term > 0 and _logged(t0, "agentcredit_evoke/loss")[0] == pytest.approx(term, rel=1e-5)
    # loss = L_RL + 1.0 * L_EVOKE (one micro-batch per step): the two runs differ by exactly the term
    assert _logged(t1, "loss")[0] - _logged(t0, "loss")[0] == pytest.approx(term, rel=1e-4)
    assert _logged(t1, "grad_norm")[0] != pytest.approx(_logged(t0, "grad_norm")[0])
    # the term alone has a gradient on the weights, through the rewritten prompts' candidate answers
    model = t1.model
    model.zero_grad()
    scores, values, mask = t1._evoke_scores(model, t1._evoke_chunks[0])
    # the same scores as a plain forward of the evaluation path (TRL's fused head and padding change nothing)
    plain, plain_values, plain_mask = score_groups(model, t1._evoke_chunks[0], t1.processing_class.pad_token_id)
    assert torch.equal(mask, plain_mask) and torch.equal(values, plain_values)
    assert torch.allclose(scores.detach()[mask], plain[mask], atol=1e-4)
    evoke_loss(scores, values, mask).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads) and sum(float(g.abs().sum()) for g in grads) > 0


def test_evoke_sampling_state_survives_resume(tmp_path):
    opts = dict(env="synthetic", env_options={"family": "rooms"}, rollout_options={"max_new_tokens": 8},
                max_completion_length=8, save_strategy="steps", save_steps=1, max_steps=2)
    full, full_rounds = _evoke_trainer({"states": 2, "goals": 2, "loss": "pairwise"}, tmp_path / "full", **opts)
    full.train()
    assert os.path.exists(tmp_path / "full" / "checkpoint-1" / "agentcredit_evoke.pt")
    resumed, resumed_rounds = _evoke_trainer({"states": 2, "goals": 2, "loss": "pairwise"}, tmp_path / "resumed",
                                             **opts)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-1"))
    assert len(full_rounds) == 2 and len(resumed_rounds) == 1
    assert resumed_rounds[0] == full_rounds[1]  # the second round's states and goals, drawn as without the stop
    assert resumed._evoke_rng.getstate() == full._evoke_rng.getstate()
    # a checkpoint without the term's state is refused instead of restarting its stream
    bare = tmp_path / "bare"
    shutil.copytree(tmp_path / "full" / "checkpoint-1", bare)
    os.remove(bare / "agentcredit_evoke.pt")
    again, _ = _evoke_trainer({"states": 2}, tmp_path / "again", **opts)
    with pytest.raises(ValueError, match="agentcredit_evoke.pt"):
        again.train(resume_from_checkpoint=str(bare))


def test_evoke_refuses_what_it_cannot_run(tmp_path):
    from trl import GRPOTrainer

    from agentcredit.trl import make_trainer

    cls = make_trainer(GRPOTrainer, credit="grpo", terms={"evoke": {}})
    with pytest.raises(ValueError, match="TurnRollout"):
        cls(model="unused", reward_funcs=[], args=None)
    with pytest.raises(ValueError, match="task='goal'"):
        turn_rollout_trainer(cls, str(tmp_path), env_options={"size": 5, "task": "doorkey"})
    with pytest.raises(ValueError, match="goals"):
        make_trainer(GRPOTrainer, credit="grpo", terms={"evoke": {"goals": 0}})


def test_evoke_recipe_block_is_checked():
    from agentcredit.recipe import RecipeError, check_terms
    from credit_plugins import registry
    from distill_plugins.terms.evoke import SPEC

    assert registry.get("evoke", kind="terms") is SPEC
    assert check_terms({"evoke": None}) == {"evoke": {}}
    with pytest.raises(RecipeError, match=r"agentcredit.terms.evoke: .*goals"):
        check_terms({"evoke": {"goals": 0}})
