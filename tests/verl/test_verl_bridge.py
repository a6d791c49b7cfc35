"""The verl bridge against the real verl 0.9.1 on CPU: entry point, registry, compute_advantage (legacy), the v1
trainer's _compute_advantage through a real TransferQueue with rows written by verl's own agent-loop
post-processing, padding rows from verl's own batch balancing, and Hydra composition."""

import asyncio
import dataclasses
import functools
import os
import re
import subprocess
import sys
import types

import numpy as np
import pytest
import torch
import yaml

pytest.importorskip("verl", reason="the [verl] extra is not installed")

import verl  # noqa: E402  (the entry point registers our estimators here)
from omegaconf import OmegaConf  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.trainer.ppo.ray_trainer import compute_advantage  # noqa: E402

import credit_plugins as cp  # noqa: E402
from agentcredit.verl import _compat, hooks  # noqa: E402
from agentcredit.verl.contract import RowMeta  # noqa: E402

pytestmark = pytest.mark.verl

# 2 tasks x 2 rollouts, one row per step (verl-agent style). Task a: rollout 0 wins in 2 steps (s0 -> s1 -> win),
# rollout 1 loses in 2 steps (s0 -> s2 -> lose). Task b: both rollouts lose in one step from s0.
ROWS = [  # uid, traj_uid, step_idx, anchor, action, score on the last step
    ("a", "a_0", 0, "s0", "go north", None), ("a", "a_0", 1, "s1", "take key", 10.0),
    ("a", "a_1", 0, "s0", "go south", None), ("a", "a_1", 1, "s2", "look", 0.0),
    ("b", "b_0", 0, "s0", "open", 0.0), ("b", "b_1", 0, "s0", "open", 0.0),
]
RESP_LEN = 4


def legacy_batch(rows=ROWS, with_meta=True):
    n = len(rows)
    scores = {traj: s for _, traj, _, _, _, s in rows if s is not None}
    rewards = torch.zeros(n, RESP_LEN)
    rewards[:, -1] = torch.tensor([scores[traj] for _, traj, *_ in rows])  # verl copies the score to every turn
    mask = torch.ones(n, RESP_LEN)
    mask[0, -2:] = 0  # some response tokens are env/tool tokens
    non_tensors = {"uid": np.array([r[0] for r in rows], dtype=object)}
    if with_meta:
        non_tensors.update(traj_uid=np.array([r[1] for r in rows], dtype=object),
                           step_idx=np.array([r[2] for r in rows], dtype=object),
                           anchor_key=np.array([r[3] for r in rows], dtype=object),
                           action_key=np.array([r[4] for r in rows], dtype=object))
    return DataProto.from_dict(tensors={"token_level_rewards": rewards, "response_mask": mask},
                               non_tensors=non_tensors)


def pure_steps(rows=ROWS):
    """The StepTable the bridge should build from ROWS (the score on each trajectory's last step)."""
    last = {}
    for _, traj, t, *_ in rows:
        last[traj] = max(last.get(traj, -1), t)
    scores = {traj: s for _, traj, _, _, _, s in rows if s is not None}
    return cp.StepTable(group=[r[0] for r in rows], traj=[r[1] for r in rows], t=[r[2] for r in rows],
                        state=[r[3] for r in rows], action=[r[4] for r in rows],
                        reward=[scores[r[1]] if r[2] == last[r[1]] else 0.0 for r in rows],
                        extras={"signature": [r[3][:2] for r in rows], "descriptor": [descriptor(r) for r in rows]})


def descriptor(row):
    """A small behaviour vector per step (what TJPO's env adapters write as the ``descriptor`` extra field)."""
    _, _, t, anchor, action, _ = row
    return [float(len(action)), float(t), float(anchor == "s0")]


def pure(name, rows=ROWS, **params):
    return cp.get(name).create(**params)(pure_steps(rows))


def pure_gigpo(rows=ROWS, **params):
    return pure("gigpo", rows, **params)


def algo_config(name="gigpo", **params):
    return OmegaConf.create({"adv_estimator": name, "gamma": 1.0, "lam": 1.0, "use_kl_in_reward": False,
                             "norm_adv_by_std_in_grpo": True, name: params})


def test_entry_point_registers_on_plain_import_verl_in_a_fresh_interpreter():
    code = ("import verl\nfrom verl.trainer.ppo import core_algos as c\n"
            "print(sorted(n for n, f in c.ADV_ESTIMATOR_REGISTRY.items() if hasattr(f, 'agentcredit_estimator')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    names = eval(proc.stdout.strip().splitlines()[-1])
    assert set(names) == set(cp.available()) - {"grpo"}  # verl's own grpo is kept
    warnings = [ln for ln in proc.stderr.splitlines() if "agentcredit: registered verl advantage estimators" in ln]
    assert len(warnings) == 1 and "kept verl's own ['grpo']" in warnings[0]


def test_names_verl_already_has_keep_verls_function():
    assert not hasattr(core_algos.get_adv_estimator_fn("grpo"), "agentcredit_estimator")
    assert core_algos.get_adv_estimator_fn("gigpo").agentcredit_estimator is cp.get("gigpo")


def test_legacy_compute_advantage_equals_pure_function():
    data = legacy_batch()
    out = compute_advantage(data, adv_estimator="gigpo", config=algo_config(step_weight=0.5))
    want = pure_gigpo(step_weight=0.5)
    adv = out.batch["advantages"]
    assert torch.allclose(adv[:, 0], want)
    assert torch.equal(adv, want[:, None] * data.batch["response_mask"])  # broadcast over response tokens only
    assert torch.equal(out.batch["returns"], adv)
    # the step term is really there: the two first steps of task a share s0 but differ in outcome
    assert not torch.allclose(want, pure_gigpo(step_weight=0.0))


#: the estimators of the flat step table (the search and hindsight ones read rollout-specific extras: their verl
#: paths are tested in tests/verl/test_env_verl_loop.py, and the hindsight ones are refused below)
FLAT = sorted(n for n in hooks.OURS if cp.get(n).sources() <= {"env"})


@pytest.mark.parametrize("name", FLAT)
def test_every_estimator_through_verls_compute_advantage_equals_its_pure_function(name):
    from agentcredit.verl import adapter

    adapter.INSTANCES.clear()  # stateful estimators: compare first batches
    data = legacy_batch()
    data.non_tensor_batch["signature"] = np.array([r[3][:2] for r in ROWS], dtype=object)
    data.non_tensor_batch["descriptor"] = np.array([descriptor(r) for r in ROWS] + [None], dtype=object)[:-1]
    out = compute_advantage(data, adv_estimator=name, config=algo_config(name))
    assert torch.allclose(out.batch["advantages"][:, 0], pure(name), atol=1e-6)
    adapter.INSTANCES.clear()


def test_stateful_estimator_statistics_reach_verls_metrics():
    """MVPO's kappa and route fractions are logged on verl as on TRL (``agentcredit/mvpo/...``)."""
    from agentcredit.verl import adapter
    from agentcredit.verl.contract import RowMeta

    adapter.INSTANCES.clear()
    data = legacy_batch()
    data.non_tensor_batch["signature"] = np.array([r[3][:2] for r in ROWS], dtype=object)
    meta = RowMeta.from_non_tensor_batch(data.non_tensor_batch)
    fn = core_algos.get_adv_estimator_fn("mvpo")
    try:
        with adapter.publish(meta):
            fn(token_level_rewards=data.batch["token_level_rewards"], response_mask=data.batch["response_mask"],
               index=data.non_tensor_batch["uid"], config=algo_config("mvpo"))
        want = cp.get("mvpo").create()
        want(pure_steps())
        for key, value in want.stats.items():
            assert meta.stats[f"agentcredit/{key}"] == pytest.approx(value)
        assert "agentcredit/mvpo/kappa" in meta.stats
    finally:
        adapter.INSTANCES.clear()


def _scaled_call(name, adv_scale, meta_more=None, **params):
    """The verl function of estimator ``name`` (or an Estimator record) on :func:`legacy_batch` with
    ``algorithm.agentcredit_adv_scale``; returns its ``[B, L]`` advantages, the response mask and the step stats."""
    from agentcredit.verl import adapter

    data = legacy_batch()
    meta = RowMeta.from_non_tensor_batch(data.non_tensor_batch)
    for key, value in (meta_more or {}).items():
        setattr(meta, key, value)
    fn = adapter.make_verl_estimator(cp.get(name) if isinstance(name, str) else name)
    config = algo_config(getattr(name, "name", name), **params)
    config["agentcredit_adv_scale"] = adv_scale
    with adapter.publish(meta):
        adv, _ = fn(token_level_rewards=data.batch["token_level_rewards"], response_mask=data.batch["response_mask"],
                    index=data.non_tensor_batch["uid"], config=config)
    return adv, data.batch["response_mask"], meta.stats


def test_adv_scale_divides_the_estimators_step_advantages_by_their_batch_rms():
    from credit_plugins.scaling import EPS

    raw = pure("crbc")  # step_weight 5: well above GRPO's scale
    adv, mask, stats = _scaled_call("crbc", "batch_rms")
    factor = 1 / (raw.double().square().mean().sqrt().item() + EPS)
    assert stats["agentcredit/adv_scale_factor"] == pytest.approx(factor) and factor < 0.9
    assert torch.allclose(adv, (raw * factor)[:, None] * mask, atol=1e-6)
    assert adv[:, 0].double().square().mean().sqrt().item() == pytest.approx(1.0, rel=1e-5)  # rms 1 over the rows
    assert stats["agentcredit/adv_abs_mean"] == pytest.approx(raw.abs().mean().item())  # logged before the scale
    plain, _, plain_stats = _scaled_call("crbc", None)  # unset: the default, none
    assert torch.allclose(plain[:, 0], raw) and plain_stats["agentcredit/adv_scale_factor"] == 1.0
    with pytest.raises(ValueError, match=r"algorithm.agentcredit_adv_scale='rms' is not an advantage scale"):
        _scaled_call("crbc", "rms")


def test_adv_scale_of_token_advantages_runs_over_response_tokens_and_leaves_ccm_term_unscaled():
    from credit_plugins.scaling import EPS

    @dataclasses.dataclass
    class NoParams:
        pass

    def token_credit(steps, p):  # [S, L]: 1, 2, 3, 4 along every row's tokens, sign by row
        return torch.arange(1.0, RESP_LEN + 1).repeat(steps.n_steps, 1) * torch.where(steps.t > 0, 1.0, -1.0)[:, None]

    est = cp.Estimator(name="token_test", fn=token_credit, params=NoParams, paper="test", formula="test",
                       output="token")
    bonus = [np.full(RESP_LEN, 100.0)] * len(ROWS)  # CCM's distillation term: added after the scale
    adv, mask, stats = _scaled_call(est, "batch_std", meta_more={"token_bonus": bonus})
    raw = torch.arange(1.0, RESP_LEN + 1).repeat(len(ROWS), 1) * torch.tensor(
        [-1.0 if r[2] == 0 else 1.0 for r in ROWS])[:, None]
    tokens = raw[mask.bool()].double()  # row 0's last two tokens are not response tokens: not decisions
    factor = 1 / (tokens.std(unbiased=False).item() + EPS)
    assert stats["agentcredit/adv_scale_factor"] == pytest.approx(factor)
    assert torch.allclose(adv - 100.0 * mask, raw * factor * mask, atol=1e-5)


def test_batch_without_metadata_says_which_extra_fields_to_set():
    with pytest.raises(ValueError, match=r"set extra_fields \[.*'anchor_key'.*\] on every AgentLoopOutput"):
        compute_advantage(legacy_batch(with_meta=False), adv_estimator="gigpo", config=algo_config())


def test_batch_missing_anchor_key_only_names_it():
    data = legacy_batch()
    del data.non_tensor_batch["anchor_key"]
    with pytest.raises(ValueError, match=r"set extra_fields \['anchor_key'\]"):
        compute_advantage(data, adv_estimator="gigpo", config=algo_config())


def test_unknown_hyperparameter_is_an_error_listing_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['stepweight'\].*'step_weight'"):
        compute_advantage(legacy_batch(), adv_estimator="gigpo", config=algo_config(stepweight=0.5))


def test_other_estimators_are_untouched_by_the_wrap():
    data = legacy_batch()
    out = compute_advantage(data, adv_estimator="grpo", config=algo_config("grpo"))
    assert out.batch["advantages"].shape == (len(ROWS), RESP_LEN)


def test_startup_check_fails_loudly_when_verl_internals_moved():
    def compute_advantage(batch, estimator, gamma=1.0):  # renamed parameters: a future verl
        return batch

    with pytest.raises(_compat.VerlInternalsChanged, match=r"expected the first to be \['data', 'adv_estimator'\]"):
        hooks.wrap_compute_advantage(compute_advantage)
    with pytest.raises(_compat.VerlInternalsChanged, match="PPOTrainer._compute_advantage"):
        hooks.wrap_v1_compute_advantage(None)


def test_credit_and_distillation_hooks_wrap_the_checkpoint_methods_once_each_in_any_order():
    from agentcredit.verl import distill

    calls = []

    def _save_checkpoint(self):
        calls.append("verl")

    for first, second in ((hooks, distill), (distill, hooks)):
        once = second.wrap_save_checkpoint(first.wrap_save_checkpoint(_save_checkpoint))
        again = first.wrap_save_checkpoint(second.wrap_save_checkpoint(once))  # installing twice changes nothing
        assert again is once
        assert _compat.is_wrapped(once, "credit") and _compat.is_wrapped(once, "distill")
        calls.clear()
        once(types.SimpleNamespace(global_steps=0))
        assert calls == ["verl"]
    import verl.trainer.ppo.v1.trainer_base as tb

    for name in ("_save_checkpoint", "_load_checkpoint"):  # the real trainer, after both plugins loaded
        fn = tb.PPOTrainer.__dict__[name]
        assert _compat.is_wrapped(fn, "credit") and _compat.is_wrapped(fn, "distill")


def test_every_verl_binding_is_wrapped():
    import verl.experimental.separation.ray_trainer as sep
    import verl.trainer.ppo.ray_trainer as rt
    import verl.trainer.ppo.v1.trainer_base as tb
    import verl.trainer.ppo.v1.utils as v1u

    for fn in (rt.compute_advantage, sep.compute_advantage, v1u.compute_advantage, tb.PPOTrainer._compute_advantage):
        assert _compat.is_wrapped(fn, "credit"), fn


def test_row_meta_from_v1_keys_and_tags():
    meta = RowMeta.from_v1(["p_0_0", "p_0_1", "pad9_0_0"], [{}, {}, {"is_padding": True}],
                           [{"anchor_key": "s"}, {"anchor_key": "t"}, {"anchor_key": "s"}])
    assert meta.columns["traj_uid"] == ["p_0", "p_0", "pad9_0"] and meta.columns["step_idx"] == [0, 1, 0]
    assert meta.is_padding.tolist() == [False, False, True]
    with pytest.raises(ValueError, match=r"extra_fields\['anchor_key'\] is set on some rows but not on row 1"):
        RowMeta.from_v1(["p_0_0", "p_0_1"], None, [{"anchor_key": "s"}, {}])


def test_config_yaml_matches_defaults():
    from importlib.resources import files

    text = (files("agentcredit.verl.config") / "agentcredit_ppo.yaml").read_text()
    algorithm = yaml.safe_load(text)["algorithm"]
    for name in cp.available():
        if name in hooks.OURS:
            assert algorithm.get(name) == cp.get(name).defaults(), name


def test_hydra_composes_ppo_trainer_with_our_overrides_without_plus():
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", "--config-name", "agentcredit_ppo", "--cfg", "job",
           "algorithm.adv_estimator=gigpo", "algorithm.gigpo.step_weight=0.5", "algorithm.gigpo.gamma=0.9"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    start = re.search(r"^[a-z_]+:", proc.stdout, flags=re.M).start()  # skip any log lines before the YAML
    cfg = yaml.safe_load(proc.stdout[start:])
    assert cfg["algorithm"]["adv_estimator"] == "gigpo"
    assert cfg["algorithm"]["gigpo"]["step_weight"] == 0.5 and cfg["algorithm"]["gigpo"]["gamma"] == 0.9
    assert cfg["algorithm"]["gigpo"]["episode_stats"] == "steps"
    assert "actor_rollout_ref" in cfg  # the whole ppo_trainer is there
    bad = subprocess.run(cmd[:-2] + ["algorithm.gigpo.stepweight=0.5"], capture_output=True, text=True)
    assert bad.returncode != 0 and "stepweight" in bad.stderr


# ---- v1: real TransferQueue, real agent-loop post-processing, real PPOTrainer._compute_advantage -------------
def _postprocess():
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ

    worker_cls = AgentLoopWorkerTQ.__ray_metadata__.modified_class
    fake = types.SimpleNamespace()

    async def _noop(*args, **kwargs):
        return None

    fake._compute_score = _noop  # the agent loop sets reward_score itself, as an env-scored loop does
    fake._compute_teacher_logprobs = _noop
    fake._compute_multi_modal_inputs = lambda output, input_ids: {}
    fake._compute_position_ids = lambda ids, mask, mm, *a: torch.arange(ids.shape[-1]).unsqueeze(0)
    return functools.partial(worker_cls._agent_loop_postprocess, fake)


def _write_rows(tq, rows=ROWS, with_anchor=True, more=None):
    """One AgentLoopOutput per step, stored exactly as verl's AgentLoopWorkerTQ stores them (``more(row)``: extra
    ``extra_fields`` of a row)."""
    from verl.experimental.agent_loop import AgentLoopOutput
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics

    postprocess = _postprocess()
    by_traj: dict[str, list] = {}
    for row in rows:
        by_traj.setdefault(row[1], []).append(row)

    async def put_all():
        for traj, steps in by_traj.items():
            uid, session = traj.split("_")
            outs = []
            for row in steps:
                _, _, t, anchor, action, score = row
                extra = {"action_key": action, "signature": anchor[:2],  # step_idx and traj: from the keys
                         "descriptor": descriptor(row)}
                if with_anchor:
                    extra["anchor_key"] = anchor
                if more is not None:
                    extra.update(more(row))
                if score is not None:
                    extra["reward_extra_info"] = {}
                outs.append(AgentLoopOutput(prompt_ids=[1, 2, 3], response_ids=[10 + t] * RESP_LEN,
                                            response_mask=[1] * RESP_LEN, reward_score=score, num_turns=2 * (t + 1),
                                            metrics=AgentLoopMetrics(), extra_fields=extra))
            await postprocess(outs, False, uid=uid, session_id=int(session), global_steps=1, index=0,
                              data_source="toy", raw_prompt=[{"role": "user", "content": "play"}])

    asyncio.run(put_all())
    keys = [f"{traj}_{i}" for traj, steps in by_traj.items() for i in range(len(steps))]
    return keys


def _run_v1(tq, keys, tags, config):
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    trainer = types.SimpleNamespace(config=config)
    metrics = {}
    batch = KVBatchMeta(partition_id="train", keys=list(keys), tags=list(tags))
    PPOTrainer._compute_advantage(trainer, batch, metrics=metrics)
    adv = tq.kv_batch_get(keys=list(keys), partition_id="train", select_fields=["advantages"])["advantages"]
    return [a for a in adv.unbind(0)], metrics


def _trainer_config(name="gigpo", **params):
    return OmegaConf.create({"algorithm": dict(algo_config(name, **params)), "actor_rollout_ref": {"rollout": {"n": 2}}})


@pytest.mark.parametrize("name", ["uniopsd", "alignopsd"])
def test_hindsight_estimators_without_hindsight_columns_say_they_come_from_the_v1_trainer_wrap(name):
    with pytest.raises(ValueError, match=rf"{name}.*hindsight prompt.*logp_old.*non_tensor_batch.*use_v1=True"):
        compute_advantage(legacy_batch(), adv_estimator=name, config=algo_config(name))


# ---- v1 hindsight scoring (UniOPSD): real TransferQueue, a stand-in actor worker group and tokenizer ----------
#: what the stand-in tokenizer decodes the rows' response tokens (10 + step) to: one action each
RESPONSE_TEXT = {10: "up</action>", 11: "left</action>"}


class _CharTokenizer:
    """Characters <-> code points, except the response tokens of ROWS (:data:`RESPONSE_TEXT`) and the prompt
    tokens 1, 2, 3 ("abc")."""

    vocab = {1: "a", 2: "b", 3: "c", **RESPONSE_TEXT}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.vocab.get(int(i), chr(int(i))) for i in ids)

    def batch_decode(self, rows, skip_special_tokens=False):
        return [self.decode(r) for r in rows]

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


class _ActorGroup:
    """Stands in for verl's actor worker group: ``compute_log_prob(KVBatchMeta)`` reads the rows from the
    TransferQueue and writes ``log_probs`` over the whole sequence, as the real worker does; the value of every
    position is -0.001 x the prompt length, so a longer (hindsight) prompt gives other log-probs."""

    _dispatch_info = {"actor": [0, 1, 2]}  # dp size 3: the 2 hindsight rows are padded to 3 (a repeat)

    def __init__(self, tq):
        self.tq, self.calls = tq, []

    def compute_log_prob(self, meta):
        return self._score(meta, -0.001)

    def _score(self, meta, per_prompt_token):
        data = self.tq.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id,
                                    select_fields=["input_ids", "prompts", "responses"])
        prompts = [p.tolist() for p in data["prompts"].unbind(0)]
        lps = [torch.full((ids.numel(),), per_prompt_token * len(p))
               for ids, p in zip(data["input_ids"].unbind(0), prompts)]
        self.calls.append((meta.partition_id, list(meta.keys), dict(meta.extra_info), prompts,
                           [r.tolist() for r in data["responses"].unbind(0)]))
        from tensordict import TensorDict

        self.tq.kv_batch_put(keys=meta.keys, partition_id=meta.partition_id, fields=TensorDict(
            {"log_probs": torch.nested.as_nested_tensor(lps, layout=torch.jagged)}, batch_size=len(lps)))
        return meta


def _put_old_log_probs(tq, keys, value=-0.5):
    from tensordict import TensorDict

    rows = [torch.full((RESP_LEN,), value) for _ in keys]
    tq.kv_batch_put(keys=list(keys), partition_id="train", fields=TensorDict(
        {"old_log_probs": torch.nested.as_nested_tensor(rows, layout=torch.jagged)}, batch_size=len(rows)))


def _spy_hindsight_columns(monkeypatch):
    """The RowMeta columns the v1 wrap's hindsight scoring wrote, one dict per call (the wrap runs unchanged)."""
    from agentcredit.verl import hindsight, hooks

    seen = []

    def spy(trainer, batch, meta, estimator, params):
        stats = hindsight.add_hindsight_columns(trainer, batch, meta, estimator, params)
        seen.append({k: [np.array(v) for v in meta.columns[k]] for k in meta.columns})
        return stats

    monkeypatch.setattr(hooks, "add_hindsight_columns", spy)
    return seen


def _columns(rows):
    return torch.as_tensor(np.stack(rows))


def _run_hindsight_v1(tq, monkeypatch, group, name="uniopsd", params=None, *, same_layout=None, temperature=1.0,
                      old=-0.5, tokenizer=None, extra_info=None):
    """One v1 ``_compute_advantage`` of hindsight estimator ``name`` over ROWS (``old_log_probs`` all ``old``) with
    ``group`` as the actor worker group and ``algorithm.agentcredit_hindsight.same_layout`` left unset when None.
    Returns the advantages ``[rows, RESP_LEN]``, the step metrics and the hindsight columns the wrap wrote."""
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    keys = _write_rows(tq)
    _put_old_log_probs(tq, keys, old)
    config = _trainer_config(name, **(params or {}))
    config.actor_rollout_ref.rollout.temperature = temperature
    if same_layout is not None:
        config.algorithm.agentcredit_hindsight = {"same_layout": same_layout}
    columns = _spy_hindsight_columns(monkeypatch)
    trainer = types.SimpleNamespace(config=config, tokenizer=tokenizer or _CharTokenizer(), actor_rollout_wg=group)
    metrics = {}
    batch = KVBatchMeta(partition_id="train", keys=list(keys), tags=[{"status": "success"}] * len(keys),
                        extra_info=dict(extra_info or {}))
    PPOTrainer._compute_advantage(trainer, batch, metrics=metrics)
    adv = tq.kv_batch_get(keys=list(keys), partition_id="train", select_fields=["advantages"])["advantages"]
    (cols,) = columns
    return torch.stack(list(adv.unbind(0))).double(), metrics, cols


#: ``algorithm.agentcredit_hindsight``: unset (the default, ``same_layout: true``) or the ``same_layout: false`` opt-out
LAYOUTS = pytest.mark.parametrize("same_layout", [None, False], ids=["default", "same_layout_false"])


@LAYOUTS
def test_v1_uniopsd_rescores_failed_rows_under_the_successful_siblings_actions(transfer_queue, monkeypatch,
                                                                                same_layout):
    """By default each taught row is scored twice in the one hindsight pass, under the hindsight prompt and under its
    own, next to each other, and ``logp_teacher = logp_old + (lp(hindsight) - lp(own))``; with ``same_layout: false``
    once, and ``logp_teacher`` is the hindsight-prompt log-probs themselves."""
    from distill_plugins.hindsight import PEER_HINDSIGHT_HEADER
    from agentcredit.verl import adapter
    from agentcredit.verl.hindsight import PARTITION

    adapter.INSTANCES.clear()
    group = _ActorGroup(transfer_queue)
    # verl's reference pass (before the advantage) leaves no_lora_adapter=True in the batch's extra_info
    got, metrics, cols = _run_hindsight_v1(transfer_queue, monkeypatch, group, "uniopsd",
                                           {"lam0": 0.5, "warmdown_steps": 10}, same_layout=same_layout,
                                           temperature=0.7, extra_info={"temperature": 0.7, "no_lora_adapter": True})

    # one extra no-grad pass, over the 2 rows of the failed rollout a_1 (task a's a_0 succeeded; task b: no success)
    assert len(group.calls) == 1
    part, hs_keys, info, prompts, responses = group.calls[0]
    assert part == PARTITION
    assert info["compute_loss"] is False and info["temperature"] == 0.7
    assert info["no_lora_adapter"] is False  # the hindsight teacher is the current policy, adapter included
    hindsight = PEER_HINDSIGHT_HEADER + "1. up\n2. left\n\nabc"  # a_0's actions, then a_1's own prompt
    hs, own = [ord(c) for c in hindsight], [1, 2, 3]
    lp_hindsight = torch.tensor(-0.001 * len(hs), dtype=torch.float32).double()  # the stand-in actor's scores
    lp_own = torch.tensor(-0.001 * len(own), dtype=torch.float32).double()
    a1 = [[10] * RESP_LEN, [11] * RESP_LEN]  # a_1's own response tokens, turn by turn
    if same_layout is None:
        # 2 scored rows per taught row, (hindsight, own) next to each other; 4 rows padded to dp 3 with repeats
        assert len(hs_keys) == 6
        assert prompts == [hs, own, hs, own, hs, own]
        assert responses == [a1[0], a1[0], a1[1], a1[1], a1[0], a1[0]]
        taught_lp = torch.tensor(-0.5, dtype=torch.float64) + (lp_hindsight - lp_own)  # logp_old + delta
    else:
        assert len(hs_keys) == 3
        assert prompts == [hs] * 3
        assert responses == [a1[0], a1[1], a1[0]]
        taught_lp = lp_hindsight  # the hindsight pass's own scores, minus verl's pass's logp_old below
    assert transfer_queue.kv_list(PARTITION).get(PARTITION, {}) == {}  # the hindsight rows are gone
    assert metrics["agentcredit/hindsight_rows"] == 2
    assert metrics["agentcredit/hindsight_taught_frac"] == pytest.approx(2 / 6)
    assert metrics["agentcredit/hindsight_prefix_tokens"] == len(hs) - len(own)
    assert metrics["agentcredit/hindsight_gap_abs_mean"] == pytest.approx(float(abs(taught_lp + 0.5)), rel=1e-12)

    # logp_teacher = taught_lp on a_1's rows, logp_old itself (bit for bit) elsewhere
    old = torch.full((len(ROWS), RESP_LEN), -0.5, dtype=torch.float64)
    teacher = old.clone()
    teacher[2:4] = taught_lp
    assert torch.equal(_columns(cols["logp_old"]), old)
    assert torch.equal(_columns(cols["logp_teacher"]), teacher)

    # the advantages are UniOPSD's on the same table
    steps = cp.StepTable(group=[r[0] for r in ROWS], traj=[r[1] for r in ROWS], t=[r[2] for r in ROWS],
                         state=[r[3] for r in ROWS], action=[r[4] for r in ROWS],
                         reward=[r[5] if r[5] is not None else 0.0 for r in ROWS],
                         extras={"logp_old": old, "logp_teacher": teacher,
                                 "response_mask": torch.ones(len(ROWS), RESP_LEN)})
    expected = cp.get("uniopsd").create(lam0=0.5, warmdown_steps=10)(steps)  # [S, L] token-level
    assert torch.isfinite(got).all() and got.abs().sum() > 0
    assert torch.allclose(got, expected.double().reshape(got.shape), atol=1e-5)
    adapter.INSTANCES.clear()


@LAYOUTS
def test_v1_alignopsd_scores_each_row_under_its_sources_teacher_prompts(transfer_queue, monkeypatch, same_layout):
    """AlignOPSD on verl: the hindsight pass of UniOPSD, then the rows' thinking embedded in the trainer process
    (distill_plugins.thinking), AlignOPSD's own select_sources on them, and one more actor pass that scores each target's
    response under its source's teacher prompt; the advantages are AlignOPSD's on a table built here by hand. By
    default each target is also scored under its own prompt in that pass, ``logp_cross = logp_old + delta``, and a
    source whose teacher prompt is the target's own prompt is the same input: scored once, delta exactly 0."""
    from distill_plugins.hindsight import PEER_HINDSIGHT_HEADER
    from distill_plugins.thinking import hashed_ngram_embedding
    from agentcredit.verl import adapter
    from credit_plugins.estimators import alignopsd

    adapter.INSTANCES.clear()
    group = _ActorGroup(transfer_queue)
    got, metrics, cols = _run_hindsight_v1(transfer_queue, monkeypatch, group, "alignopsd", same_layout=same_layout)

    # embeddings of each row's decoded response (no <think> span: the whole response is the thinking)
    texts = [RESPONSE_TEXT[10 + r[2]] * RESP_LEN for r in ROWS]
    emb = hashed_ngram_embedding([[ord(c) for c in t] for t in texts]).double()
    hindsight = PEER_HINDSIGHT_HEADER + "1. up\n2. left\n\nabc"   # a_1's teacher prompt; every other row: "abc"
    prompt_len = [3, 3, len(hindsight), len(hindsight), 3, 3]
    lp = {n: torch.tensor(-0.001 * n, dtype=torch.float32).double() for n in set(prompt_len)}  # the stand-in's
    # what a row scores under the teacher prompt of row `source`: by default logp_old + (lp(that prompt) - lp(own))
    if same_layout is None:
        def scored(source):
            return torch.tensor(-0.5, dtype=torch.float64) + (lp[prompt_len[source]] - lp[3])
    else:
        def scored(source):
            return lp[prompt_len[source]]
    old = torch.full((len(ROWS), RESP_LEN), -0.5, dtype=torch.float64)
    teacher = old.clone()
    teacher[2:4] = scored(2)
    steps = cp.StepTable(group=[r[0] for r in ROWS], traj=[r[1] for r in ROWS], t=[r[2] for r in ROWS],
                         reward=[r[5] if r[5] is not None else 0.0 for r in ROWS],
                         extras={"logp_old": old, "logp_teacher": teacher, "response_mask": torch.ones(6, RESP_LEN),
                                 "emb_teacher": emb, "emb_student": emb})
    src, _ = alignopsd.select_sources(steps)
    # same task, other rollout, the same turn's identical text wins: a_0 <-> a_1 per turn, b_0 <-> b_1
    assert src[:, 0].tolist() == [2, 3, 0, 1, 5, 4] and (src[:, 1:] == -1).all()
    assert len(group.calls) == 2 and metrics["agentcredit/hindsight_cross_pairs"] == 6
    assert len(group.calls[0][1]) == (6 if same_layout is None else 3)  # the hindsight pass (see the UniOPSD test)
    _, _, _, prompts, responses = group.calls[1]
    if same_layout is None:
        # targets 0, 1: (source's hindsight prompt, own prompt) next to each other; targets 2-5: their sources' teacher
        # prompt is "abc", their own prompt, so each is one scored row; 8 rows padded to dp 3 with a repeat
        order = [(0, len(hindsight)), (0, 3), (1, len(hindsight)), (1, 3), (2, 3), (3, 3), (4, 3), (5, 3),
                 (0, len(hindsight))]
    else:
        order = [(target, prompt_len[source]) for target, source in enumerate(src[:, 0].tolist())]
    assert [len(p) for p in prompts] == [n for _, n in order]
    assert responses == [[10 + ROWS[target][2]] * RESP_LEN for target, _ in order]
    cross = torch.zeros(len(ROWS), src.shape[1], RESP_LEN, dtype=torch.float64)
    for target, source in enumerate(src[:, 0].tolist()):
        cross[target, 0] = scored(source)
    assert torch.equal(_columns(cols["logp_teacher"]), teacher)
    assert torch.equal(_columns(cols["logp_cross"]), cross)
    assert _columns(cols["cross_src"]).tolist() == src.tolist()
    if same_layout is None:  # identical inputs: logp_cross is logp_old bit for bit
        assert torch.equal(cross[2:, 0], old[2:])
    expected = cp.get("alignopsd")(steps.with_extras({"logp_cross": cross, "cross_src": src}))
    assert torch.isfinite(got).all() and got.abs().sum() > 0
    assert torch.allclose(got, expected.double(), atol=1e-5)
    adapter.INSTANCES.clear()


def test_v1_step_appends_its_rollouts_to_the_ross_archive(transfer_queue, tmp_path):
    """``algorithm.agentcredit_archive``: each step's rollouts go to a JSONL archive in distill_plugins.ross's format
    (what ``agentcredit ross`` reads), before the advantage; a second step appends."""
    from distill_plugins.ross import LoopErasedSelector, build_examples, read_archive

    from credit_plugins.hashing import stable_hash

    keys = _write_rows(transfer_queue)
    config = _trainer_config(step_weight=0.5)
    config.algorithm.agentcredit_archive = str(tmp_path / "run" / "rollouts.jsonl")
    trainer = types.SimpleNamespace(config=config, tokenizer=_CharTokenizer(), global_steps=3)
    metrics = {}
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    batch = KVBatchMeta(partition_id="train", keys=list(keys), tags=[{"status": "success"}] * len(keys))
    PPOTrainer._compute_advantage(trainer, batch, metrics=metrics)
    assert metrics["agentcredit/archived_trajectories"] == 4
    archived = list(read_archive(config.algorithm.agentcredit_archive))
    by_traj = {a.extra["traj_uid"]: a for a in archived}
    assert sorted(by_traj) == ["a_0", "a_1", "b_0", "b_1"]
    a0 = by_traj["a_0"]
    assert a0.source == "verl" and a0.step == 3 and a0.success and a0.extra["uid"] == "a"
    assert [u.t for u in a0.turns] == [0, 1]
    assert [u.prompt_ids for u in a0.turns] == [[1, 2, 3]] * 2
    assert [u.completion_ids for u in a0.turns] == [[10] * RESP_LEN, [11] * RESP_LEN]
    assert [u.response for u in a0.turns] == [RESPONSE_TEXT[10] * RESP_LEN, RESPONSE_TEXT[11] * RESP_LEN]
    assert [u.state for u in a0.turns] == [stable_hash("s0"), stable_hash("s1")]
    assert [u.action for u in a0.turns] == [stable_hash("go north"), stable_hash("take key")]
    assert [u.reward for u in a0.turns] == [0.0, 10.0] and all(u.valid for u in a0.turns)
    assert not by_traj["a_1"].success and not by_traj["b_0"].success
    assert by_traj["a_0"].group == by_traj["a_1"].group != by_traj["b_0"].group == by_traj["b_1"].group
    # ROSS's default selector supervises the successful rollout's loop-erased turns: a_0's two turns, in one
    # teacher-forced sequence of the whole trajectory
    (example,) = build_examples(archived, LoopErasedSelector())
    assert example.input_ids == [1, 2, 3] + [10] * RESP_LEN + [1, 2, 3] + [11] * RESP_LEN
    assert example.completion_mask == ([0] * 3 + [1] * RESP_LEN) * 2

    PPOTrainer._compute_advantage(trainer, batch, metrics={})
    assert len(list(read_archive(config.algorithm.agentcredit_archive))) == 8


def test_ross_archive_needs_the_rows_anchor_keys(transfer_queue, tmp_path):
    keys = _write_rows(transfer_queue, with_anchor=False)
    config = _trainer_config("mt_grpo")  # an agentcredit estimator that needs no anchor itself
    config.algorithm.agentcredit_archive = str(tmp_path / "rollouts.jsonl")
    with pytest.raises(ValueError, match=r"agentcredit_archive.*anchor_key.*agentcredit_env"):
        _run_v1_with(transfer_queue, keys, config)


def _run_v1_with(tq, keys, config):
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    trainer = types.SimpleNamespace(config=config, tokenizer=_CharTokenizer(), global_steps=1)
    batch = KVBatchMeta(partition_id="train", keys=list(keys), tags=[{"status": "success"}] * len(keys))
    PPOTrainer._compute_advantage(trainer, batch, metrics={})


class _RefGroup(_ActorGroup):
    """Stands in for verl's reference worker group: ``compute_ref_log_prob`` writes ``log_probs`` of -0.002 x the
    prompt length at every position."""

    _dispatch_info = {"ref": [0, 1]}  # dp size 2

    def compute_log_prob(self, meta):  # pragma: no cover - the reference must be asked, not the actor
        raise AssertionError("CCM's teacher is the reference policy, not the actor")

    def compute_ref_log_prob(self, meta):
        return self._score(meta, -0.002)


#: CCM rows: a_0's turns and b_0 are eligible, their action tokens start at response token 1
CCM_START = {"a_0": 1, "b_0": 1}
CCM_TEACHER = [5, 6, 7, 8, 9]


def _ccm_fields(row):
    return {"ccm_teacher_prompt_ids": CCM_TEACHER, "ccm_action_start": CCM_START.get(row[1], -1)}


def _ccm_step(transfer_queue, ref_config=None):
    """One v1 advantage step of the CCM rows with the stand-in reference group (``ref_config``: the trainer's
    ``actor_rollout_ref.ref`` block); ``(keys, ref, metrics)``."""
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    keys = _write_rows(transfer_queue, more=_ccm_fields)
    _put_old_log_probs(transfer_queue, keys)
    ref = _RefGroup(transfer_queue)
    config = _trainer_config(step_weight=0.5)
    config.actor_rollout_ref.rollout.temperature = 1.0
    if ref_config is not None:
        config.actor_rollout_ref.ref = ref_config
    config.algorithm.agentcredit_ccm = {"distill_lambda": 0.01, "distill_beta": 5.0}
    trainer = types.SimpleNamespace(config=config, tokenizer=_CharTokenizer(), actor_rollout_wg=ref,
                                    ref_policy_wg=ref, use_reference_policy=True, ref_in_actor=False)
    metrics = {}
    batch = KVBatchMeta(partition_id="train", keys=list(keys), tags=[{"status": "success"}] * len(keys))
    PPOTrainer._compute_advantage(trainer, batch, metrics=metrics)
    return keys, ref, metrics


def test_v1_ccm_distillation_adds_the_gated_teacher_term_on_action_tokens(transfer_queue):
    """CCM on verl (agentcredit.verl.ccm): the reference policy (the frozen initial model) scores each eligible
    row's action tokens after its full-history prompt; lambda * sigma(beta (lp_T - lp_old)) is added to the
    advantage of those tokens only."""
    keys, ref, metrics = _ccm_step(transfer_queue)
    adv = transfer_queue.kv_batch_get(keys=list(keys), partition_id="train", select_fields=["advantages"])["advantages"]

    (part, hs_keys, info, prompts, responses), = ref.calls
    eligible = [i for i, r in enumerate(ROWS) if r[1] in CCM_START]  # a_0 t0, a_0 t1, b_0
    assert len(hs_keys) == 4 and prompts == [CCM_TEACHER] * 4  # 3 rows padded to the ref's dp size 2
    assert responses[:3] == [[10 + ROWS[i][2]] * (RESP_LEN - 1) for i in eligible]  # the action tokens only
    gate = torch.sigmoid(torch.tensor(5.0 * (-0.002 * len(CCM_TEACHER) + 0.5), dtype=torch.float64))
    expected = pure_gigpo(step_weight=0.5).double()[:, None].expand(len(ROWS), RESP_LEN).clone()
    for i in eligible:
        expected[i, 1:] += 0.01 * float(torch.tensor(float(gate), dtype=torch.float32))
    got = torch.stack(list(adv.unbind(0))).double()
    assert torch.allclose(got, expected, atol=1e-6)
    assert metrics["agentcredit/ccm_distill_rows"] == 3 and metrics["agentcredit/ccm_distill_tokens"] == 9
    assert metrics["agentcredit/ccm_gate_mean"] == pytest.approx(float(gate), rel=1e-5)


def test_ccm_distillation_needs_a_reference_policy_and_memory_rows(transfer_queue):
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    config = _trainer_config(step_weight=0.5)
    config.algorithm.agentcredit_ccm = {"distill_lambda": 0.01}
    keys = _write_rows(transfer_queue)
    batch = KVBatchMeta(partition_id="train", keys=list(keys), tags=[{"status": "success"}] * len(keys))
    trainer = types.SimpleNamespace(config=config, tokenizer=_CharTokenizer(), use_reference_policy=True)
    with pytest.raises(ValueError, match=r"agentcredit_ccm.*ccm_teacher_prompt_ids.*context: memory"):
        PPOTrainer._compute_advantage(trainer, batch, metrics={})
    keys = _write_rows(transfer_queue, rows=[("c", "c_0", 0, "s0", "x", 1.0), ("c", "c_1", 0, "s1", "y", 0.0)],
                       more=_ccm_fields)
    batch = KVBatchMeta(partition_id="train", keys=list(keys), tags=[{"status": "success"}] * len(keys))
    trainer.use_reference_policy = False
    with pytest.raises(ValueError, match=r"reference policy.*use_kl_loss=true"):
        PPOTrainer._compute_advantage(trainer, batch, metrics={})


@pytest.mark.parametrize("key,value", [("agentcredit_ccm", {"distill_lambda": 0.01}),
                                       ("agentcredit_archive", "/tmp/never-written.jsonl"),
                                       ("agentcredit_adv_scale", "batch_rms")])
def test_ccm_and_archive_with_verls_own_estimator_fail_instead_of_doing_nothing(transfer_queue, key, value):
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    config = _trainer_config("grpo")  # verl's own grpo: agentcredit's step never runs
    config.algorithm[key] = value
    keys = _write_rows(transfer_queue)
    batch = KVBatchMeta(partition_id="train", keys=list(keys), tags=[{"status": "success"}] * len(keys))
    with pytest.raises(ValueError, match=rf"algorithm.{key} acts in agentcredit's advantage step.*'grpo'.*gigpo"):
        PPOTrainer._compute_advantage(types.SimpleNamespace(config=config), batch, metrics={})


@pytest.mark.parametrize("block,match", [({"distill_lambda": -1}, "distill_lambda=-1"),
                                         ({"distill_beta": float("nan")}, "distill_beta=nan"),
                                         ({"lambda": 0.1}, r"unknown key\(s\) \['lambda'\]"),
                                         ([0.1], r"agentcredit_ccm must be a mapping with keys")])
def test_ccm_params_are_validated(block, match):
    from agentcredit.verl.ccm import ccm_params

    with pytest.raises(ValueError, match=match):
        ccm_params(OmegaConf.create({"agentcredit_ccm": block}))
    assert ccm_params(OmegaConf.create({})) is None
    assert ccm_params(OmegaConf.create({"agentcredit_ccm": {"distill_lambda": 0}})) is None
    assert ccm_params({"agentcredit_ccm": {}}) == (0.01, 5.0)


@pytest.mark.parametrize("name", FLAT)
def test_v1_wrap_gives_each_estimators_step_advantages(transfer_queue, name):
    from agentcredit.verl import adapter

    adapter.INSTANCES.clear()
    keys = _write_rows(transfer_queue)
    adv, _ = _run_v1(transfer_queue, keys, [{"status": "success"}] * len(keys), _trainer_config(name))
    assert torch.allclose(torch.stack([a[0] for a in adv]), pure(name), atol=1e-6)
    adapter.INSTANCES.clear()


def test_v1_compute_advantage_gives_step_level_advantages(transfer_queue):
    keys = _write_rows(transfer_queue)
    adv, metrics = _run_v1(transfer_queue, keys, [{"status": "success"}] * len(keys), _trainer_config(step_weight=0.5))
    per_row = torch.stack([a[0] for a in adv])
    assert torch.allclose(per_row, pure_gigpo(step_weight=0.5), atol=1e-6)
    assert all(a.shape == (RESP_LEN,) and torch.all(a == a[0]) for a in adv)
    # step level: the two rollouts of task a differ per step, not only per trajectory
    assert per_row[0] != per_row[1]
    assert metrics["agentcredit/steps"] == len(ROWS) and metrics["agentcredit/trajectories"] == 4
    # the credit diagnostics of the same batch, as credit_plugins.diagnostics computes them on the pure estimator
    from credit_plugins.diagnostics import credit_diagnostics

    want = credit_diagnostics(pure_steps(ROWS), pure_gigpo(step_weight=0.5))
    assert {k: metrics[f"agentcredit/diag_{k}"] for k in want} == pytest.approx(want)
    assert metrics["agentcredit/diag_step_signal_rows"] > 0


def test_v1_padding_rows_from_verl_batch_balancing_are_dropped(transfer_queue):
    """... also from ``algorithm.agentcredit_adv_scale``'s statistic (rms 1 over the 6 real rows, not the 8)."""
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.padding_utils import upsample_batch_to_divisible_size

    keys = _write_rows(transfer_queue)
    batch = KVBatchMeta(partition_id="train", keys=keys, tags=[{"status": "success"}] * len(keys))
    batch = upsample_batch_to_divisible_size(batch, batch_multiple=4, eos_token_id=0)  # 6 -> 8 rows
    assert len(batch.keys) == 8 and batch.tags[-1]["is_padding"]
    config = _trainer_config(step_weight=0.5)
    config.algorithm["agentcredit_adv_scale"] = "batch_rms"
    adv, metrics = _run_v1(transfer_queue, batch.keys, batch.tags, config)
    per_row = torch.stack([a[0] for a in adv])
    raw = pure_gigpo(step_weight=0.5)
    factor = 1 / (raw.double().square().mean().sqrt().item() + 1e-6)
    assert torch.allclose(per_row[:6], raw * factor, atol=1e-6)
    assert per_row[:6].double().square().mean().sqrt().item() == pytest.approx(1.0, rel=1e-5)
    assert metrics["agentcredit/adv_scale_factor"] == pytest.approx(factor) and abs(factor - 1) > 0.1
    assert torch.all(per_row[6:] == 0) and metrics["agentcredit/padding_rows"] == 2


def test_v1_without_anchor_keys_fails_naming_them(transfer_queue):
    rows = [(uid, traj.replace("_", "noanchor_"), *rest) for uid, traj, *rest in ROWS]
    keys = _write_rows(transfer_queue, rows, with_anchor=False)
    with pytest.raises(ValueError, match=r"set extra_fields \['anchor_key'\]"):
        _run_v1(transfer_queue, keys, [{}] * len(keys), _trainer_config())


class _Counter:
    """A stand-in stateful estimator instance: counts the batches it has seen."""

    def __init__(self):
        self.batches = 0

    def state_dict(self):
        return {"batches": self.batches}

    def load_state_dict(self, state):
        self.batches = state["batches"]


def test_stateful_estimator_state_is_saved_with_the_checkpoint_and_restored_on_resume(tmp_path):
    from agentcredit.verl import adapter

    def save(self):  # what verl's _save_checkpoint leaves behind: the global_step_N folder
        (tmp_path / f"global_step_{self.global_steps}").mkdir()

    def load(self):  # verl's _load_checkpoint sets global_steps from the folder it resumes
        self.global_steps = 3

    trainer = types.SimpleNamespace(global_steps=3, config=OmegaConf.create(
        {"trainer": {"default_local_dir": str(tmp_path), "resume_mode": "auto"}}))
    counter = _Counter()
    counter.batches = 7
    adapter.INSTANCES["counter"] = (None, counter)
    try:
        hooks.wrap_save_checkpoint(save)(trainer)
        assert (tmp_path / "global_step_3" / hooks.STATE_FILE).exists()
        counter.batches = 0  # a fresh process after a crash
        hooks.wrap_load_checkpoint(load)(trainer)
        assert counter.batches == 7
    finally:
        adapter.INSTANCES.pop("counter", None)
        adapter.PENDING.clear()


def test_estimator_state_after_resume_path_goes_to_the_new_step_folder(tmp_path):
    """verl resumes from ``resume_from_path`` but saves later checkpoints under ``default_local_dir``: the state must
    follow (it used to be written into the folder the run resumed from, and a later resume lost it)."""
    from agentcredit.verl import adapter

    old = tmp_path / "old_run" / "global_step_3"
    old.mkdir(parents=True)
    new_dir = tmp_path / "new_run"
    counter = _Counter()
    counter.batches = 7
    adapter.INSTANCES["counter"] = (None, counter)
    try:
        torch.save({"counter": {"batches": 7}}, old / hooks.STATE_FILE)
        trainer = types.SimpleNamespace(global_steps=0, config=OmegaConf.create(
            {"trainer": {"default_local_dir": str(new_dir), "resume_mode": "resume_path",
                         "resume_from_path": str(old)}}))
        counter.batches = 0

        def load(self):
            self.global_steps = 3

        hooks.wrap_load_checkpoint(load)(trainer)
        assert counter.batches == 7  # read from the folder it resumed from
        trainer.global_steps = 5
        counter.batches = 9

        def save(self):
            (new_dir / f"global_step_{self.global_steps}").mkdir(parents=True)

        hooks.wrap_save_checkpoint(save)(trainer)
        assert torch.load(new_dir / "global_step_5" / hooks.STATE_FILE, weights_only=False)["counter"] == {"batches": 9}
        assert torch.load(old / hooks.STATE_FILE, weights_only=False)["counter"] == {"batches": 7}  # untouched
    finally:
        adapter.INSTANCES.pop("counter", None)
        adapter.PENDING.clear()


def test_list_extras_keep_their_dtype_and_ragged_rows_are_padded():
    from agentcredit.verl.contract import _extra_column

    mask = _extra_column([[True, False], [True, True, True]], "legal_mask")
    assert mask.dtype == bool and mask.tolist() == [[True, False, False], [True, True, True]]
    assert _extra_column([[1, 2], [3]], "visits").dtype == np.int64
    assert _extra_column([[0.5, 0.5], [1.0]], "legal_p").tolist() == [[0.5, 0.5], [1.0, 0.0]]
    parent = _extra_column(["a-1", None], "parent")
    assert parent.tolist() == [cp.stable_hash("a-1"), -1]


@pytest.mark.parametrize("key", ["step_idx", "traj_uid", "anchor_key"])
def test_a_none_in_the_metadata_is_an_error_naming_the_key_and_row(key):
    data = legacy_batch()
    data.non_tensor_batch[key][2] = None
    with pytest.raises(ValueError, match=rf"extra_fields\['{key}'\] is None on batch row 2"):
        compute_advantage(data, adv_estimator="gigpo", config=algo_config())
