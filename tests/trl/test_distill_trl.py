"""The TRL distillation mixin (agentcredit.trl.distill) inside TRL 1.16's real GRPOTrainer on tiny models built in code."""

from __future__ import annotations

import math
import os

import pytest
import torch

trl = pytest.importorskip("trl")

from agentcredit.trl import make_trainer  # noqa: E402
from agentcredit.trl.distill import DistillMixin, check_same_vocabulary  # noqa: E402
from tests.helpers.trl_runs import losses, train_plain  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """The tiny Qwen2 with perturbed weights: same tokenizer, a different distribution (δ ≠ 0)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentcredit.models import resolve_model

    path = resolve_model("tiny-qwen2")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=gen))
    out = tmp_path_factory.mktemp("teacher")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(path).save_pretrained(out)
    return str(out)


def _log(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


class _Recording:
    """Keeps what the mixin combined in each round (the real tensors, not a copy of its arithmetic)."""

    def _ac_combine(self, output, out, mask, lp_t, lp_old, estimator):
        before = output["advantages"].clone()
        super()._ac_combine(output, out, mask, lp_t, lp_old, estimator)
        self.rounds = getattr(self, "rounds", []) + [dict(
            adv_rl=before, adv=output["advantages"].clone(), lp_t=lp_t, lp_old=lp_old, mask=mask.clone(), out=out,
            ids=torch.cat([output["prompt_ids"], output["completion_ids"]], 1),
            att=torch.cat([output["prompt_mask"], output["completion_mask"]], 1), T=output["completion_ids"].size(1))]


def _recording(cls):
    return type("Rec" + cls.__name__, (_Recording, cls), {})


# ---- advantage mode --------------------------------------------------------------------------------------------
def test_fixed_mix_advantage_is_w_rl_a_rl_plus_w_opd_teacher_log_ratio(tmp_path, teacher_dir):
    """With adv_scale=batch_rms: A_RL reaches the combination already scaled (rms 1 over the rows), δ unscaled."""
    from transformers import AutoModelForCausalLM

    cls = _recording(make_trainer(credit="grpo", schedule="fixed", schedule_params={"w_opd": 0.5, "w_rl": 2.0},
                                  teacher=teacher_dir, adv_scale="batch_rms"))
    trainer = train_plain(cls, str(tmp_path), steps=2, bf16=False)  # fp32 throughout: the check below is exact
    assert len(trainer.rounds) == 2
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    for r in trainer.rounds:
        m = r["mask"].float()
        expected = (2.0 * r["adv_rl"] + 0.5 * (r["lp_t"] - r["lp_old"])) * m
        torch.testing.assert_close(r["adv"], expected, rtol=0, atol=1e-6)
        per_row = torch.stack([row[keep][0] for row, keep in zip(r["adv_rl"], r["mask"])]).double()
        assert per_row.square().mean().sqrt().item() == pytest.approx(1.0, rel=1e-4)
        # the teacher scored exactly the sampled tokens, at the trainer's temperature
        with torch.no_grad():
            logits = teacher(input_ids=r["ids"], attention_mask=r["att"]).logits[:, -r["T"] - 1:-1]
        lp = torch.log_softmax(logits / trainer.temperature, -1).gather(-1, r["ids"][:, -r["T"]:, None])[..., 0]
        torch.testing.assert_close(r["lp_t"] * m, lp * m, rtol=1e-4, atol=1e-4)
        assert float(((r["lp_t"] - r["lp_old"]).abs() * m).sum()) > 0  # the teacher really differs
    assert _log(trainer, "agentcredit/w_opd") == [0.5, 0.5]
    factors = _log(trainer, "agentcredit/adv_scale_factor")
    assert len(factors) == 2 and all(f > 0 and f != pytest.approx(1.0) for f in factors)
    gap = _log(trainer, "agentcredit/gap_mean")
    assert len(gap) == 2 and all(g < 0 for g in gap)  # the student's own samples are likelier under the student


def test_w_opd_zero_reproduces_the_credit_mixin_exactly(tmp_path, teacher_dir):
    plain = losses(train_plain(make_trainer(credit="grpo", eps=1e-4), str(tmp_path / "plain")))
    mixed = losses(train_plain(make_trainer(credit="grpo", eps=1e-4, schedule="fixed",
                                            schedule_params={"w_opd": 0.0, "w_rl": 1.0}, teacher=teacher_dir),
                               str(tmp_path / "mixed")))
    assert len(plain) == len(mixed) == 3
    for (l1, g1), (l2, g2) in zip(plain, mixed):
        assert (l2, g2) == pytest.approx((l1, g1), rel=1e-6, abs=1e-7)


def test_tide_runs_its_handoff_on_the_measured_disagreement(tmp_path, teacher_dir):
    cls = _recording(make_trainer(credit="grpo", schedule="tide", teacher=teacher_dir,
                                  schedule_params={"window": 2, "zeta": 10.0, "eta": 0.25}))
    trainer = train_plain(cls, str(tmp_path), steps=3)
    g = _log(trainer, "agentcredit/tide/G")
    gap = _log(trainer, "agentcredit/gap_abs_mean")
    assert len(g) == 3 and g == pytest.approx(gap, rel=1e-6)  # one row per prompt here: turn mean = token mean
    r = _log(trainer, "agentcredit/tide/r")
    lam, beta = _log(trainer, "agentcredit/w_opd"), _log(trainer, "agentcredit/w_rl")
    assert all(b >= a for a, b in zip(r, r[1:]))  # the handoff never goes back
    for ri, li, bi in zip(r, lam, beta):
        assert li == pytest.approx(0.1 + 0.9 * (1 - ri)) and bi == pytest.approx(0.1 + 0.9 * ri)
    for rnd in trainer.rounds:  # no local weights without the turn-row layout: the global weights only
        assert rnd["out"].token_weights is None


# ---- loss mode ---------------------------------------------------------------------------------------------------
def test_loss_mode_with_no_rl_term_is_the_opd_loss_alone(tmp_path, teacher_dir):
    trainer = train_plain(make_trainer(credit="grpo", schedule="fixed", teacher=teacher_dir, schedule_params={
        "combine": "loss", "estimator": "reverse_kl", "w_opd": 0.5, "w_rl": 0.0}), str(tmp_path), steps=2,
        loss_type="dapo")
    loss, rkl = _log(trainer, "loss"), _log(trainer, "agentcredit/opd_reverse_kl")
    assert len(loss) == 2 and all(x > 0 for x in rkl)
    assert loss == pytest.approx([0.5 * x for x in rkl], rel=1e-4)
    assert _log(trainer, "entropy") == []  # TRL's own forward was skipped: one student forward per micro-batch


def test_opw_warms_up_on_top1_ce_then_hands_off_to_rl_once(tmp_path, teacher_dir):
    trainer = train_plain(make_trainer(credit="grpo", schedule="opw", teacher=teacher_dir,
                                       schedule_params={"warmup_steps": 2}), str(tmp_path), steps=4,
                          loss_type="dapo")
    assert _log(trainer, "agentcredit/w_opd") == [1.0, 1.0, 0.0, 0.0]
    assert _log(trainer, "agentcredit/w_rl") == [0.0, 0.0, 1.0, 1.0]
    ce = _log(trainer, "agentcredit/opd_top1_ce")
    assert len(ce) == 2 and _log(trainer, "loss")[:2] == pytest.approx(ce, rel=1e-4)
    assert trainer.scheduler.state_dict()["state"]["switched_at"] == 2
    assert _log(trainer, "agentcredit/gap_abs_mean") == []  # OPW never needed the round-level teacher pass


def test_lsd_routes_solved_groups_to_the_ema_teacher(tmp_path):
    from agentcredit.models import resolve_model
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-qwen2"), dtype=torch.float32).state_dict()
    # reward > 0 for most completions: with tau 0.5 most groups are "easy"
    trainer = train_plain(make_trainer(credit="grpo", schedule="lsd", teacher="ema",
                                       schedule_params={"tau": 0.5, "ema_start": 1, "half_life": 1.0}),
                          str(tmp_path), steps=3, loss_type="dapo")
    share = _log(trainer, "agentcredit/lsd/easy_seq_share")
    assert len(share) == 3 and any(s > 0 for s in share)
    assert _log(trainer, "agentcredit/lsd/ema_updates") == [0.0, 1.0, 2.0]
    ema = trainer._ac_teacher_raw.state_dict()
    student = trainer.model.state_dict()
    key = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(ema[key], start[key])     # the EMA moved after ema_start updates
    assert not torch.equal(ema[key], student[key])   # and lags the student


def test_lsd_without_ema_updates_keeps_the_initial_weights(tmp_path):
    from agentcredit.models import resolve_model
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-qwen2"), dtype=torch.float32).state_dict()
    trainer = train_plain(make_trainer(credit="grpo", schedule="lsd", teacher="ema",
                                       schedule_params={"tau": 0.5, "ema_start": 100}), str(tmp_path), steps=2)
    ema = trainer._ac_teacher_raw.state_dict()
    assert all(torch.equal(ema[k], start[k]) for k in start)


# ---- checkpoint and resume -------------------------------------------------------------------------------------
def test_resume_from_checkpoint_gives_the_uninterrupted_weights(tmp_path, teacher_dir):
    params = {"window": 2, "zeta": 10.0, "eta": 0.25, "mu": 0.5}
    cls = make_trainer(credit="grpo", schedule="tide", teacher=teacher_dir, schedule_params=params)
    full = train_plain(cls, str(tmp_path / "full"), steps=4, save_strategy="steps", save_steps=2)
    assert os.path.exists(tmp_path / "full" / "checkpoint-2" / "agentcredit_scheduler.pt")
    resumed = train_plain(cls, str(tmp_path / "full"), steps=4, resume="checkpoint-2", save_strategy="no")
    keys = ("agentcredit/w_opd", "agentcredit/w_rl", "agentcredit/tide/r")
    for key in keys:
        a, b = _log(full, key), _log(resumed, key)
        assert len(a) == len(b) == 4, key  # the resumed log_history holds the checkpoint's two steps, then its own
        assert b[2:] == pytest.approx(a[2:], abs=1e-9), key
    sa, sb = full.scheduler.state_dict(), resumed.scheduler.state_dict()
    assert sa["last_step"] == sb["last_step"] == 3 and sa["state"]["k"] == sb["state"]["k"] == 4
    assert sb["state"]["m_hist"] == pytest.approx(sa["state"]["m_hist"], rel=1e-5)
    assert _log(resumed, "agentcredit/tide/m")[2:] == pytest.approx(_log(full, "agentcredit/tide/m")[2:], rel=1e-5)


def test_resume_refuses_a_checkpoint_without_scheduler_state(tmp_path, teacher_dir):
    train_plain(make_trainer(credit="grpo"), str(tmp_path), steps=2, save_strategy="steps", save_steps=2)
    cls = make_trainer(credit="grpo", schedule="opw", teacher=teacher_dir)
    with pytest.raises(ValueError, match="agentcredit_scheduler.pt"):
        train_plain(cls, str(tmp_path), steps=3, resume="checkpoint-2")


# ---- bad input: clear errors at start-up, named NaN --------------------------------------------------------------
def test_teacher_with_another_vocabulary_fails_at_start_up(tmp_path):
    from agentcredit.models import build_tiny_qwen2

    other = tmp_path / "other-vocab"
    build_tiny_qwen2(other, vocab_size=600, seed=3)
    cls = make_trainer(credit="grpo", schedule="fixed", teacher=str(other))
    with pytest.raises(ValueError, match="different vocabularies|tokenizers differ"):
        train_plain(cls, str(tmp_path / "run"), steps=1)


def test_check_same_vocabulary_compares_tokenizers_too(teacher_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(teacher_dir)
    tok = AutoTokenizer.from_pretrained(teacher_dir)
    check_same_vocabulary(model, model, tok, tok)
    other = AutoTokenizer.from_pretrained(teacher_dir)
    other.add_tokens(["<extra_token_for_test>"])
    with pytest.raises(ValueError, match="tokenizers differ"):
        check_same_vocabulary(model, model, tok, other)


def test_nan_in_the_teacher_is_caught_and_named(tmp_path, teacher_dir):
    from transformers import AutoModelForCausalLM

    bad = AutoModelForCausalLM.from_pretrained(teacher_dir)
    with torch.no_grad():
        bad.model.norm.weight.fill_(float("nan"))
    cls = make_trainer(credit="grpo", schedule="fixed")
    with pytest.raises(ValueError, match="teacher log-probs .* NaN/inf at \\d+ response token"):
        train_plain(cls, str(tmp_path), steps=1, trainer_kwargs={"teacher_model": bad})


def test_make_trainer_schedule_errors_come_before_any_model():
    with pytest.raises(ValueError, match="tide"):  # lists the registered schedulers
        make_trainer(credit="grpo", schedule="tidee")
    with pytest.raises(ValueError, match="warmup_step"):
        make_trainer(credit="grpo", schedule="opw", schedule_params={"warmup_step": 3})
    with pytest.raises(ValueError, match="need a schedule"):
        make_trainer(credit="grpo", teacher="x")
    cls = make_trainer(credit="gigpo", schedule="opw", teacher="t", gamma=0.9)
    assert issubclass(cls, DistillMixin) and cls.__mro__[1] is DistillMixin and cls.teacher == "t"


def test_a_schedule_without_teacher_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="needs a teacher"):
        train_plain(make_trainer(credit="grpo", schedule="fixed"), str(tmp_path), steps=1)


# ---- composed with the credit mixin and the turn-row rollout (TIDE's local weights) -------------------------------
def test_tide_local_turn_weights_with_gigpo_on_turn_rows(tmp_path, teacher_dir):
    from datasets import Dataset  # noqa: F401 - TurnRollout.dataset builds one
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from agentcredit.trl.rollouts import TurnRollout

    tok = AutoTokenizer.from_pretrained(teacher_dir)
    from agentcredit.models import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-qwen2"), dtype=torch.float32)
    env_options = {"size": 5, "moves": "absolute", "view": "coords"}
    rollout = TurnRollout("minigrid", env_options, max_turns=2, max_new_tokens=4, prompt="compact")
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=2, num_generations=8, per_device_train_batch_size=8,
                      max_completion_length=8, report_to="none", logging_steps=1, use_cpu=True, bf16=False,
                      save_strategy="no", disable_tqdm=True)
    cls = _recording(make_trainer(credit="gigpo", schedule="tide", teacher=teacher_dir))
    trainer = cls(model=model, processing_class=tok, reward_funcs=[rollout.reward_func], rollout_func=rollout,
                  train_dataset=TurnRollout.dataset(range(8)), args=args)
    trainer.train()
    assert len(trainer.rounds) == 2
    for rnd in trainer.rounds:
        out = rnd["out"]
        assert out.token_weights is not None and out.token_weights_rl is not None
        m = rnd["mask"].float()
        assert bool(((out.token_weights >= 0) & (out.token_weights <= 1 + 1e-6)).all())
        expected = (out.w_rl * out.token_weights_rl * rnd["adv_rl"]
                    + out.w_opd * out.token_weights * (rnd["lp_t"] - rnd["lp_old"])) * m
        torch.testing.assert_close(rnd["adv"], expected, rtol=0, atol=1e-6)
    assert all(math.isfinite(x) for x in _log(trainer, "loss"))
