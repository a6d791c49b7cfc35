"""agentcredit's verl bridge. verl imports this module through the ``verl.plugins`` entry point.

On import it registers every agentcredit estimator with ``verl.trainer.ppo.core_algos.register_adv_est`` (a name
verl already has, such as ``grpo``, keeps verl's function), installs the lazy trainer hooks of
:mod:`credit_plugins.verl.hooks`, and logs one WARNING line saying what it did (verl hides plugin-load errors at
DEBUG level; ``VERL_USE_EXTERNAL_MODULES=credit_plugins.verl`` loads it loudly instead).

Usage::

    python -m verl.trainer.main_ppo algorithm.adv_estimator=gigpo +algorithm.gigpo.step_weight=0.5 ...
    python -m verl.trainer.main_ppo --config-name agentcredit_ppo algorithm.adv_estimator=gigpo \\
        algorithm.gigpo.step_weight=0.5 ...          # no '+' needed: the config ships every estimator's defaults

Hyperparameters live under ``algorithm.<estimator>.*`` (verl passes ``config=algorithm`` as a raw DictConfig).

Metadata contract: the agent loop returns one ``AgentLoopOutput`` per step (v1 trainer), each with
``extra_fields`` carrying the keys of :mod:`credit_plugins.verl.contract`::

    extra_fields = {"step_idx": t, "anchor_key": canonical_obs, "action_key": parsed_action,
                    "step_reward": r_t, "success": won, "truncated": hit_step_limit}

Only ``anchor_key`` is required by step-level estimators (``step_idx`` and the trajectory come from the row keys in
v1); on the legacy trainer ``traj_uid`` and ``step_idx`` are required too. A batch without them fails with a
``ValueError`` that names the missing keys.
"""

from __future__ import annotations

import logging

from .. import registry
from . import hooks
from .adapter import make_verl_estimator

logger = logging.getLogger("agentcredit")


def register_all() -> tuple[list[str], list[str]]:
    """Register our estimators with verl; returns ``(registered, kept_verls_own)``."""
    from verl.trainer.ppo import core_algos

    registered, skipped = [], []
    for name in registry.available():
        existing = core_algos.ADV_ESTIMATOR_REGISTRY.get(name)
        if existing is not None and not hasattr(existing, "agentcredit_estimator"):
            skipped.append(name)
            continue
        if existing is None:
            core_algos.register_adv_est(name)(make_verl_estimator(registry.get(name)))
        hooks.OURS.add(name)
        registered.append(name)
    return registered, skipped


try:
    _registered, _skipped = register_all()
    hooks.install()
except Exception:
    logger.exception("agentcredit: the verl plugin failed to load")
    raise

logger.warning("agentcredit: registered verl advantage estimators %s%s", _registered,
               f"; kept verl's own {_skipped}" if _skipped else "")
