"""Lazy wraps of verl's advantage step, so per-step metadata reaches our estimators.

* v1 trainer (``trainer.use_v1=True``, the default): ``PPOTrainer._compute_advantage(self, batch, metrics)`` fetches
  only 7 TransferQueue fields. The wrap also fetches each row's ``extra_fields`` (``tq.kv_batch_get(...,
  select_fields=["extra_fields"])``, the idiom verl itself uses in ``trainer_base.py``), reads the trajectory and
  step from the row keys ``{uid}_{session}_{i}`` and padding from ``batch.tags``, and publishes them. For an
  estimator that reads ``hindsight`` extras (UniOPSD, AlignOPSD) it first re-scores the failed rows under a
  successful sibling's actions with the actor worker group's ``compute_log_prob`` (:mod:`agentcredit.verl.hindsight`);
  with ``algorithm.agentcredit_archive`` set it appends the step's rollouts to that ROSS archive
  (:mod:`agentcredit.verl.archive`); rows of CCM's memory context add ``agentcredit/ccm_input_saving``
  (:func:`loop_stats`), and ``algorithm.agentcredit_ccm`` adds CCM's distillation term to their action tokens'
  advantages (:mod:`agentcredit.verl.ccm`). The archive, CCM and ``algorithm.agentcredit_adv_scale`` with an
  estimator that is not agentcredit's are an error: they act in this step only.
* v1 ``_save_checkpoint`` / ``_load_checkpoint``: the state of stateful estimators (MVPO's kappa schedule, ...)
  is saved as ``agentcredit_estimators.pt`` in each ``global_step_N`` folder and restored on resume (the folder
  verl resumed from; new checkpoints always go under ``default_local_dir``, also after ``resume_mode=resume_path``).
* legacy and separation trainers: ``compute_advantage(data, adv_estimator, ...)`` (two module bindings) gets the
  ``extra_fields`` columns from ``data.non_tensor_batch``.

Each wrap acts only when the estimator is one of ours; every other run goes straight to verl's code. They are
installed when verl imports the module (``wrapt.when_imported``), so ``import verl`` stays cheap, and each checks
that the verl internal it wraps still has the shape it needs, failing loudly when it does not.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from credit_plugins import registry

from . import adapter
from ._compat import algorithm_entry, check_signature, checkpoint_wraps, install_post_import_hooks, wraps_once
from .adapter import publish
from .contract import ENV_ERROR, ENV_ERROR_DETAIL, TRAJ, RowMeta
from .archive import archive_path, write_archive
from .ccm import add_ccm_distillation, ccm_params
from .hindsight import add_hindsight_columns, needs_hindsight

logger = logging.getLogger("agentcredit")
OURS: set[str] = set()  # names whose verl registration points at our adapter


def _name(adv_estimator: Any) -> str:
    return getattr(adv_estimator, "value", adv_estimator)


@wraps_once("credit", "compute_advantage(data, adv_estimator, ...)", ("data", "adv_estimator"))
def wrap_compute_advantage(orig):
    """Wrap ``compute_advantage(data, adv_estimator, ...)`` to publish ``data.non_tensor_batch`` metadata."""

    def compute_advantage(data, adv_estimator, *args, **kwargs):
        if _name(adv_estimator) not in OURS:
            return orig(data, adv_estimator, *args, **kwargs)
        with publish(RowMeta.from_non_tensor_batch(data.non_tensor_batch)):
            return orig(data, adv_estimator, *args, **kwargs)

    return compute_advantage


@wraps_once("credit", "PPOTrainer._compute_advantage(self, batch, metrics)", ("self", "batch", "metrics"))
def wrap_v1_compute_advantage(orig):
    """Wrap ``PPOTrainer._compute_advantage(self, batch, metrics)`` to publish the rows' ``extra_fields``."""
    import transfer_queue as tq

    check_signature(getattr(tq, "kv_batch_get", None), "transfer_queue.kv_batch_get(keys, partition_id, select_fields)",
           ("keys", "partition_id", "select_fields"))

    def _compute_advantage(self, batch, metrics):
        if _name(self.config.algorithm.adv_estimator) not in OURS:
            asked = [k for k, on in (("agentcredit_archive", archive_path(self.config.algorithm) is not None),
                                     ("agentcredit_ccm", ccm_params(self.config.algorithm) is not None),
                                     (adapter.ADV_SCALE_KEY, adv_scale_asked(self.config.algorithm))) if on]
            if asked:
                raise ValueError(f"algorithm.{asked[0]} acts in agentcredit's advantage step, which runs only for an "
                                 f"agentcredit estimator; algorithm.adv_estimator="
                                 f"{_name(self.config.algorithm.adv_estimator)!r} is verl's own. Use one of ours (for "
                                 f"GRPO: adv_estimator=gigpo with algorithm.gigpo.step_weight=0)")
            return orig(self, batch, metrics)
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["extra_fields"])
        rows = data["extra_fields"]
        rows = rows.tolist() if hasattr(rows, "tolist") else list(rows)
        meta = RowMeta.from_v1(list(batch.keys), list(batch.tags) if batch.tags is not None else None, rows)
        name = _name(self.config.algorithm.adv_estimator)
        estimator = registry.get(name)
        meta.stats.update(loop_stats(meta))
        check_env_errors(meta, self.config.algorithm)
        path = archive_path(self.config.algorithm)
        if path is not None:  # ROSS: the step's rollouts, appended to the run's archive before any credit
            meta.stats["agentcredit/archived_trajectories"] = float(write_archive(self, batch, meta, path))
        ccm = ccm_params(self.config.algorithm)
        if ccm is not None:  # CCM: the frozen reference scores the action tokens under the full history
            add_ccm_distillation(self, batch, meta, *ccm)
        if needs_hindsight(estimator):  # UniOPSD: re-score failed rows under a successful sibling's actions
            params = estimator.make_params(**adapter.estimator_params(self.config.algorithm, name))
            add_hindsight_columns(self, batch, meta, estimator, params)
        with publish(meta):
            out = orig(self, batch, metrics)
        metrics.update(meta.stats)
        return out

    return _compute_advantage


def adv_scale_asked(algorithm: Any) -> bool:
    """Whether ``algorithm.agentcredit_adv_scale`` is set to a scale other than ``none`` (checked)."""
    return algorithm_entry(algorithm, adapter.ADV_SCALE_KEY) is not None and adapter.adv_scale_mode(algorithm) != "none"


def loop_stats(meta: RowMeta) -> dict[str, float]:
    """Step statistics of the env loop's optional fields over the batch's non-padding rows: the share of turns the
    Guided-OPD teacher wrote (``by_teacher``) and their mean generated tokens (``teacher_tokens``), and for CCM's
    memory context (``context: memory``) the cumulative input saving over the full transcript,
    ``1 - sum prompt_tokens / sum full_prompt_tokens``, and the malformed-memory rate; {} when the rows have none of
    them."""
    from env_adapters.memory_context import input_token_saving

    cols = meta.columns
    stats = env_fault_stats(meta)
    rows = [i for i in range(len(meta)) if not meta.is_padding[i]]
    if not rows:
        return stats
    if "by_teacher" in cols:
        taught = [i for i in rows if bool(cols["by_teacher"][i])]
        stats["agentcredit/guided_teacher_turns"] = len(taught) / len(rows)
        if taught and "teacher_tokens" in cols:  # a teacher turn of one token cannot hold an action
            tokens = sum(int(cols["teacher_tokens"][i]) for i in taught)
            stats["agentcredit/guided_teacher_tokens"] = tokens / len(taught)
    if "full_prompt_tokens" not in cols or "prompt_tokens" not in cols:
        return stats
    stats |= {"agentcredit/ccm_input_saving": input_token_saving([int(cols["prompt_tokens"][i]) for i in rows],
                                                                [int(cols["full_prompt_tokens"][i]) for i in rows])}
    if "memory_malformed" in cols:
        stats["agentcredit/ccm_malformed_memory"] = sum(bool(cols["memory_malformed"][i]) for i in rows) / len(rows)
    return stats


#: the largest share of a step's episodes whose env may fault before the run stops (``algorithm.<this key>``)
MAX_ENV_ERROR_RATE_KEY, MAX_ENV_ERROR_RATE = "agentcredit_max_env_error_rate", 0.25


def _faulted_episodes(meta: RowMeta) -> tuple[dict[str, int], int]:
    """``({traj: a row of it}, episodes)``: the step's episodes whose env faulted (one row each), and all episodes,
    over the rows verl did not add as padding."""
    cols = meta.columns
    rows = np.flatnonzero(~meta.batch_padding)
    if ENV_ERROR not in cols or TRAJ not in cols:
        return {}, len({cols[TRAJ][i] for i in rows}) if TRAJ in cols else 0
    faulted = {str(cols[TRAJ][i]): int(i) for i in rows if cols[ENV_ERROR][i]}
    return faulted, len({str(cols[TRAJ][i]) for i in rows})


def env_fault_stats(meta: RowMeta) -> dict[str, float]:
    """``agentcredit/env_errors`` (episodes whose env raised, hung or died this step), ``.../env_timeouts`` (those that
    hung), ``.../env_error_rate`` (their share of the step's episodes) and ``.../env_fault_rows`` (placeholder rows of
    episodes that faulted before their first turn); {} when the rows carry no ``env_error`` field."""
    if ENV_ERROR not in meta.columns:
        return {}
    faulted, episodes = _faulted_episodes(meta)
    kinds = [meta.columns[ENV_ERROR][i] for i in faulted.values()]
    return {"agentcredit/env_errors": float(len(faulted)),
            "agentcredit/env_timeouts": float(sum(k == "timeout" for k in kinds)),
            "agentcredit/env_error_rate": len(faulted) / episodes if episodes else 0.0,
            "agentcredit/env_fault_rows": float(meta.fault_rows.sum()) if meta.fault_rows is not None else 0.0}


def check_env_errors(meta: RowMeta, algorithm) -> None:
    """Stop the run when more than ``algorithm.agentcredit_max_env_error_rate`` (default 0.25) of the step's episodes
    had an env fault: a ``RuntimeError`` naming the env, the seed and the first traceback, instead of training on
    what is left."""
    limit = float(algorithm.get(MAX_ENV_ERROR_RATE_KEY, MAX_ENV_ERROR_RATE))
    if not 0.0 <= limit <= 1.0:
        raise ValueError(f"algorithm.{MAX_ENV_ERROR_RATE_KEY}={limit}; use a share in [0, 1] (1: never stop)")
    faulted, episodes = _faulted_episodes(meta)
    if not faulted or len(faulted) / episodes <= limit:
        return
    detail = meta.columns.get(ENV_ERROR_DETAIL, [""] * len(meta))[next(iter(faulted.values()))]
    raise RuntimeError(f"agentcredit: {len(faulted)} of {episodes} episodes of this step had an env fault, more than "
                       f"algorithm.{MAX_ENV_ERROR_RATE_KEY}={limit}; stopping instead of training on the rest. The "
                       f"first one: {detail}")


STATE_FILE = "agentcredit_estimators.pt"


def _restore(states, path: str) -> None:
    adapter.load_state_dicts(states)
    logger.warning("agentcredit: restored the state of %s from %s", sorted(states), path)


#: after verl saves / resumes a checkpoint, the stateful estimators' ``state_dict()`` is saved / restored beside it
wrap_save_checkpoint, wrap_load_checkpoint = checkpoint_wraps("credit", STATE_FILE, adapter.state_dicts, _restore)


def _patch_compute_advantage(module) -> None:
    """Each module that binds ``compute_advantage`` by name gets its binding wrapped."""
    module.compute_advantage = wrap_compute_advantage(module.compute_advantage)


def _patch_v1_trainer(module) -> None:
    cls = module.PPOTrainer
    cls._compute_advantage = wrap_v1_compute_advantage(cls.__dict__.get("_compute_advantage"))
    cls._save_checkpoint = wrap_save_checkpoint(cls.__dict__.get("_save_checkpoint"))
    cls._load_checkpoint = wrap_load_checkpoint(cls.__dict__.get("_load_checkpoint"))


TARGETS = {
    "verl.trainer.ppo.ray_trainer": _patch_compute_advantage,
    "verl.experimental.separation.ray_trainer": _patch_compute_advantage,
    "verl.trainer.ppo.v1.utils": _patch_compute_advantage,
    "verl.trainer.ppo.v1.trainer_base": _patch_v1_trainer,
}


def install() -> None:
    """Register the post-import hooks (they run at once for modules already imported)."""
    install_post_import_hooks(TARGETS, "step-level estimators will not get their metadata")
