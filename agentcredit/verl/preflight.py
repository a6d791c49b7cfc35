"""Checks of a verl run's configuration when the driver starts, before Ray, the models and the first rollout.

verl looks ``algorithm.adv_estimator`` up at the first advantage computation, after Ray has started, the models are
loaded and the first batch is rolled out; agentcredit's parameter blocks are read there too. A typo then costs
minutes (hours on a cluster). :func:`check_config` checks them all at once, and :func:`wrap_validate_config` runs it
inside verl's ``verl.utils.config.validate_config``, which ``main_ppo``'s ``main`` calls on the driver right after
composing the config and before ``run_ppo`` starts Ray (installed by :mod:`agentcredit.verl` as a post-import hook).

What is checked (each error names the entry and, for a name, suggests the closest valid ones with
:func:`difflib.get_close_matches`):

* ``algorithm.adv_estimator`` is in verl's advantage-estimator registry (verl's own and agentcredit's);
* the parameter block ``algorithm.<estimator>`` of every agentcredit estimator present (keys and values, as the
  estimator checks them at its first call);
* no ``algorithm.agentcredit_*`` key outside :data:`BLOCKS`, no block without its prefix
  (``+algorithm.adv_scale=batch_rms``), and no ``algorithm`` mapping whose name is a near miss of an agentcredit
  estimator (``+algorithm.gigpoo.step_weight=0.5``);
* the blocks ``agentcredit_distill`` (keys, schedule name, scheduler parameters, loss parameters),
  ``agentcredit_ccm``, ``agentcredit_hindsight``, ``agentcredit_archive``, ``agentcredit_sprpo`` (the term's
  parameters), ``agentcredit_evoke`` (the term's parameters; v1 trainer, no fused kernels, no Ulysses),
  ``agentcredit_max_env_error_rate``,
  ``agentcredit_adv_scale`` (a valid scale, and only with an agentcredit estimator), and the Guided-OPD requirements
  (:func:`agentcredit.verl.guided.check_config`);
* with ``distillation.enabled``, the teacher's resource pool ``distillation.n_gpus_per_node`` / ``nnodes`` (verl's own
  check runs in the trainer, after Ray has started).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Mapping
from enum import Enum
from typing import Any

import distill_plugins
from credit_plugins import registry

from ._compat import algorithm_entry, wraps_once
from .adapter import ADV_SCALE_KEY, adv_scale_mode
from .archive import ARCHIVE_KEY, archive_path
from .ccm import CONFIG_KEY as CCM_KEY
from .ccm import ccm_params
from .distill import loss_params
from .guided import check_config as check_guided
from .hindsight import CONFIG_KEY as HINDSIGHT_KEY
from .hindsight import same_layout
from .hooks import MAX_ENV_ERROR_RATE_KEY, adv_scale_asked
from .loop_common import CONFIG_KEY as DISTILL_KEY
from .loop_common import distill_block
from .evoke import CONFIG_KEY as EVOKE_KEY
from .evoke import check_config as check_evoke
from .sprpo import CONFIG_KEY as SPRPO_KEY
from .sprpo import sprpo_params

__all__ = ["BLOCKS", "check_config", "wrap_validate_config"]

#: agentcredit's own ``algorithm.*`` entries
BLOCKS = (DISTILL_KEY, CCM_KEY, HINDSIGHT_KEY, ARCHIVE_KEY, MAX_ENV_ERROR_RATE_KEY, ADV_SCALE_KEY, SPRPO_KEY,
          EVOKE_KEY)


def _suggest(name: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, sorted(choices), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def _verl_algorithm_fields() -> set[str]:
    try:
        from verl.trainer.config import AlgoConfig  # verl's own algorithm keys, for the near-miss check only
    except ImportError:  # pragma: no cover - another verl layout: that check is skipped
        return set()
    return {f.name for f in dataclasses.fields(AlgoConfig)}


def check_config(config: Any, estimators: Mapping[str, Any] | None = None) -> None:
    """Refuse a verl config whose advantage estimator or agentcredit blocks would fail later in the run (see the
    module doc). ``estimators``: the registry of advantage-estimator names (default: verl's
    ``ADV_ESTIMATOR_REGISTRY``, agentcredit's estimators included). A config without ``algorithm`` is left alone."""
    algorithm = config.get("algorithm", None) if hasattr(config, "get") else getattr(config, "algorithm", None)
    if algorithm is None:
        return
    if estimators is None:
        from verl.trainer.ppo import core_algos  # loaded by the time verl validates a config

        estimators = core_algos.ADV_ESTIMATOR_REGISTRY
    ours = set(registry.available())
    name = algorithm_entry(algorithm, "adv_estimator")
    name = name.value if isinstance(name, Enum) else name
    if name is not None and name not in estimators:
        raise ValueError(f"agentcredit: algorithm.adv_estimator={name!r} is not a registered advantage estimator"
                         f"{_suggest(str(name), estimators)} Registered: {sorted(estimators)}")
    keys = list(algorithm.keys()) if hasattr(algorithm, "keys") else []
    verl_own = _verl_algorithm_fields()
    for key in keys:
        key = str(key)
        if key in ours and (estimators.get(key) is None or hasattr(estimators.get(key), "agentcredit_estimator")):
            params = algorithm_entry(algorithm, key)
            if params is not None and not isinstance(params, Mapping):
                raise ValueError(f"agentcredit: algorithm.{key} must be a mapping of {key}'s parameters, got "
                                 f"{params!r}")
            try:
                registry.get(key).make_params(**dict(params or {}))
            except (TypeError, ValueError) as e:
                raise ValueError(f"agentcredit: algorithm.{key}: {e}") from e
        elif f"agentcredit_{key}" in BLOCKS and key not in estimators and key not in verl_own:
            raise ValueError(f"agentcredit: algorithm.{key} is not a verl or agentcredit setting; did you mean "
                             f"algorithm.agentcredit_{key}? agentcredit's algorithm entries: {list(BLOCKS)}")
        elif key.startswith("agentcredit_") and key not in BLOCKS:
            raise ValueError(f"agentcredit: algorithm.{key} is not an agentcredit setting{_suggest(key, BLOCKS)} "
                             f"agentcredit's algorithm entries: {list(BLOCKS)}")
        elif (key not in estimators and key not in verl_own and isinstance(algorithm_entry(algorithm, key), Mapping)
              and difflib.get_close_matches(key, sorted(ours), n=1, cutoff=0.8)):
            raise ValueError(f"agentcredit: algorithm.{key} is not an advantage estimator's parameter block"
                             f"{_suggest(key, ours)}")
    try:
        scaled = adv_scale_asked(algorithm)
    except ValueError as e:
        raise ValueError(f"agentcredit: {e}") from e
    if scaled and name is not None and not hasattr(estimators.get(name), "agentcredit_estimator"):
        raise ValueError(f"agentcredit: algorithm.{ADV_SCALE_KEY}={adv_scale_mode(algorithm)!r} scales an agentcredit "
                         f"estimator's advantages; algorithm.adv_estimator={name!r} is verl's own. Use one of ours "
                         f"(for GRPO: adv_estimator=gigpo with algorithm.gigpo.step_weight=0) or drop the key")
    _check_blocks(config, algorithm)


def _check_blocks(config: Any, algorithm: Any) -> None:
    block = distill_block(config)
    if block:
        schedule = str(block.get("schedule", None) or "fixed")
        if schedule not in distill_plugins.available():
            raise ValueError(f"agentcredit: algorithm.{DISTILL_KEY}.schedule={schedule!r} is not a scheduler"
                             f"{_suggest(schedule, distill_plugins.available())} Available: "
                             f"{distill_plugins.available()}")
        try:
            distill_plugins.create(schedule, **dict(block.get("params", None) or {}))
        except (TypeError, ValueError) as e:
            raise ValueError(f"agentcredit: algorithm.{DISTILL_KEY}.params: {e}") from e
        loss_params(block)
    ccm_params(algorithm)
    same_layout(config)
    archive_path(algorithm)
    sprpo_params(algorithm)
    check_evoke(config)
    limit = algorithm_entry(algorithm, MAX_ENV_ERROR_RATE_KEY)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))
                              or not 0.0 <= float(limit) <= 1.0):
        raise ValueError(f"agentcredit: algorithm.{MAX_ENV_ERROR_RATE_KEY}={limit!r}; use a share in [0, 1] "
                         f"(1: never stop)")
    dist = config.get("distillation", None) if hasattr(config, "get") else None
    if dist is not None and dist.get("enabled", False):  # verl checks these only in its trainer, after Ray started
        for key in ("n_gpus_per_node", "nnodes"):
            value = dist.get(key, None)
            if value is None or int(value) <= 0:
                raise ValueError(f"agentcredit: distillation.enabled=true needs the teacher's resource pool: set "
                                 f"distillation.{key} > 0 (got {value!r}; verl 0.9.1 refuses it after Ray starts), "
                                 f"e.g. distillation.n_gpus_per_node=1 distillation.nnodes=1 "
                                 f"(recipes/verl/sokoban_opw.yaml)")
    check_guided(config)


@wraps_once("preflight", "verl.utils.config.validate_config(config, use_reference_policy, use_critic)",
            ("config", "use_reference_policy", "use_critic"))
def wrap_validate_config(orig):
    """verl's ``validate_config``, after :func:`check_config` (the driver, before Ray starts)."""

    def validate_config(config, *args, **kwargs):
        check_config(config)
        return orig(config, *args, **kwargs)

    return validate_config


def patch_config_module(module) -> None:
    """Post-import hook of ``verl.utils.config``: wrap its ``validate_config``."""
    module.validate_config = wrap_validate_config(getattr(module, "validate_config", None))
