"""The TRL bridge: a cooperative ``GRPOTrainer`` mixin that replaces GRPO's advantages with an agentcredit estimator's.

    from trl import GRPOTrainer
    from credit_plugins.trl import make_trainer

    Trainer = make_trainer(GRPOTrainer, credit="gigpo", gamma=0.9)   # a GRPOTrainer subclass
    trainer = Trainer(model=..., args=GRPOConfig(...), reward_funcs=..., rollout_func=..., train_dataset=...)

or ``class MyTrainer(CreditMixin, GRPOTrainer): credit = "graphhca"``. Nothing else in TRL changes: every
``loss_type``, PEFT, DeepSpeed/FSDP and vLLM path stays TRL's (pinned ``trl>=1.16,<1.17``).

How it works (TRL 1.16, ``trl/trainer/grpo_trainer.py``)
--------------------------------------------------------
* ``_calculate_rewards`` is called once per generation round inside ``_generate_and_score_completions`` with the
  local ``inputs`` (dataset columns plus the ``rollout_func``'s extra fields) and returns the rewards of every
  process (gathered). The mixin keeps both.
* After the parent's ``_generate_and_score_completions``, the mixin builds one :class:`~credit_plugins.StepTable`
  over the **global** generation batch (each rank gathers the others' step rows, so groups may span ranks), calls the
  estimator, and sets ``output["advantages"]`` to a ``[B_local, T]`` tensor: each step's advantage on the tokens of
  its turn, 0 on prompt, env and padding tokens. ``_compute_loss`` keeps ``[B, T]`` advantages as they are
  (``if advantages.dim() == 1: unsqueeze``), so every loss type uses them unchanged.
* Groups are TRL's own: global row ``i`` belongs to group ``i // num_generations`` (``RepeatSampler`` puts the
  ``num_generations`` rollouts of a prompt next to each other).

Where the steps come from (the first that applies)
--------------------------------------------------
1. **One row per turn** (``env_adapters.trl.TurnRollout``): the rows carry the extra fields
   ``agentcredit_traj`` (-1: padding row, left out), ``agentcredit_t``, ``agentcredit_state``,
   ``agentcredit_action``, ``agentcredit_success``, ``agentcredit_truncated`` and ``agentcredit_valid``, and
   optionally ``agentcredit_extras`` (a dict per row, turned into StepTable extras: scalars ``[S]``, lists
   ``[S, A]``; a tree's ``parent`` gets the rank offset of ``traj``). A row is one step; its reward is the row's TRL
   reward (the rollout's ``reward_func`` returns the step reward). Token-level estimators (``[S, T]``: UniOPSD and
   AlignOPSD, whose hindsight extras :mod:`credit_plugins.privileged` computes here) need this layout.
2. **One row per episode** (``environment_factory``, TRL's tool loop): the environment instance of row ``i``
   (``trainer.environments[i]``) keeps ``agentcredit_turns`` (one record ``{state, action, reward, valid}`` per tool
   call), ``agentcredit_final_state``, ``agentcredit_success`` and ``agentcredit_done``. The turns are the runs of
   ``completion_mask * tool_mask == 1``; turn ``k`` takes record ``k`` (a turn past the records, e.g. the final text
   answer, is a step with no action and reward 0 in the final state). What the row's TRL reward adds beyond the
   records' rewards (other reward functions) lands on its last step.
3. **Anything else** (a plain dataset, TRL's own generation): one step per row, reward = the row's TRL reward, state
   = the prompt. With ``credit="grpo", eps=1e-4`` this reproduces stock GRPO (``scale_rewards="group"``) exactly.

TRL's ``scale_rewards`` and ``multi_objective_aggregation`` no longer shape the advantages (the estimator's own
normalisation does); a non-default value logs a warning. Unscorable rows (every reward function returned None) are
left out of the table and get advantage 0, as in TRL. Stateful estimators (MVPO) keep one instance per trainer;
its ``state_dict()`` is saved in each checkpoint (``agentcredit_estimator.pt``) and restored on resume.
Metrics added to TRL's logs: ``agentcredit/{success,return,turns,valid,adv_mean,adv_std,adv_abs_max,steps}``, a
stateful estimator's ``stats``, the rollout's ``metrics()`` as ``agentcredit/rollout/*`` (seconds, search cost) and,
for the hindsight estimators, ``agentcredit/hindsight_*`` (taught fraction, seconds).
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from . import registry
from .hashing import stable_hash
from .steptable import StepTable, list_block

__all__ = ["CreditMixin", "make_trainer", "check_trl", "TRLInternalsChanged", "turn_ids_from_mask", "ROW_FIELDS",
           "STATE_FILE"]

logger = logging.getLogger("agentcredit")

#: the per-row extra fields of a one-row-per-turn rollout (``env_adapters.trl.TurnRollout``)
ROW_FIELDS = ("agentcredit_traj", "agentcredit_t", "agentcredit_state", "agentcredit_action",
              "agentcredit_success", "agentcredit_truncated", "agentcredit_valid")
#: file of a stateful estimator's ``state_dict()`` inside a TRL checkpoint folder
STATE_FILE = "agentcredit_estimator.pt"
_TRL_RANGE = ((1, 16), (1, 17))


class TRLInternalsChanged(RuntimeError):
    """The installed TRL lacks an internal the bridge relies on (it is pinned to ``trl>=1.16,<1.17``)."""


def check_trl(base: type | None = None) -> None:
    """Check that ``base`` (default ``trl.GRPOTrainer``) has the hooks the mixin overrides, with the signatures
    and the ``[B, T]``-advantage branch it relies on; raise :class:`TRLInternalsChanged` naming what is missing."""
    import trl

    if base is None:
        base = trl.GRPOTrainer
    problems = []
    version = tuple(int(p) for p in trl.__version__.split(".")[:2] if p.isdigit())
    if not (_TRL_RANGE[0] <= version < _TRL_RANGE[1]):
        problems.append(f"trl {trl.__version__} is outside the supported range >=1.16,<1.17")
    expected = {"_generate_and_score_completions": ["self", "inputs"],
                "_calculate_rewards": ["self", "inputs", "prompts", "completions", "completion_ids_list"],
                "_compute_loss": ["self", "model", "inputs"]}
    for name, params in expected.items():
        fn = getattr(base, name, None)
        if fn is None:
            problems.append(f"{base.__name__}.{name} is missing")
            continue
        got = list(inspect.signature(fn).parameters)
        if got[:len(params)] != params:
            problems.append(f"{base.__name__}.{name}{tuple(got)} no longer takes {tuple(params)}")
    try:
        src = inspect.getsource(base._compute_loss)
    except (OSError, TypeError, AttributeError):
        src = ""
    if "advantages.dim() == 1" not in src:
        problems.append(f"{base.__name__}._compute_loss no longer keeps [B, T] advantages "
                        "('if advantages.dim() == 1: advantages = advantages.unsqueeze(1)')")
    if problems:
        raise TRLInternalsChanged("agentcredit's TRL bridge cannot work with this TRL: " + "; ".join(problems)
                                  + ". Install trl>=1.16,<1.17 (pip install 'agentcredit[trl]').")


def turn_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` turn index of each token: the k-th run of ones in ``mask`` (model tokens) is turn k; -1 elsewhere."""
    m = mask.bool()
    starts = m & ~torch.nn.functional.pad(m, (1, 0))[:, :-1]
    ids = torch.cumsum(starts.long(), dim=1) - 1
    return torch.where(m, ids, torch.full_like(ids, -1))


def _step_rows_per_turn(inputs: list[dict], rewards: torch.Tensor) -> list[tuple]:
    """Rows of a one-row-per-turn rollout: ``(row, turn, traj, t, state, action, reward, success, truncated,
    valid, extras)``; padding rows (traj -1) and unscorable rows (NaN reward) are left out."""
    out = []
    for i, row in enumerate(inputs):
        traj = int(row["agentcredit_traj"])
        r = float(rewards[i])
        if traj < 0 or r != r:
            continue
        out.append((i, 0, traj, int(row["agentcredit_t"]), int(row["agentcredit_state"]),
                    int(row["agentcredit_action"]), r, bool(row["agentcredit_success"]),
                    bool(row["agentcredit_truncated"]), bool(row.get("agentcredit_valid", True)),
                    dict(row.get("agentcredit_extras") or {})))
    return out


def _step_rows_from_envs(envs: list, rewards: torch.Tensor, n_turns: list[int]) -> list[tuple]:
    """Rows of whole-episode rollouts whose environments recorded ``agentcredit_turns`` (see the module doc)."""
    out = []
    for i, env in enumerate(envs):
        r_row = float(rewards[i])
        if r_row != r_row:
            continue
        records = list(getattr(env, "agentcredit_turns", []))
        final = int(getattr(env, "agentcredit_final_state", 0))
        n = max(int(n_turns[i]), 1)
        steps = []
        for k in range(n):
            if k < len(records):
                rec = records[k]
                steps.append([k, int(rec["state"]), int(rec["action"]), float(rec["reward"]),
                              bool(rec.get("valid", True))])
            else:
                steps.append([k, final, -1, 0.0, False])
        steps[-1][3] += r_row - sum(s[3] for s in steps)  # other reward functions' share lands on the last step
        success = bool(getattr(env, "agentcredit_success", False))
        truncated = not bool(getattr(env, "agentcredit_done", False))
        out.extend((i, k, i, k, state, action, reward, success, truncated, valid, {})
                   for k, state, action, reward, valid in steps)
    return out


def _step_rows_plain(prompts: list, rewards: torch.Tensor) -> list[tuple]:
    """One step per row: reward = the row's TRL reward, state = the prompt (NaN rows left out)."""
    return [(i, 0, i, 0, stable_hash(repr(p)), -1, float(rewards[i]), float(rewards[i]) > 0, False, True, {})
            for i, p in enumerate(prompts) if float(rewards[i]) == float(rewards[i])]


#: extras holding node ids (``traj`` values of other rows): they get the same per-rank offset as ``traj``
ID_EXTRAS = ("parent",)


def _row_extras(per_row: Sequence[dict], rank_offsets: Sequence[int]) -> dict[str, torch.Tensor]:
    """StepTable extras from the rollout rows' ``agentcredit_extras`` dicts: a scalar per row becomes ``[S]``, a
    list per row ``[S, A]`` (right-padded with 0 / False to the longest; bool, int64 or float64 as the values are).
    Every row must carry the same names."""
    names = sorted({k for d in per_row for k in d})
    out: dict[str, torch.Tensor] = {}
    for name in names:
        missing = sum(name not in d for d in per_row)
        if missing:
            raise ValueError(f"agentcredit_extras[{name!r}] is missing on {missing} of {len(per_row)} step rows; the "
                             f"rollout must give every row the same extras")
        values = [d[name] for d in per_row]
        if isinstance(values[0], (list, tuple)):
            col = torch.from_numpy(list_block(values))
            out[name] = col
        else:
            col = torch.tensor(values)
            if name in ID_EXTRAS:
                off = torch.tensor(list(rank_offsets), dtype=torch.int64)
                col = torch.where(col >= 0, col.long() + off, col.long())
            out[name] = col
    return out


class CreditMixin:
    """Put before ``GRPOTrainer`` in the bases: ``class T(CreditMixin, GRPOTrainer)``; see the module doc.

    Class attributes (or :func:`make_trainer` arguments): ``credit`` (a registered estimator name) and
    ``credit_params`` (its parameters, validated when the trainer is built).
    """

    credit: str = "grpo"
    credit_params: dict[str, Any] = {}

    def __init__(self, *args, **kwargs):
        check_trl(next(c for c in type(self).__mro__ if c.__name__ == "GRPOTrainer"))
        self._agentcredit = registry.get(self.credit).create(**dict(self.credit_params))
        self._agentcredit_ctx: dict[str, Any] | None = None
        super().__init__(*args, **kwargs)
        if getattr(self, "scale_rewards", "group") != "group" or \
                getattr(self, "multi_objective_aggregation", "sum_then_normalize") != "sum_then_normalize":
            logger.warning("agentcredit: scale_rewards=%r / multi_objective_aggregation=%r do not apply: the %r "
                           "estimator normalises the advantages itself", self.scale_rewards,
                           self.multi_objective_aggregation, self.credit)

    # -- capture what _generate_and_score_completions has but does not return ---------------------------------
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._agentcredit_ctx = {"inputs": inputs, "prompts": prompts, "rewards_per_func": rewards_per_func}
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        ctx, self._agentcredit_ctx = self._agentcredit_ctx, None
        if ctx is None:
            raise TRLInternalsChanged("GRPOTrainer._generate_and_score_completions no longer calls "
                                      "_calculate_rewards; agentcredit cannot see the rewards")
        started = time.perf_counter()
        mode = "train" if self.model.training else "eval"
        G = self.num_generations if mode == "train" else self.num_generations_eval
        rpf = ctx["rewards_per_func"]
        rewards = (rpf * self.reward_weights.to(rpf.device).unsqueeze(0)).nansum(dim=1)
        rewards[torch.isnan(rpf).all(dim=1)] = torch.nan
        rewards = rewards.detach().cpu()
        n_local, rank = len(ctx["prompts"]), self.accelerator.process_index
        local_rewards = rewards[rank * n_local:(rank + 1) * n_local]

        mask = output["completion_mask"].detach().cpu()
        if output.get("tool_mask") is not None:
            mask = mask * output["tool_mask"].detach().cpu()
        turn_ids = turn_ids_from_mask(mask)
        local_inputs = ctx["inputs"]
        envs = getattr(self, "environments", None)
        if local_inputs and "agentcredit_traj" in local_inputs[0]:
            turn_ids = torch.where(mask.bool(), 0, -1)  # the whole row is one turn
            rows = _step_rows_per_turn(local_inputs, local_rewards)
        elif envs and hasattr(envs[0], "agentcredit_turns"):
            rows = _step_rows_from_envs(envs, local_rewards, (turn_ids.max(dim=1).values + 1).tolist())
        else:
            rows = _step_rows_plain(ctx["prompts"], local_rewards)
        # global row index, group and a batch-unique trajectory id; then every rank sees every rank's steps
        rows = [(rank, i + rank * n_local, k, (i + rank * n_local) // G, rank * (1 << 32) + traj, *rest)
                for i, k, traj, *rest in rows]
        all_rows = self._agentcredit_gather(rows)

        advantages = torch.zeros(mask.shape, dtype=torch.float32)
        if all_rows:
            cols = list(zip(*all_rows))
            extras = _row_extras(cols[12], rank_offsets=[r[0] * (1 << 32) for r in all_rows])
            steps = StepTable(group=list(cols[3]), traj=list(cols[4]), t=list(cols[5]), state=list(cols[6]),
                              action=list(cols[7]), reward=list(cols[8]), success=list(cols[9]),
                              truncated=list(cols[10]), extras=extras or None)
            mine = torch.tensor([r[0] == rank for r in all_rows])
            local_row = torch.tensor([r[1] - rank * n_local for r in all_rows])[mine]
            local_turn = torch.tensor([r[2] for r in all_rows])[mine]
            estimator = registry.get(self.credit)
            if "logp_teacher" in estimator.requires:
                steps = self._agentcredit_hindsight(output, steps, local_row, local_inputs, mode, cols[11])
            adv = self._agentcredit(steps).to(torch.float32)
            if adv.dim() == 2:  # per token: each step row is one whole completion row (one-row-per-turn)
                if adv.size(1) != mask.size(1):
                    raise ValueError(f"estimator {self.credit!r} returned {adv.size(1)} token columns for "
                                     f"completions of {mask.size(1)} tokens")
                advantages[local_row] = adv[mine] * mask[local_row]
            elif adv.dim() != 1:
                raise ValueError(f"estimator {self.credit!r} returned shape {tuple(adv.shape)}; the TRL bridge "
                                 "takes per-step [S] or per-token [S, T] advantages")
            else:
                n_turns = int(turn_ids.max().item()) + 1 if turn_ids.numel() else 0
                table = torch.zeros(mask.size(0), max(n_turns, int(local_turn.max()) + 1 if len(local_turn) else 1))
                table[local_row, local_turn] = adv[mine]
                in_turn = turn_ids >= 0
                advantages = torch.where(in_turn, table.gather(1, turn_ids.clamp(min=0)), advantages)
            self._agentcredit_log(mode, steps, adv, cols[11], time.perf_counter() - started)
        output["advantages"] = advantages.to(output["completion_ids"].device)
        return output

    def _agentcredit_hindsight(self, output, steps: StepTable, local_row: torch.Tensor, local_inputs, mode: str,
                               valid) -> StepTable:
        """``steps`` with the token-level hindsight extras (:mod:`credit_plugins.privileged`) of UniOPSD/AlignOPSD."""
        from .privileged import hindsight_extras

        if self.accelerator.num_processes > 1:
            raise ValueError(f"estimator {self.credit!r} scores hindsight prompts of a trajectory's successful "
                             f"sibling; the TRL bridge does this in one process only (run without torchrun/accelerate "
                             f"launch, or use a step-level estimator)")
        if not (local_inputs and "agentcredit_traj" in local_inputs[0]):
            raise ValueError(f"estimator {self.credit!r} needs the one-row-per-turn layout: use "
                             f"rollout_func=env_adapters.trl.TurnRollout (recipes: agentcredit.rollout: turns)")
        params = getattr(self._agentcredit, "params", None)
        token = hindsight_extras(self, output, steps, local_row.tolist(), self.credit, params)
        if self.credit == "alignopsd":  # its invalid-action residual reads each turn's validity
            token["valid"] = torch.tensor([bool(v) for v in valid])
        stats = token.pop("_stats")
        for k, v in stats.items():
            self._metrics[mode][f"agentcredit/hindsight_{k}"].append(float(v))
        return steps.with_extras(token)

    def _agentcredit_gather(self, rows: list[tuple]) -> list[tuple]:
        if self.accelerator.num_processes == 1:
            return rows
        from accelerate.utils import gather_object

        return [tuple(r) for chunk in gather_object([rows]) for r in chunk]  # one list per rank, in rank order

    def _agentcredit_log(self, mode: str, steps: StepTable, adv: torch.Tensor, valid, seconds: float) -> None:
        m = self._metrics[mode]
        m["agentcredit/success"].append(steps.traj_success.float().mean().item())
        m["agentcredit/return"].append(steps.returns.float().mean().item())
        m["agentcredit/turns"].append(steps.traj_len.float().mean().item())
        m["agentcredit/valid"].append(float(sum(valid)) / max(len(valid), 1))
        m["agentcredit/steps"].append(float(len(adv)))
        m["agentcredit/adv_mean"].append(adv.mean().item())
        m["agentcredit/adv_std"].append(adv.std().item() if adv.numel() > 1 else 0.0)
        m["agentcredit/adv_abs_max"].append(adv.abs().max().item())
        m["agentcredit/estimator_seconds"].append(seconds)
        rollout_metrics = getattr(getattr(self, "rollout_func", None), "metrics", None)
        if callable(rollout_metrics):  # env_adapters' rollouts: success, valid rate, seconds, search cost
            for k, v in rollout_metrics().items():
                if isinstance(v, (int, float)) and v == v:
                    m[f"agentcredit/rollout/{k}"].append(float(v))
        for k, v in (getattr(self._agentcredit, "stats", None) or {}).items():
            if isinstance(v, (int, float)) and v == v:
                m[f"agentcredit/{k}"].append(float(v))

    # -- stateful estimators survive checkpoint and resume --------------------------------------------------------
    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        state = self._agentcredit.state_dict()
        if state and self.args.should_save:
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            torch.save({"credit": self.credit, "state": state}, os.path.join(folder, STATE_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        path = os.path.join(resume_from_checkpoint, STATE_FILE)
        if os.path.exists(path):
            saved = torch.load(path, weights_only=False)
            if saved["credit"] != self.credit:
                raise ValueError(f"{path} holds the state of estimator {saved['credit']!r}, but this trainer uses "
                                 f"credit={self.credit!r}; resume with the same estimator")
            self._agentcredit.load_state_dict(saved["state"])


def make_trainer(base: type | None = None, credit: str = "grpo", schedule: str | None = None,
                 name: str | None = None, *, schedule_params: dict[str, Any] | None = None, teacher: Any = None,
                 **credit_params: Any) -> type:
    """A subclass of ``base`` (default ``trl.GRPOTrainer``) whose advantages come from the estimator ``credit``.

    ``credit_params`` are the estimator's parameters (``agentcredit describe NAME``); they are validated here, so a
    typo fails before any model is loaded. ``schedule`` names a registered distillation scheduler
    (``agentcredit list schedulers``; an unknown one is a ``ValueError`` listing them) with ``schedule_params``; it
    adds :class:`distill_plugins.trl.DistillMixin` in front, with ``teacher`` (a model path / hub id, or ``"ema"``;
    or pass ``teacher_model=`` to the trainer).
    """
    if base is None:
        from trl import GRPOTrainer as base
    check_trl(base)
    registry.get(credit).make_params(**credit_params)
    mixins: list[type] = [CreditMixin]
    attrs: dict[str, Any] = {"credit": credit, "credit_params": dict(credit_params), "__module__": __name__}
    if schedule is not None:
        registry.get(schedule, kind="schedulers").make_params(**dict(schedule_params or {}))
        from distill_plugins.trl import DistillMixin

        mixins.insert(0, DistillMixin)
        attrs.update(schedule=schedule, schedule_params=dict(schedule_params or {}), teacher=teacher)
    elif schedule_params or teacher is not None:
        raise ValueError("make_trainer: schedule_params / teacher need a schedule (e.g. schedule='fixed')")
    title = "".join(part.capitalize() for part in credit.split("_"))
    return type(name or f"{title}{base.__name__}", (*mixins, base), attrs)
