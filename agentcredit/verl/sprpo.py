"""SPrPO on verl 0.9.1: the actor's training forward runs on a hidden-state-perturbed policy
(:mod:`distill_plugins.sprpo`), configured by ``+algorithm.agentcredit_sprpo={sigma: 0.05, ...}`` (the term's
parameters, ``agentcredit describe sprpo``).

Installed by :mod:`agentcredit.verl` as post-import hooks, in every process:

* driver, ``verl.trainer.ppo.v1.trainer_base``: ``PPOTrainer._update_actor`` writes this step's ``sigma``, layers and
  noise seed into ``batch.extra_info`` (verl hands it to every micro-batch as non-tensor data), then reads the
  measured sensitivity back from the actor metrics and steps the controller (one controller, in the driver: every
  rank uses the same ``sigma``); ``_save_checkpoint`` / ``_load_checkpoint`` save and restore it
  (``agentcredit_sprpo.pt`` in each ``global_step_N`` folder);
* worker, ``verl.workers.engine.fsdp.transformer_impl``: ``FSDPEngineWithLMHead.forward_step`` runs verl's code
  under :func:`~distill_plugins.sprpo.hidden_noise` when the micro-batch carries a ``sigma`` and the pass trains
  (``forward_only`` passes, e.g. the old log-probs of ``compute_log_prob``, stay clean), and adds the sensitivity
  ``k3(old_log_probs, log_probs)`` over the response mask to the loss metrics (no extra forward: the old log-probs
  are the clean actor's on the same tokens).

The trust-region guard is one step late here: a step measured above ``kl_max`` makes the next step train clean.
Metrics: ``agentcredit_sprpo/{sigma,sensitivity,rejected,clean_step}``.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any

from distill_plugins.sprpo import SensitivityController, hidden_noise, k3_sensitivity

from ._compat import checkpoint_wraps, install_post_import_hooks, term_params, wraps_once

__all__ = ["CONFIG_KEY", "STATE_FILE", "sprpo_params", "install"]

logger = logging.getLogger("agentcredit")

#: ``algorithm.agentcredit_sprpo``: the term's parameters (a mapping; absent or null: the term is off)
CONFIG_KEY = "agentcredit_sprpo"
STATE_FILE = "agentcredit_sprpo.pt"
SIGMA_KEY, LAYERS_KEY, SEED_KEY = "agentcredit_sprpo_sigma", "agentcredit_sprpo_layers", "agentcredit_sprpo_seed"
#: the loss metric the worker adds (verl prefixes ``actor/`` on the driver)
METRIC = "agentcredit_sprpo/sensitivity"

#: the driver's controller (``instance``) and a state restored before it was built (``pending``)
CONTROLLER: dict[str, Any] = {}


def sprpo_params(algorithm: Any):
    """The term's parameters from ``algorithm.agentcredit_sprpo`` (None when absent); a ``ValueError`` names the key."""
    return term_params(algorithm, CONFIG_KEY, "sprpo", "{sigma: 0.05}")


def _controller(trainer) -> SensitivityController | None:
    if "instance" not in CONTROLLER:
        params = sprpo_params(trainer.config.get("algorithm", None))
        CONTROLLER["instance"] = None if params is None else SensitivityController(params)
        if CONTROLLER["instance"] is not None and "pending" in CONTROLLER:
            CONTROLLER["instance"].load_state_dict(CONTROLLER.pop("pending"))
    return CONTROLLER["instance"]


# ---- driver -------------------------------------------------------------------------------------------------------
@wraps_once("sprpo", "PPOTrainer._update_actor(self, batch, metrics)", ("self", "batch", "metrics"))
def wrap_update_actor(orig):
    def _update_actor(self, batch, metrics):
        c = _controller(self)
        if c is None:
            return orig(self, batch, metrics)
        p = c.params
        clean = c.over_bound(c.last_sensitivity) if math.isfinite(c.last_sensitivity) else False
        sigma = 0.0 if clean else c.sigma
        batch.extra_info.update({SIGMA_KEY: float(sigma), LAYERS_KEY: list(p.layers),
                                 SEED_KEY: int(p.seed * 1_000_003 + c.step)})
        out = orig(self, batch, metrics)
        measured = metrics.get(f"actor/{METRIC}", metrics.get(METRIC))
        measured = measured if sigma > 0 and c.step % p.measure_every == 0 else None
        metrics.update({"agentcredit_sprpo/sigma": float(sigma), "agentcredit_sprpo/clean_step": float(clean)})
        if measured is not None:
            measured = float(measured)
            metrics["agentcredit_sprpo/sensitivity"] = measured
            if c.over_bound(measured):
                c.rejected += 1
        metrics["agentcredit_sprpo/rejected"] = float(c.rejected)
        c.update(measured)
        if clean:  # the guard has acted: perturb again from the next step
            c.last_sensitivity = float("nan")
        return out

    return _update_actor


def _state():
    c = CONTROLLER.get("instance")
    return None if c is None else {"term": "sprpo", "state": c.state_dict()}


def _restore(saved, path: str) -> None:
    if saved.get("term") != "sprpo":
        raise ValueError(f"{path} holds the state of term {saved.get('term')!r}, not 'sprpo'")
    if CONTROLLER.get("instance") is not None:
        CONTROLLER["instance"].load_state_dict(saved["state"])
    else:
        CONTROLLER["pending"] = saved["state"]
    logger.warning("agentcredit: restored the sprpo controller (sigma %.4g) from %s", saved["state"]["sigma"], path)


wrap_save_checkpoint, wrap_load_checkpoint = checkpoint_wraps("sprpo", STATE_FILE, _state, _restore)


def _patch_trainer(module) -> None:
    cls = module.PPOTrainer
    cls._update_actor = wrap_update_actor(cls._update_actor)
    cls._save_checkpoint = wrap_save_checkpoint(cls._save_checkpoint)
    cls._load_checkpoint = wrap_load_checkpoint(cls._load_checkpoint)


# ---- worker ---------------------------------------------------------------------------------------------------------
def _nt(data, key: str) -> Any:
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(data=data, key=key, default=None)


def _sensitivity(model_output, micro_batch) -> float | None:
    from verl.workers.utils.padding import no_padding_2_padding

    if "old_log_probs" not in micro_batch.keys() or model_output.get("log_probs") is None:
        return None
    log_prob = no_padding_2_padding(model_output["log_probs"], micro_batch)
    data = micro_batch.select("response_mask", "old_log_probs").to_padded_tensor()
    return k3_sensitivity(data["old_log_probs"], log_prob, data["response_mask"])


@wraps_once("sprpo", "FSDPEngineWithLMHead.forward_step(self, micro_batch, loss_function, forward_only)",
            ("self", "micro_batch", "loss_function", "forward_only"))
def wrap_forward_step(orig):
    def forward_step(self, micro_batch, loss_function, forward_only):
        sigma = _nt(micro_batch, SIGMA_KEY)
        if forward_only or sigma is None:
            return orig(self, micro_batch, loss_function, forward_only)
        import torch
        from verl.utils.metric import AggregationType, Metric

        seed = int(_nt(micro_batch, SEED_KEY) or 0)
        gen = getattr(self, "_agentcredit_sprpo_gen", None)
        if gen is None or gen[0] != seed:  # the step's first micro-batch: a fresh stream
            device = next(self.module.parameters()).device
            gen = (seed, torch.Generator(device=device).manual_seed(seed))
            self._agentcredit_sprpo_gen = gen
        noise = (hidden_noise(self.module, float(sigma), list(_nt(micro_batch, LAYERS_KEY) or []), generator=gen[1])
                 if float(sigma) > 0 else contextlib.nullcontext())
        with noise:
            loss, output = orig(self, micro_batch, loss_function, forward_only)
        if float(sigma) > 0 and isinstance(output.get("metrics"), dict):
            d = _sensitivity(output.get("model_output") or {}, micro_batch)
            if d is not None:
                output["metrics"][METRIC] = Metric(value=d, aggregation=AggregationType.MEAN)
        return loss, output

    return forward_step


def _patch_engine(module) -> None:
    module.FSDPEngineWithLMHead.forward_step = wrap_forward_step(module.FSDPEngineWithLMHead.forward_step)


TARGETS = {"verl.trainer.ppo.v1.trainer_base": _patch_trainer,
           "verl.workers.engine.fsdp.transformer_impl": _patch_engine}


def install() -> None:
    """Register the post-import hooks (they run at once for modules already imported)."""
    install_post_import_hooks(TARGETS, "the sprpo term is not applied on verl")
