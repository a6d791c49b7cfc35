"""The TRL bridge: a cooperative ``GRPOTrainer`` mixin that replaces GRPO's advantages with an agentcredit estimator's.

    from trl import GRPOTrainer
    from agentcredit.trl import make_trainer

    Trainer = make_trainer(GRPOTrainer, credit="gigpo", gamma=0.9)   # a GRPOTrainer subclass
    trainer = Trainer(model=..., args=GRPOConfig(...), reward_funcs=..., rollout_func=..., train_dataset=...)

or ``class MyTrainer(CreditMixin, GRPOTrainer): credit = "graphhca"``. Nothing else in TRL changes: every
``loss_type``, PEFT, DeepSpeed/FSDP and vLLM path stays TRL's (pinned ``trl>=1.16,<1.17``).

How it works (TRL 1.16, ``trl/trainer/grpo_trainer.py``)
--------------------------------------------------------
* ``_calculate_rewards`` is called once per generation round inside ``_generate_and_score_completions`` with the
  local ``inputs`` (dataset columns plus the ``rollout_func``'s extra fields) and returns the rewards of every
  process (gathered). The mixin keeps both.
* After the parent's ``_generate_and_score_completions``, the mixin collects this rank's steps as :class:`StepRow`
  records and gathers every rank's (so groups may span ranks), builds one :class:`~credit_plugins.StepTable` over
  the **global** generation batch, calls the estimator, and scatters its advantages into ``output["advantages"]``, a
  ``[B_local, T]`` tensor: each step's advantage on the tokens of its turn, 0 on prompt, env and padding tokens.
  ``_compute_loss`` keeps ``[B, T]`` advantages as they are (``if advantages.dim() == 1: unsqueeze``), so every loss
  type uses them unchanged.
* Groups are TRL's own: global row ``i`` belongs to group ``i // num_generations`` (``RepeatSampler`` puts the
  ``num_generations`` rollouts of a prompt next to each other).

Where the steps come from (the first that applies)
--------------------------------------------------
1. **One row per turn** (``agentcredit.trl.rollouts.TurnRollout``): the rows carry the extra fields
   ``agentcredit_traj`` (-1: padding row, left out), ``agentcredit_t``, ``agentcredit_state``,
   ``agentcredit_action``, ``agentcredit_success``, ``agentcredit_truncated`` and ``agentcredit_valid``, and
   optionally ``agentcredit_state_text`` (the state's text, read only for an estimator that compares state texts:
   ``Estimator.reads_state_text``) and ``agentcredit_extras`` (a dict per row, turned into StepTable extras:
   scalars ``[S]``, lists ``[S, A]``; a tree's ``parent`` gets the rank offset of ``traj``). A row is one step;
   its reward is the row's TRL reward (the rollout's ``reward_func`` returns the step reward). Token-level
   estimators (``[S, T]``: UniOPSD and AlignOPSD, whose hindsight extras :mod:`agentcredit.trl.privileged`
   computes here) need this layout.
2. **One row per episode** (``environment_factory``, TRL's tool loop): the environment instance of row ``i``
   (``trainer.environments[i]``) keeps ``agentcredit_turns`` (one record ``{state, action, reward, valid}`` per tool
   call), ``agentcredit_final_state``, ``agentcredit_success`` and ``agentcredit_done``. The turns are the runs of
   ``completion_mask * tool_mask == 1``; turn ``k`` takes record ``k`` (a turn past the records, e.g. the final text
   answer, is a step with no action and reward 0 in the final state). What the row's TRL reward adds beyond the
   records' rewards (other reward functions) lands on its last step.
3. **Anything else** (a plain dataset, TRL's own generation): one step per row, reward = the row's TRL reward, state
   = the prompt. With ``credit="grpo", eps=1e-4`` this reproduces stock GRPO (``scale_rewards="group"``) exactly.

TRL's ``scale_rewards`` and ``multi_objective_aggregation`` no longer shape the advantages (the estimator's own
normalisation does); a non-default value logs a warning. ``adv_scale`` (:mod:`credit_plugins.scaling`: ``none``,
the default :data:`~credit_plugins.scaling.DEFAULT_ADV_SCALE`; ``batch_rms``; ``batch_std``) then divides the
estimator's output by one statistic of the global batch (over the step rows of ``[S]`` advantages, over the rows'
model tokens of ``[S, T]`` ones), before the scatter and before :class:`~agentcredit.trl.distill.DistillMixin`
combines it with the distillation term. Unscorable rows (every reward function returned None) are left out of the
table and get advantage 0, as in TRL. Stateful estimators (MVPO) keep one instance per trainer;
its ``state_dict()`` is saved in each checkpoint (``agentcredit_estimator.pt``) and restored on resume.
Metrics added to TRL's logs: ``agentcredit/{success,return,turns,valid,adv_mean,adv_std,adv_abs_max,steps}``
(``adv_*``: the estimator's output, before ``adv_scale``), ``agentcredit/adv_scale_factor`` (what ``adv_scale``
multiplied them by; 1 with ``none``), the credit diagnostics ``agentcredit/diag_*`` (:mod:`credit_plugins.diagnostics`),
a stateful estimator's ``stats``, the rollout's ``metrics()`` as ``agentcredit/rollout/*`` (seconds, search cost) and,
for the hindsight estimators, ``agentcredit/hindsight_*`` (taught fraction, seconds).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from credit_plugins import registry
from credit_plugins.diagnostics import NoSignalWarning, credit_diagnostics
from credit_plugins.estimators.mix import reads_extra
from credit_plugins.estimators.mvpo import default_signature
from credit_plugins.hashing import stable_hash
from credit_plugins.scaling import DEFAULT_ADV_SCALE, adv_scale_factor, check_adv_scale
from credit_plugins.steptable import StepTable, list_block

from ..state import load_state
from ._compat import TRLInternalsChanged, check_trl, checkpoint_folder, cpu_vllm_engine, grpo_trainer

__all__ = ["CreditMixin", "make_trainer", "term_mixin", "check_trl", "TRLInternalsChanged", "turn_ids_from_mask",
           "StepRow", "STATE_FILE"]

logger = logging.getLogger("agentcredit")

#: file of a stateful estimator's ``state_dict()`` inside a TRL checkpoint folder
STATE_FILE = "agentcredit_estimator.pt"


def turn_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` turn index of each token: the k-th run of ones in ``mask`` (model tokens) is turn k; -1 elsewhere."""
    m = mask.bool()
    starts = m & ~torch.nn.functional.pad(m, (1, 0))[:, :-1]
    ids = torch.cumsum(starts.long(), dim=1) - 1
    return torch.where(m, ids, torch.full_like(ids, -1))


#: per-rank offset of ``traj`` (and of the node-id extras) that makes trajectory ids unique over the global batch
TRAJ_STRIDE = 1 << 32


@dataclass(frozen=True, slots=True)
class StepRow:
    """One step of the generation batch, as the bridge collects it (picklable: ranks exchange them with
    ``accelerate.utils.gather_object``).

    ``row`` is the step's row of this rank's generation batch and ``turn`` its turn there (the k-th run of model
    tokens; 0 in the one-row-per-turn layout); ``traj`` .. ``valid`` are the StepTable columns and ``extras`` the
    rollout's ``agentcredit_extras`` of the row; ``state_text`` is the state's text, collected only for an
    estimator that compares state texts (``Estimator.reads_state_text``). :meth:`placed` fills the batch-wide
    fields: ``rank`` (the process that generated the row), ``global_row`` (its row in the global batch) and
    ``group`` (TRL's prompt group), and makes ``traj`` unique over the batch.
    """

    row: int
    turn: int
    traj: int
    t: int
    state: int
    action: int
    reward: float
    success: bool
    truncated: bool
    valid: bool = True
    extras: dict[str, Any] = field(default_factory=dict)
    state_text: str | None = None
    rank: int = 0
    global_row: int = -1
    group: int = -1

    def placed(self, rank: int, n_local: int, num_generations: int) -> StepRow:
        """This row as row ``row`` of rank ``rank`` (``n_local`` rows per rank, groups of ``num_generations``)."""
        global_row = self.row + rank * n_local
        return replace(self, rank=rank, global_row=global_row, group=global_row // num_generations,
                       traj=rank * TRAJ_STRIDE + self.traj)


def _step_rows_per_turn(inputs: list[dict], rewards: torch.Tensor, texts: bool = False) -> list[StepRow]:
    """Rows of a one-row-per-turn rollout (one step each, turn 0); padding rows (traj -1) and unscorable rows (NaN
    reward) are left out. ``texts``: keep each row's ``agentcredit_state_text``."""
    out = []
    for i, row in enumerate(inputs):
        traj = int(row["agentcredit_traj"])
        r = float(rewards[i])
        if traj < 0 or r != r:
            continue
        out.append(StepRow(row=i, turn=0, traj=traj, t=int(row["agentcredit_t"]), state=int(row["agentcredit_state"]),
                           action=int(row["agentcredit_action"]), reward=r,
                           success=bool(row["agentcredit_success"]), truncated=bool(row["agentcredit_truncated"]),
                           valid=bool(row.get("agentcredit_valid", True)),
                           extras=dict(row.get("agentcredit_extras") or {}),
                           state_text=row.get("agentcredit_state_text") if texts else None))
    return out


def _step_rows_from_envs(envs: list, rewards: torch.Tensor, n_turns: list[int], texts: bool = False
                         ) -> list[StepRow]:
    """Rows of whole-episode rollouts whose environments recorded ``agentcredit_turns`` (see the module doc): step
    ``k`` of row ``i`` is its turn ``k`` (traj ``i``, t ``k``). ``texts``: keep the records' ``state_text``."""
    out = []
    for i, env in enumerate(envs):
        r_row = float(rewards[i])
        if r_row != r_row:
            continue
        records = list(getattr(env, "agentcredit_turns", []))
        final = int(getattr(env, "agentcredit_final_state", 0))
        final_text = getattr(env, "agentcredit_final_state_text", None) if texts else None
        n = max(int(n_turns[i]), 1)
        steps = []
        for k in range(n):
            if k < len(records):
                rec = records[k]
                steps.append([k, int(rec["state"]), int(rec["action"]), float(rec["reward"]),
                              bool(rec.get("valid", True)), rec.get("state_text") if texts else None])
            else:
                steps.append([k, final, -1, 0.0, False, final_text])
        steps[-1][3] += r_row - sum(s[3] for s in steps)  # other reward functions' share lands on the last step
        success = bool(getattr(env, "agentcredit_success", False))
        truncated = not bool(getattr(env, "agentcredit_done", False))
        out.extend(StepRow(row=i, turn=k, traj=i, t=k, state=state, action=action, reward=reward, success=success,
                           truncated=truncated, valid=valid, state_text=text)
                   for k, state, action, reward, valid, text in steps)
    return out


def _step_rows_plain(prompts: list, rewards: torch.Tensor, texts: bool = False) -> list[StepRow]:
    """One step per row: reward = the row's TRL reward, state = the prompt (NaN rows left out)."""
    return [StepRow(row=i, turn=0, traj=i, t=0, state=stable_hash(repr(p)), action=-1, reward=float(rewards[i]),
                    success=float(rewards[i]) > 0, truncated=False, state_text=repr(p) if texts else None)
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

    Class attributes (or :func:`make_trainer` arguments): ``credit`` (a registered estimator name),
    ``credit_params`` (its parameters, validated when the trainer is built) and ``adv_scale``
    (:data:`credit_plugins.scaling.ADV_SCALES`; also a keyword of ``__init__``, which wins; None: the default).
    """

    credit: str = "grpo"
    credit_params: dict[str, Any] = {}
    adv_scale: str = DEFAULT_ADV_SCALE

    def __init__(self, *args, adv_scale: str | None = None, **kwargs):
        check_trl(next(c for c in type(self).__mro__ if c.__name__ == "GRPOTrainer"))
        self.adv_scale = check_adv_scale(self.adv_scale if adv_scale is None else adv_scale)
        self._agentcredit = registry.get(self.credit).create(**dict(self.credit_params))
        # estimators whose step credit comes from revisited states warn once when it stays silent
        self._agentcredit_silence = (NoSignalWarning(self.credit) if "state" in registry.get(self.credit).requires
                                     else None)
        # an estimator that merges similar states (similarity_thresh) reads the state texts, not only their hashes
        self._agentcredit_texts = registry.get(self.credit).reads_state_text(**dict(self.credit_params))
        self._agentcredit_ctx: dict[str, Any] | None = None
        cpu_vllm_engine()
        super().__init__(*args, **kwargs)
        if self.adv_scale != "none" and registry.get(self.credit).output == "token" and \
                self.accelerator.num_processes > 1:
            raise ValueError(f"adv_scale={self.adv_scale!r} with the per-token estimator {self.credit!r} needs one "
                             f"process (its statistic runs over the batch's tokens, which each rank holds apart); run "
                             f"without torchrun/accelerate launch or use adv_scale='none'")
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
        rows, mask, turn_ids = self._agentcredit_collect(output, ctx, mode)
        advantages = torch.zeros(mask.shape, dtype=torch.float32)
        if rows:
            steps = self._agentcredit_table(output, rows, ctx["inputs"], mode)
            adv = self._agentcredit(steps).to(torch.float32)
            rank = self.accelerator.process_index
            advantages = self._agentcredit_scatter(adv, rows, rank, mask, turn_ids, self.credit)
            factor = self._agentcredit_scale_factor(adv, rows, rank, mask, self.adv_scale)
            advantages = advantages * factor  # adv_scale: after the estimator, before DistillMixin's combination
            self._agentcredit_log(mode, steps, adv, [r.valid for r in rows], time.perf_counter() - started, factor)
        output["advantages"] = advantages.to(output["completion_ids"].device)
        return output

    def _agentcredit_collect(self, output, ctx: dict[str, Any], mode: str
                             ) -> tuple[list[StepRow], torch.Tensor, torch.Tensor]:
        """Every rank's step rows (in rank order, placed in the global batch), and this rank's ``[B_local, T]`` model
        token mask and turn ids (-1 off the model's tokens)."""
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
            rows = _step_rows_per_turn(local_inputs, local_rewards, self._agentcredit_texts)
        elif envs and hasattr(envs[0], "agentcredit_turns"):
            rows = _step_rows_from_envs(envs, local_rewards, (turn_ids.max(dim=1).values + 1).tolist(),
                                        self._agentcredit_texts)
        else:
            rows = _step_rows_plain(ctx["prompts"], local_rewards, self._agentcredit_texts)
        # global row, group and a batch-unique trajectory id; then every rank sees every rank's steps
        rows = [r.placed(rank, n_local, G) for r in rows]
        return self._agentcredit_gather(rows), mask, turn_ids

    def _agentcredit_table(self, output, rows: list[StepRow], local_inputs, mode: str) -> StepTable:
        """The StepTable of ``rows`` (all ranks'), with the rollout's extras and, for an estimator that reads
        ``hindsight`` extras, those (computed here, one process)."""
        extras = _row_extras([r.extras for r in rows], rank_offsets=[r.rank * TRAJ_STRIDE for r in rows])
        if "signature" not in extras and reads_extra(self.credit, self.credit_params, "signature"):
            # MVPO (or a mix with an MVPO part) and an env without a progress parser: state + depth bin (App. A.3)
            extras["signature"] = [default_signature(r.state, r.t) for r in rows]
        steps = StepTable(group=[r.group for r in rows], traj=[r.traj for r in rows], t=[r.t for r in rows],
                          state=self._agentcredit_states(rows), action=[r.action for r in rows],
                          reward=[r.reward for r in rows], success=[r.success for r in rows],
                          truncated=[r.truncated for r in rows], extras=extras or None)
        if "hindsight" in registry.get(self.credit).sources():
            rank = self.accelerator.process_index
            local_row = torch.tensor([r.row for r in rows if r.rank == rank], dtype=torch.long)
            steps = self._agentcredit_hindsight(output, steps, local_row, local_inputs, mode, [r.valid for r in rows])
        return steps

    def _agentcredit_states(self, rows: Sequence[StepRow]) -> list:
        """The state column: the hashes, or the texts (same keys once hashed) for an estimator that compares them."""
        if not self._agentcredit_texts:
            return [r.state for r in rows]
        missing = next((r for r in rows if r.state_text is None), None)
        if missing is not None:
            raise ValueError(f"estimator {self.credit!r} with these parameters merges similar states by their text "
                             f"(similarity_thresh), but the rollout gave step {missing.t} of row {missing.global_row} "
                             f"no state text; use agentcredit.trl.rollouts.TurnRollout or "
                             f"agentcredit.trl.env_factory.environment_factory (they record it), or "
                             f"similarity_thresh=None")
        return [r.state_text for r in rows]

    @staticmethod
    def _agentcredit_scatter(adv: torch.Tensor, rows: Sequence[StepRow], rank: int, mask: torch.Tensor,
                             turn_ids: torch.Tensor, credit: str) -> torch.Tensor:
        """The ``[B_local, T]`` advantages of rank ``rank``'s rows: a per-step ``adv`` ``[S]`` (row ``j`` of ``rows``)
        on every token of the step's turn, a per-token ``[S, T]`` one (one step per completion row) times ``mask``;
        0 on tokens outside the turns (``turn_ids`` -1) and on rows without a step."""
        advantages = torch.zeros(mask.shape, dtype=torch.float32)
        mine = torch.tensor([r.rank == rank for r in rows])
        local_row = torch.tensor([r.row for r in rows])[mine]
        local_turn = torch.tensor([r.turn for r in rows])[mine]
        if adv.dim() == 2:  # per token: each step row is one whole completion row (one-row-per-turn)
            if adv.size(1) != mask.size(1):
                raise ValueError(f"estimator {credit!r} returned {adv.size(1)} token columns for "
                                 f"completions of {mask.size(1)} tokens")
            advantages[local_row] = adv[mine] * mask[local_row]
        elif adv.dim() != 1:
            raise ValueError(f"estimator {credit!r} returned shape {tuple(adv.shape)}; the TRL bridge "
                             "takes per-step [S] or per-token [S, T] advantages")
        else:
            n_turns = int(turn_ids.max().item()) + 1 if turn_ids.numel() else 0
            table = torch.zeros(mask.size(0), max(n_turns, int(local_turn.max()) + 1 if len(local_turn) else 1))
            table[local_row, local_turn] = adv[mine]
            in_turn = turn_ids >= 0
            advantages = torch.where(in_turn, table.gather(1, turn_ids.clamp(min=0)), advantages)
        return advantages

    @staticmethod
    def _agentcredit_scale_factor(adv: torch.Tensor, rows: Sequence[StepRow], rank: int, mask: torch.Tensor,
                                  adv_scale: str) -> float:
        """The ``adv_scale`` factor (:func:`credit_plugins.scaling.adv_scale_factor`) of the estimator's output
        ``adv``: over every rank's step rows for ``[S]``, over the rows' model tokens (``mask``) for ``[S, T]``."""
        if adv.dim() != 2:
            return adv_scale_factor(adv, adv_scale)
        if any(r.rank != rank for r in rows):
            raise ValueError(f"adv_scale={adv_scale!r}: per-token advantages of several processes' rows; run in one "
                             f"process or use adv_scale='none'")
        local_row = torch.tensor([r.row for r in rows], dtype=torch.long)
        return adv_scale_factor(adv, adv_scale, mask[local_row].bool())

    def _agentcredit_hindsight(self, output, steps: StepTable, local_row: torch.Tensor, local_inputs, mode: str,
                               valid) -> StepTable:
        """``steps`` with the token-level hindsight extras (:mod:`agentcredit.trl.privileged`) of UniOPSD/AlignOPSD."""
        from .privileged import hindsight_extras

        if self.accelerator.num_processes > 1:
            raise ValueError(f"estimator {self.credit!r} scores hindsight prompts of a trajectory's successful "
                             f"sibling; the TRL bridge does this in one process only (run without torchrun/accelerate "
                             f"launch, or use a step-level estimator)")
        if not (local_inputs and "agentcredit_traj" in local_inputs[0]):
            raise ValueError(f"estimator {self.credit!r} needs the one-row-per-turn layout: use "
                             f"rollout_func=agentcredit.trl.rollouts.TurnRollout (recipes: agentcredit.rollout: turns)")
        params = getattr(self._agentcredit, "params", None)
        token = hindsight_extras(self, output, steps, local_row.tolist(), self.credit, params)
        if registry.get(self.credit).reads("valid"):  # e.g. AlignOPSD's invalid-action residual
            token["valid"] = torch.tensor([bool(v) for v in valid])
        stats = token.pop("_stats")
        for k, v in stats.items():
            self._metrics[mode][f"agentcredit/hindsight_{k}"].append(float(v))
        return steps.with_extras(token)

    def _agentcredit_gather(self, rows: list[StepRow]) -> list[StepRow]:
        if self.accelerator.num_processes == 1:
            return rows
        from accelerate.utils import gather_object

        return [r for chunk in gather_object([rows]) for r in chunk]  # one list per rank, in rank order

    def _agentcredit_log(self, mode: str, steps: StepTable, adv: torch.Tensor, valid, seconds: float,
                         factor: float = 1.0) -> None:
        m = self._metrics[mode]
        m["agentcredit/success"].append(steps.traj_success.float().mean().item())
        m["agentcredit/return"].append(steps.returns.float().mean().item())
        m["agentcredit/turns"].append(steps.traj_len.float().mean().item())
        m["agentcredit/valid"].append(float(sum(valid)) / max(len(valid), 1))
        m["agentcredit/steps"].append(float(len(adv)))
        m["agentcredit/adv_mean"].append(adv.mean().item())
        m["agentcredit/adv_std"].append(adv.std().item() if adv.numel() > 1 else 0.0)
        m["agentcredit/adv_abs_max"].append(adv.abs().max().item())
        m["agentcredit/adv_scale_factor"].append(float(factor))
        m["agentcredit/estimator_seconds"].append(seconds)
        diag = credit_diagnostics(steps, adv)  # is there anything for step credit to work with?
        for k, v in diag.items():
            m[f"agentcredit/diag_{k}"].append(v)
        if mode == "train" and self._agentcredit_silence is not None:
            self._agentcredit_silence.update(diag)
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
            torch.save({"credit": self.credit, "state": state}, os.path.join(checkpoint_folder(self, trial), STATE_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        path = os.path.join(resume_from_checkpoint, STATE_FILE)
        if os.path.exists(path):
            saved = load_state(path)
            if saved["credit"] != self.credit:
                raise ValueError(f"{path} holds the state of estimator {saved['credit']!r}, but this trainer uses "
                                 f"credit={self.credit!r}; resume with the same estimator")
            self._agentcredit.load_state_dict(saved["state"])


def term_mixin(name: str) -> type:
    """The TRL mixin that runs the registered term ``name``: the spec's ``trl_mixin`` (``"module:Class"``) when it
    has one, else ``TermMixin`` of the module ``agentcredit.trl.<name>`` (the built-in terms)."""
    import importlib

    spec = registry.get(name, kind="terms")
    if "trl" not in getattr(spec, "bridges", ("trl",)):
        raise ValueError(f"term {name!r} runs on {', '.join(spec.bridges)}, not on TRL")
    module, _, attr = (getattr(spec, "trl_mixin", None) or f"{__package__}.{name}:TermMixin").partition(":")
    return getattr(importlib.import_module(module), attr)


def make_trainer(base: type | None = None, credit: str = "grpo", schedule: str | None = None,
                 name: str | None = None, *, schedule_params: dict[str, Any] | None = None, teacher: Any = None,
                 terms: dict[str, dict[str, Any] | None] | None = None, adv_scale: str | None = None,
                 **credit_params: Any) -> type:
    """A subclass of ``base`` (default ``trl.GRPOTrainer``) whose advantages come from the estimator ``credit``.

    ``credit_params`` are the estimator's parameters (``agentcredit describe NAME``); they are validated here, so a
    typo fails before any model is loaded. ``schedule`` names a registered distillation scheduler
    (``agentcredit list schedulers``; an unknown one is a ``ValueError`` listing them) with ``schedule_params``; it
    adds :class:`agentcredit.trl.distill.DistillMixin` in front, with ``teacher`` (a model path / hub id, or ``"ema"``;
    or pass ``teacher_model=`` to the trainer). ``terms`` maps registered auxiliary terms (``agentcredit list terms``)
    to their parameters (``None``: the defaults); each adds its mixin (:func:`term_mixin`) in front, which reads its
    parameters from the class attribute ``terms``. ``adv_scale`` (:data:`credit_plugins.scaling.ADV_SCALES`; None:
    :data:`~credit_plugins.scaling.DEFAULT_ADV_SCALE`) divides the estimator's advantages by a batch statistic.
    """
    if base is None:
        base = grpo_trainer()
    check_trl(base)
    registry.get(credit).make_params(**credit_params)
    mixins: list[type] = [CreditMixin]
    attrs: dict[str, Any] = {"credit": credit, "credit_params": dict(credit_params), "__module__": __name__,
                             "adv_scale": check_adv_scale(adv_scale)}
    if schedule is not None:
        registry.get(schedule, kind="schedulers").make_params(**dict(schedule_params or {}))
        from .distill import DistillMixin

        mixins.insert(0, DistillMixin)
        attrs.update(schedule=schedule, schedule_params=dict(schedule_params or {}), teacher=teacher)
    elif schedule_params or teacher is not None:
        raise ValueError("make_trainer: schedule_params / teacher need a schedule (e.g. schedule='fixed')")
    if terms:
        terms = {str(k): dict(v or {}) for k, v in terms.items()}
        for term, params in terms.items():
            registry.get(term, kind="terms").make_params(**params)
        mixins[:0] = [term_mixin(term) for term in terms]
        attrs["terms"] = terms
    title = "".join(part.capitalize() for part in credit.split("_"))
    return type(name or f"{title}{base.__name__}", (*mixins, base), attrs)
