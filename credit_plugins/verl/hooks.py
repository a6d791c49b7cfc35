"""Lazy wraps of verl's advantage step, so per-step metadata reaches our estimators.

* v1 trainer (``trainer.use_v1=True``, the default): ``PPOTrainer._compute_advantage(self, batch, metrics)`` fetches
  only 7 TransferQueue fields. The wrap also fetches each row's ``extra_fields`` (``tq.kv_batch_get(...,
  select_fields=["extra_fields"])``, the idiom verl itself uses in ``trainer_base.py``), reads the trajectory and
  step from the row keys ``{uid}_{session}_{i}`` and padding from ``batch.tags``, and publishes them.
* v1 ``_save_checkpoint`` / ``_load_checkpoint``: the state of stateful estimators (MVPO's kappa schedule, ...)
  is saved as ``agentcredit_estimators.pt`` in each ``global_step_N`` folder and restored on resume.
* legacy and separation trainers: ``compute_advantage(data, adv_estimator, ...)`` (two module bindings) gets the
  ``extra_fields`` columns from ``data.non_tensor_batch``.

Each wrap acts only when the estimator is one of ours; every other run goes straight to verl's code. They are
installed when verl imports the module (``wrapt.when_imported``), so ``import verl`` stays cheap, and each checks
that the verl internal it wraps still has the shape it needs, failing loudly when it does not.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from typing import Any

import torch

from ..post_import import install_post_import_hooks
from . import adapter
from .adapter import publish
from .contract import RowMeta

logger = logging.getLogger("agentcredit")
OURS: set[str] = set()  # names whose verl registration points at our adapter


class VerlInternalsChanged(RuntimeError):
    """verl no longer has the internal function or signature the bridge wraps."""


def _check(obj: Any, what: str, params: tuple[str, ...]) -> None:
    if obj is None:
        raise VerlInternalsChanged(f"agentcredit: verl has no {what}; this bridge supports verl>=0.9.1,<0.10")
    names = list(inspect.signature(obj).parameters)
    if names[: len(params)] != list(params):
        raise VerlInternalsChanged(f"agentcredit: verl's {what} takes {names}, expected the first to be "
                                   f"{list(params)}; this bridge supports verl>=0.9.1,<0.10")


def _name(adv_estimator: Any) -> str:
    return getattr(adv_estimator, "value", adv_estimator)


def _wraps_once(what: str, params: tuple[str, ...]):
    """Decorator for a wrapper factory: check ``orig``'s signature, wrap it once, mark the result as ours."""

    def decorate(build):
        @functools.wraps(build)
        def wrap(orig):
            if getattr(orig, "_agentcredit", False):
                return orig
            _check(orig, what, params)
            wrapped = functools.wraps(orig)(build(orig))
            wrapped._agentcredit = True
            return wrapped

        return wrap

    return decorate


@_wraps_once("compute_advantage(data, adv_estimator, ...)", ("data", "adv_estimator"))
def wrap_compute_advantage(orig):
    """Wrap ``compute_advantage(data, adv_estimator, ...)`` to publish ``data.non_tensor_batch`` metadata."""

    def compute_advantage(data, adv_estimator, *args, **kwargs):
        if _name(adv_estimator) not in OURS:
            return orig(data, adv_estimator, *args, **kwargs)
        with publish(RowMeta.from_non_tensor_batch(data.non_tensor_batch)):
            return orig(data, adv_estimator, *args, **kwargs)

    return compute_advantage


@_wraps_once("PPOTrainer._compute_advantage(self, batch, metrics)", ("self", "batch", "metrics"))
def wrap_v1_compute_advantage(orig):
    """Wrap ``PPOTrainer._compute_advantage(self, batch, metrics)`` to publish the rows' ``extra_fields``."""
    import transfer_queue as tq

    _check(getattr(tq, "kv_batch_get", None), "transfer_queue.kv_batch_get(keys, partition_id, select_fields)",
           ("keys", "partition_id", "select_fields"))

    def _compute_advantage(self, batch, metrics):
        if _name(self.config.algorithm.adv_estimator) not in OURS:
            return orig(self, batch, metrics)
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["extra_fields"])
        rows = data["extra_fields"]
        rows = rows.tolist() if hasattr(rows, "tolist") else list(rows)
        meta = RowMeta.from_v1(list(batch.keys), list(batch.tags) if batch.tags is not None else None, rows)
        with publish(meta):
            out = orig(self, batch, metrics)
        metrics.update(meta.stats)
        return out

    return _compute_advantage


STATE_FILE = "agentcredit_estimators.pt"


def _checkpoint_folder(trainer) -> str | None:
    """The ``global_step_N`` folder verl just saved to or resumed from (same rules as verl's trainer)."""
    cfg = trainer.config.trainer
    if getattr(trainer, "global_steps", 0) <= 0:
        return None
    resume_path = cfg.get("resume_from_path", None)
    if cfg.get("resume_mode", "auto") == "resume_path" and resume_path:
        return resume_path
    return os.path.join(cfg.default_local_dir, f"global_step_{trainer.global_steps}")


@_wraps_once("PPOTrainer._save_checkpoint(self)", ("self",))
def wrap_save_checkpoint(orig):
    """After verl saves a checkpoint, save the stateful estimators' ``state_dict()`` beside it."""

    def _save_checkpoint(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        states = adapter.state_dicts()
        folder = _checkpoint_folder(self)
        if states and folder is not None:
            torch.save(states, os.path.join(folder, STATE_FILE))
        return out

    return _save_checkpoint


@_wraps_once("PPOTrainer._load_checkpoint(self)", ("self",))
def wrap_load_checkpoint(orig):
    """After verl resumes, restore the stateful estimators saved with that checkpoint."""

    def _load_checkpoint(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        folder = _checkpoint_folder(self)
        path = None if folder is None else os.path.join(folder, STATE_FILE)
        if path is not None and os.path.exists(path):
            states = torch.load(path, weights_only=False)
            adapter.load_state_dicts(states)
            logger.warning("agentcredit: restored the state of %s from %s", sorted(states), path)
        return out

    return _load_checkpoint


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
