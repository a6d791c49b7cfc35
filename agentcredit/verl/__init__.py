"""agentcredit's verl integration: everything that touches verl lives in this package.

verl imports this module through its ``verl.plugins`` entry point (``agentcredit = "agentcredit.verl"``) in every
process. On import it

* registers every agentcredit estimator with ``verl.trainer.ppo.core_algos.register_adv_est`` (a name verl already
  has, such as ``grpo``, keeps verl's function) and installs the lazy trainer hooks of :mod:`.hooks` (advantage
  metadata, estimator state in checkpoints);
* installs the distillation hooks of :mod:`.distill` (loss modes, scheduler, scheduler state in checkpoints);
* installs the SPrPO hooks of :mod:`.sprpo` (``+algorithm.agentcredit_sprpo``: the actor's perturbed training
  forward, its controller and its state in checkpoints) and the EVOKE hooks of :mod:`.evoke`
  (``+algorithm.agentcredit_evoke``: the sampled goal rankings handed to the actor, the ranking term in its loss);
* checks ``algorithm.adv_estimator`` and agentcredit's ``algorithm.*`` blocks when the driver starts, inside verl's
  ``validate_config``, before Ray and the models (:mod:`.preflight`): a typo fails in seconds, with suggestions;
* makes verl's TRL probe in ``apply_monkey_patch`` see the truth (:mod:`.trl_probe`), so a real verl run works
  beside TRL 1.16 (our ``[trl]`` extra);
* makes the agent loops ``agentcredit_env`` (:mod:`.agent_loop`), ``agentcredit_counterfactual`` and
  ``agentcredit_tree`` (:mod:`.search_loops`) known by name as soon as verl's agent-loop module is imported (in the
  agent-loop workers), by importing :mod:`.loops`, the one module that registers them;

and logs one WARNING line saying what it did (verl hides plugin-load errors at DEBUG level;
``VERL_USE_EXTERNAL_MODULES=agentcredit.verl`` loads it loudly instead). The verl internals all of this relies on
are checked in one place, :mod:`._compat`.

Usage::

    python -m verl.trainer.main_ppo algorithm.adv_estimator=gigpo +algorithm.gigpo.step_weight=0.5 ...
    python -m verl.trainer.main_ppo --config-name agentcredit_ppo algorithm.adv_estimator=gigpo \\
        algorithm.gigpo.step_weight=0.5 ...          # no '+' needed: the config ships every estimator's defaults

Hyperparameters live under ``algorithm.<estimator>.*`` (verl passes ``config=algorithm`` as a raw DictConfig).

Metadata contract: the agent loop returns one ``AgentLoopOutput`` per step (v1 trainer), each with
``extra_fields`` carrying the keys of :mod:`agentcredit.verl.contract`::

    extra_fields = {"step_idx": t, "anchor_key": canonical_obs, "action_key": parsed_action,
                    "step_reward": r_t, "success": won, "truncated": hit_step_limit}

Only ``anchor_key`` is required by step-level estimators (``step_idx`` and the trajectory come from the row keys in
v1); on the legacy trainer ``traj_uid`` and ``step_idx`` are required too. A batch without them fails with a
``ValueError`` that names the missing keys.
"""

from __future__ import annotations

import importlib
import logging

from credit_plugins import registry

from .. import vllm_cpu
from . import distill, evoke, hooks, preflight, sprpo, trl_probe
from ._compat import install_post_import_hooks
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


def register_agent_loops(_module=None) -> None:
    """Import :mod:`.loops`, which registers every agentcredit agent loop with verl; run when verl's agent-loop
    module is imported (``.loops`` imports that module, which cannot be imported while verl loads this plugin). Under
    ``VERL_USE_EXTERNAL_MODULES=agentcredit.verl.loops`` this runs while ``.loops`` is being imported; ``import_module``
    then returns the module in progress, which registers the loops when it completes."""
    importlib.import_module(f"{__name__}.loops")


try:
    # vLLM's CPU build (distribution vllm-cpu): verl's version check reads the distribution 'vllm' when it first
    # imports verl.third_party.vllm, after this plugin; a no-op unless the CPU build is installed
    vllm_cpu.alias_vllm_version()
    _registered, _skipped = register_all()
    hooks.install()
    distill.install()
    sprpo.install()
    evoke.install()
    install_post_import_hooks({"verl.experimental.agent_loop.agent_loop": register_agent_loops},
                              "the agentcredit agent loops are not registered by name")
    install_post_import_hooks({"verl.utils.config": preflight.patch_config_module},
                              "a misspelt algorithm.adv_estimator or agentcredit block is found only at the first "
                              "advantage computation")
    install_post_import_hooks({trl_probe.MODULE: trl_probe.patch},
                              "with TRL 1.16 installed, verl's actor fails at model build")
except Exception:
    logger.exception("agentcredit: the verl plugin failed to load")
    raise

logger.warning("agentcredit: registered verl advantage estimators %s%s", _registered,
               f"; kept verl's own {_skipped}" if _skipped else "")
