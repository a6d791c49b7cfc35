"""The TRL bridge (agentcredit.trl) against TRL 1.16's real GRPOTrainer on a tiny model built in code."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys

import pytest
import torch

trl = pytest.importorskip("trl")

import credit_plugins  # noqa: E402
from credit_plugins.hashing import stable_hash  # noqa: E402
from agentcredit.trl.credit import (CreditMixin, TRLInternalsChanged, _step_rows_from_envs, check_trl,  # noqa: E402
                                make_trainer, turn_ids_from_mask)
from tests.helpers.trl_runs import losses, train_plain  # noqa: E402

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_turn_ids_from_mask_numbers_runs_of_model_tokens():
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 0, 1], [1, 1, 1, 1, 0, 0, 0, 0]])
    assert turn_ids_from_mask(mask).tolist() == [[-1, 0, 0, -1, -1, 1, -1, 2], [0, 0, 0, 0, -1, -1, -1, -1]]


def test_check_trl_accepts_the_pinned_trl_and_names_a_missing_hook():
    check_trl()

    class Renamed(trl.GRPOTrainer):
        _calculate_rewards = None

    with pytest.raises(TRLInternalsChanged, match="_calculate_rewards"):
        check_trl(Renamed)


def test_make_trainer_validates_before_any_model_is_loaded():
    cls = make_trainer(trl.GRPOTrainer, credit="gigpo", gamma=0.9)
    assert issubclass(cls, trl.GRPOTrainer) and issubclass(cls, CreditMixin)
    assert cls.credit == "gigpo" and cls.credit_params == {"gamma": 0.9}
    with pytest.raises(ValueError, match="gama"):
        make_trainer(trl.GRPOTrainer, credit="gigpo", gama=0.9)
    with pytest.raises(ValueError, match="graphhca"):  # the error lists the registered estimators
        make_trainer(trl.GRPOTrainer, credit="nope")
    with pytest.raises(ValueError, match="schedul"):
        make_trainer(trl.GRPOTrainer, credit="grpo", schedule="tide-that-does-not-exist")
    assert cls.adv_scale == credit_plugins.DEFAULT_ADV_SCALE
    assert make_trainer(trl.GRPOTrainer, credit="crbc", adv_scale="batch_std").adv_scale == "batch_std"
    with pytest.raises(ValueError, match=r"adv_scale='rms' is not an advantage scale; valid: none, batch_rms"):
        make_trainer(trl.GRPOTrainer, credit="gigpo", adv_scale="rms")


def test_adv_scale_factor_runs_over_step_rows_or_the_rows_model_tokens():
    from credit_plugins.scaling import EPS

    from agentcredit.trl.credit import StepRow

    rows = [StepRow(row=i, turn=0, traj=i, t=0, state=0, action=0, reward=0.0, success=False, truncated=False)
            for i in (0, 2)]
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])  # row 1 has no step: its tokens are not decisions
    step = CreditMixin._agentcredit_scale_factor(torch.tensor([3.0, -4.0]), rows, 0, mask, "batch_rms")
    assert step == pytest.approx(1 / (math.sqrt(12.5) + EPS))
    token = torch.tensor([[1.0, 1.0, 99.0], [2.0, 99.0, 99.0]])  # decisions 1, 1, 2: mean A^2 = 2
    assert CreditMixin._agentcredit_scale_factor(token, rows, 0, mask, "batch_rms") == pytest.approx(
        1 / (math.sqrt(2) + EPS))
    assert CreditMixin._agentcredit_scale_factor(token, rows, 0, mask, "none") == 1.0
    other_rank = [rows[0], rows[1].placed(1, 3, 2)]
    with pytest.raises(ValueError, match="per-token advantages of several processes' rows"):
        CreditMixin._agentcredit_scale_factor(token, other_rank, 0, mask, "batch_rms")


def test_grpo_through_the_mixin_equals_stock_grpo_in_one_process(tmp_path):
    stock = losses(train_plain(trl.GRPOTrainer, str(tmp_path / "stock")))
    mixed = losses(train_plain(make_trainer(trl.GRPOTrainer, credit="grpo", eps=1e-4), str(tmp_path / "grpo")))
    assert len(stock) == len(mixed) == 3
    for (l1, g1), (l2, g2) in zip(stock, mixed):
        assert g1 > 0 and g2 == pytest.approx(g1, rel=1e-5, abs=1e-7)
        assert l2 == pytest.approx(l1, rel=1e-5, abs=1e-6)
    # and the estimator really is in charge: Dr.GRPO-style centring gives a different gradient
    other = losses(train_plain(make_trainer(trl.GRPOTrainer, credit="grpo", norm_std=False), str(tmp_path / "dr")))
    assert other[0][1] != pytest.approx(stock[0][1], rel=1e-3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(600)
def test_grpo_through_the_mixin_equals_stock_grpo_across_two_processes(tmp_path):
    """torchrun, 2 CPU ranks (gloo); num_generations 8 over 4 rows per rank: every group spans both ranks."""
    out = tmp_path / "ddp.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([os.path.dirname(TESTS), *sys.path]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), os.path.join(TESTS, "helpers", "trl_runs.py"), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["world"] == 2
    assert len(result["stock"]) == len(result["grpo"]) == 3
    for (l1, g1), (l2, g2) in zip(result["stock"], result["grpo"]):
        assert g1 > 0 and g2 == pytest.approx(g1, rel=1e-5, abs=1e-7)
        assert l2 == pytest.approx(l1, rel=1e-5, abs=1e-6)


@pytest.mark.timeout(600)
def test_multi_turn_step_credit_on_two_processes_equals_one_process_on_the_same_rows(tmp_path):
    """torchrun, 2 CPU ranks (gloo), 2 real steps of a 2-turn MiniGrid TurnRollout with GiGPO (each rank 8 rows: 4
    episodes of one seed). Both ranks build the same StepTable over the gathered rows; GiGPO on that table in this
    one process gives, for every step row, exactly the advantage its rank put on the tokens of its turn."""
    import credit_plugins as cp

    out = tmp_path / "multi"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([os.path.dirname(TESTS), *sys.path]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), os.path.join(TESTS, "helpers", "trl_runs.py"), str(out), "multiturn"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"multi.rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2] and len(ranks[0]["records"]) == len(ranks[1]["records"]) == 2
    moved = 0
    for step in range(2):
        mine = [r["records"][step] for r in ranks]
        assert mine[0]["table"] == mine[1]["table"] and mine[0]["rows"] == mine[1]["rows"]  # one gathered table
        table, rows = mine[0]["table"], mine[0]["rows"]
        assert {rank for rank, _, _ in rows} == {0, 1}
        # each rank's trajectories are its own (rank-offset ids), never merged with the other's
        trajs = [{tr for tr, (rank, _, _) in zip(table["traj"], rows) if rank == k} for k in (0, 1)]
        assert trajs[0] and trajs[1] and not trajs[0] & trajs[1]
        single = cp.get("gigpo")(cp.StepTable(**table))
        for j, (rank, row, _) in enumerate(rows):
            adv = torch.tensor(mine[rank]["advantages"][row])
            on = torch.tensor(mine[rank]["mask"][row]).bool()
            assert on.any()
            assert torch.allclose(adv[on], torch.full_like(adv[on], float(single[j])), atol=1e-6), (step, j)
            assert bool((adv[~on] == 0).all())
        moved += int(single.abs().sum() > 0)
    assert moved >= 1  # a step with non-zero credit: the equality is not 0 == 0
    for (l0, g0), (l1, g1) in zip(ranks[0]["losses"], ranks[1]["losses"]):
        assert (l0, g0) == (l1, g1)  # both ranks logged the same synchronised step


# ---- one row per turn: advantages land on each row's tokens --------------------------------------------------------
class Recording(CreditMixin, trl.GRPOTrainer):
    credit = "gigpo"
    credit_params = {"gamma": 0.5}

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        self.seen = {"inputs": [dict(i) for i in inputs], "advantages": out["advantages"].clone(),
                     "mask": out["completion_mask"] * out.get("tool_mask", 1)}
        return out


def _scripted_turn_rollout(prompts, trainer):
    """A rollout_func with fixed, hand-made turn rows: per group of 4 rows, 2 episodes of the same seed.

    Episode A: s0 -up-> s1 -up-> goal (reward 0, 1); episode B: s0 -left-> s0 (invalid, -0.1), then a padding row.
    """
    tok = trainer.processing_class
    n = len(prompts)
    assert n % 4 == 0
    fields = {k: [] for k in ("agentcredit_traj", "agentcredit_t", "agentcredit_state", "agentcredit_action",
                              "agentcredit_reward", "agentcredit_success", "agentcredit_truncated",
                              "agentcredit_valid")}
    prompt_ids, completion_ids, env_mask = [], [], []
    s0, s1, up, left = stable_hash("s0"), stable_hash("s1"), stable_hash("up"), stable_hash("left")
    for b in range(n // 4):
        rows = [(2 * b, 0, s0, up, 0.0, True, False, True), (2 * b, 1, s1, up, 1.0, True, False, True),
                (2 * b + 1, 0, s0, -1, -0.1, False, True, False), (-1, 0, 0, -1, 0.0, False, False, False)]
        for traj, t, state, action, reward, success, truncated, valid in rows:
            ids = tok(f"state {t} action")["input_ids"]
            prompt_ids.append(tok(prompts[4 * b])["input_ids"])
            completion_ids.append(ids if traj >= 0 else [tok.eos_token_id])
            env_mask.append([1] * len(ids) if traj >= 0 else [0])
            for key, value in zip(fields, (traj, t, state, action, reward, success, truncated, valid)):
                fields[key].append(value)
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None, "env_mask": env_mask,
            **fields}


def _step_reward(completions, agentcredit_reward, **kwargs):
    return list(agentcredit_reward)


def test_turn_rows_get_the_estimators_step_advantage_on_their_tokens(tmp_path):
    """... scaled by adv_scale=batch_rms: the advantages the loss sees have rms 1 over the step rows."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentcredit.models import resolve_model

    path = resolve_model("tiny-qwen2")
    args = trl.GRPOConfig(output_dir=str(tmp_path), max_steps=1, num_generations=4, per_device_train_batch_size=8,
                          max_completion_length=16, report_to="none", logging_steps=1, use_cpu=True,
                          save_strategy="no", seed=0, disable_tqdm=True)
    trainer = Recording(model=AutoModelForCausalLM.from_pretrained(path), args=args,
                        processing_class=AutoTokenizer.from_pretrained(path), reward_funcs=[_step_reward],
                        rollout_func=_scripted_turn_rollout,
                        train_dataset=Dataset.from_dict({"prompt": [f"seed {i}" for i in range(8)]}),
                        adv_scale="batch_rms")
    trainer.train()
    seen = trainer.seen
    rows = [r for r in seen["inputs"] if r["agentcredit_traj"] >= 0]
    table = credit_plugins.StepTable(
        group=[0, 0, 0, 1, 1, 1], traj=[0, 0, 1, 2, 2, 3], t=[r["agentcredit_t"] for r in rows],
        state=[r["agentcredit_state"] for r in rows], action=[r["agentcredit_action"] for r in rows],
        reward=[r["agentcredit_reward"] for r in rows], success=[r["agentcredit_success"] for r in rows],
        truncated=[r["agentcredit_truncated"] for r in rows])
    raw = credit_plugins.get("gigpo")(table, gamma=0.5)
    factor = 1 / (raw.double().square().mean().sqrt().item() + 1e-6)
    expected = raw * factor
    adv, mask = seen["advantages"], seen["mask"].bool()
    real = [i for i, r in enumerate(seen["inputs"]) if r["agentcredit_traj"] >= 0]
    for k, i in enumerate(real):
        tokens = adv[i][mask[i]]
        assert tokens.numel() > 0 and torch.allclose(tokens, expected[k].expand_as(tokens))
        assert torch.all(adv[i][~mask[i]] == 0)
    per_step = torch.stack([adv[i][mask[i]][0] for i in real]).double()
    assert per_step.square().mean().sqrt().item() == pytest.approx(1.0, rel=1e-5)
    assert abs(factor - 1) > 0.1  # the scale did change the estimator's advantages
    padding = [i for i, r in enumerate(seen["inputs"]) if r["agentcredit_traj"] < 0]
    assert padding and all(torch.all(adv[i] == 0) for i in padding)
    logged = [h for h in trainer.state.log_history if "agentcredit/success" in h][0]
    assert logged["agentcredit/success"] == pytest.approx(0.5) and logged["agentcredit/turns"] == pytest.approx(1.5)
    assert logged["agentcredit/valid"] == pytest.approx(4 / 6)
    assert logged["agentcredit/adv_scale_factor"] == pytest.approx(factor, rel=1e-6)
    assert logged["agentcredit/adv_abs_max"] == pytest.approx(raw.abs().max().item())  # logged before the scale
    from credit_plugins.diagnostics import credit_diagnostics  # logged every step, from the same table and advantages

    want = credit_diagnostics(table, raw)
    assert {k: logged[f"agentcredit/diag_{k}"] for k in want} == pytest.approx(want)


# ---- one row per episode: records of the env instance ---------------------------------------------------------------
class _Env:
    def __init__(self, turns, final, success, done):
        self.agentcredit_turns, self.agentcredit_final_state = turns, final
        self.agentcredit_success, self.agentcredit_done = success, done


def test_env_records_align_with_token_turns_and_extra_reward_lands_last():
    rec = [{"state": 11, "action": 5, "reward": 0.5, "valid": True},
           {"state": 12, "action": 6, "reward": -0.1, "valid": False}]
    envs = [_Env(rec, 13, True, True), _Env(rec[:1], 12, False, False)]
    rows = _step_rows_from_envs(envs, torch.tensor([10.4, float("nan")]), [3, 1])
    # row 0: three token turns, two tool calls, then the final answer in state 13; TRL's reward 10.4 minus the
    # records' 0.4 goes to the last step. Row 1 is unscorable (NaN): left out.
    assert [(r.row, r.turn, r.traj, r.t, r.state, r.action, r.reward, r.success) for r in rows] == [
        (0, 0, 0, 0, 11, 5, 0.5, True), (0, 1, 0, 1, 12, 6, -0.1, True),
        (0, 2, 0, 2, 13, -1, pytest.approx(10.0), True)]
    assert [r.valid for r in rows] == [True, False, False]  # the final answer (no record) is not a valid action
    assert [r.truncated for r in rows] == [False] * 3  # done: not truncated
    rows = _step_rows_from_envs(envs[1:], torch.tensor([0.5]), [3])
    assert [r.state for r in rows] == [11, 12, 12] and [r.truncated for r in rows] == [True] * 3


# ---- a stateful estimator's state survives a TRL checkpoint and resume ----------------------------------------------
class _CountingGRPO:
    """GRPO that counts the batches it saw (its state)."""

    STATE_DOC = "the number of batches seen"

    def __init__(self, params):
        self.params, self.batches = params, 0

    def __call__(self, steps):
        self.batches += 1
        return credit_plugins.get("grpo")(steps)

    def state_dict(self):
        return {"batches": self.batches}

    def load_state_dict(self, state):
        self.batches = int(state["batches"])


class _CountingPlugin:
    @credit_plugins.hookimpl
    def agentcredit_estimators(self):
        from dataclasses import dataclass

        @dataclass
        class NoParams:
            pass

        return [credit_plugins.Estimator(name="counting_grpo", fn=None, params=NoParams, paper="test",
                                         formula="GRPO", stateful=_CountingGRPO)]


def test_stateful_estimator_state_is_saved_with_the_checkpoint_and_restored_on_resume(tmp_path):
    from credit_plugins import registry

    name = registry.register_plugin(_CountingPlugin(), name="counting-test")
    try:
        cls = make_trainer(trl.GRPOTrainer, credit="counting_grpo")
        first = train_plain(cls, str(tmp_path), steps=3, save_strategy="steps", save_steps=2)
        assert first._agentcredit.batches == 3
        saved = torch.load(tmp_path / "checkpoint-2" / "agentcredit_estimator.pt", weights_only=False)
        assert saved == {"credit": "counting_grpo", "state": {"batches": 2}}
        resumed = train_plain(cls, str(tmp_path), steps=3, save_strategy="no", resume="checkpoint-2")
        assert resumed._agentcredit.batches == 3  # 2 restored + the one step left
    finally:
        registry.unregister_plugin(name)
