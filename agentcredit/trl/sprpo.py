"""SPrPO on TRL: the RL loss's forward runs on a hidden-state-perturbed policy (:mod:`distill_plugins.sprpo`).

    Trainer = make_trainer(GRPOTrainer, credit="gigpo", terms={"sprpo": {"sigma": 0.05, "target_kl": 0.01}})

(recipes: ``agentcredit.terms: {sprpo: {...}}``). How it hooks TRL 1.16's ``GRPOTrainer``:

* ``_compute_loss`` (the training loss, model in train mode) marks its own call to
  ``_get_per_token_logps_and_entropies``; only that call runs under :func:`~distill_plugins.sprpo.hidden_noise` on
  the chosen decoder layers. The rollout's generation, the old / reference log-probs of
  ``_generate_and_score_completions`` and evaluation stay clean.
* On the first micro-batch of every ``measure_every``-th optimizer step the same call also runs one clean forward
  without gradient; the k3 estimate of ``KL(pi || pi~)`` on the completion tokens is the sensitivity ``D``. A
  step with ``D > kl_max`` trains on the clean forward (that micro-batch recomputes its log-probs clean, with
  gradient, and the step's later micro-batches are not perturbed): the trust-region guard.
* After each optimizer step the controller adapts ``sigma`` from ``D`` (a ``TrainerCallback``; with several
  processes from the mean of their ``D``, so every rank keeps one ``sigma``); the noise stream is seeded from ``seed``
  and the controller's step, so a resumed run draws the same noise.

Logged: ``agentcredit_sprpo/{sigma,sensitivity,rejected,perturbed_forwards}``. The controller's state is saved in
each checkpoint (``agentcredit_sprpo.pt``) and restored on resume. Gradient checkpointing is unaffected: the noise is
added to a layer's output with a detached scale (Jacobian: the identity), and a recomputed layer starts from the
noisy input the forward saved.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from credit_plugins import registry
from distill_plugins.sprpo import SensitivityController, hidden_noise, k3_sensitivity, select_layers

from ..state import load_state
from ._compat import TRLInternalsChanged, checkpoint_folder

__all__ = ["SPrPOMixin", "TermMixin", "STATE_FILE"]

#: file of the controller's ``state_dict()`` inside a TRL checkpoint folder
STATE_FILE = "agentcredit_sprpo.pt"


class _AfterOptimizerStep:
    """A ``TrainerCallback``-compatible hook: run the controller after each optimiser step."""

    def __init__(self, trainer):
        self.trainer = trainer

    def __getattr__(self, name):  # every other TrainerCallback event: do nothing
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._sprpo_after_step()


class SPrPOMixin:
    """Put before ``GRPOTrainer`` (and the credit mixin); its parameters are ``terms["sprpo"]`` (a class attribute,
    set by :func:`agentcredit.trl.make_trainer`)."""

    terms: dict[str, dict[str, Any]] = {}

    def __init__(self, *args, **kwargs):
        params = registry.get("sprpo", kind="terms").make_params(**dict(self.terms.get("sprpo") or {}))
        self._sprpo = SensitivityController(params)
        self._sprpo_in_loss = False
        self._sprpo_mask: torch.Tensor | None = None
        self._sprpo_gen: torch.Generator | None = None
        self._sprpo_gen_step = -1
        self._sprpo_measured: float | None = None
        self._sprpo_calls = 0
        super().__init__(*args, **kwargs)
        if not callable(getattr(super(), "_get_per_token_logps_and_entropies", None)):
            raise TRLInternalsChanged("GRPOTrainer._get_per_token_logps_and_entropies is missing; SPrPO perturbs "
                                      "the loss's forward through it")
        select_layers(self._sprpo_module(), params.layers)  # a bad layer index fails here, before training
        self.add_callback(_AfterOptimizerStep(self))

    @property
    def sprpo(self) -> SensitivityController:
        """The noise-scale controller (``sigma``, ``step``, ``last_sensitivity``, ``rejected``)."""
        return self._sprpo

    def _sprpo_module(self, model=None) -> torch.nn.Module:
        return self.accelerator.unwrap_model(model if model is not None else self.model)

    # -- the loss's forward ------------------------------------------------------------------------------------
    def _compute_loss(self, model, inputs):
        if not model.training:
            return super()._compute_loss(model, inputs)
        step = self._sprpo.step
        if self._sprpo_gen_step != step:  # first micro-batch of this optimizer step: a fresh noise stream
            device = next(self._sprpo_module(model).parameters()).device
            p = self._sprpo.params
            self._sprpo_gen = torch.Generator(device=device).manual_seed(p.seed * 1_000_003 + step)
            self._sprpo_gen_step = step
        mask = inputs["completion_mask"]
        if inputs.get("tool_mask") is not None:
            mask = mask * inputs["tool_mask"]
        self._sprpo_mask, self._sprpo_in_loss = mask, True
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._sprpo_in_loss, self._sprpo_mask = False, None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        if not self._sprpo_in_loss or self._sprpo.sigma == 0.0:
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                              *args, **kwargs)
        self._sprpo_in_loss = False  # the loss's own forward only
        p = self._sprpo.params
        if self._sprpo_measured is not None and self._sprpo.over_bound(self._sprpo_measured):
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                              *args, **kwargs)  # this step is outside the region

        def forward():
            return super(SPrPOMixin, self)._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)

        measure = self._sprpo_measured is None and self._sprpo.step % p.measure_every == 0
        if measure:
            with torch.no_grad():
                clean = forward()[0]
        with hidden_noise(self._sprpo_module(model), self._sprpo.sigma, p.layers, generator=self._sprpo_gen) as n:
            out = forward()
        self._sprpo_calls += n["calls"]
        if measure:
            sensitivity = k3_sensitivity(clean, out[0], self._sprpo_mask)
            self._sprpo_measured = sensitivity
            if self._sprpo.over_bound(sensitivity):  # outside the trust region: this step trains clean
                self._sprpo.rejected += 1
                out = forward()
        return out

    # -- once per optimizer step ------------------------------------------------------------------------------
    def _sprpo_after_step(self) -> None:
        if self._sprpo_measured is not None and self.accelerator.num_processes > 1:
            # every rank measured its own micro-batch: one mean, so every rank keeps the same sigma
            d = torch.tensor([self._sprpo_measured], dtype=torch.float64, device=self.accelerator.device)
            self._sprpo_measured = float(self.accelerator.reduce(d, reduction="mean").item())
        m = self._metrics["train"]
        m["agentcredit_sprpo/sigma"].append(self._sprpo.sigma)
        if self._sprpo_measured is not None:
            m["agentcredit_sprpo/sensitivity"].append(self._sprpo_measured)
        m["agentcredit_sprpo/rejected"].append(float(self._sprpo.rejected))
        m["agentcredit_sprpo/perturbed_forwards"].append(float(self._sprpo_calls))
        self._sprpo.update(self._sprpo_measured)
        self._sprpo_measured, self._sprpo_calls = None, 0

    # -- checkpoint and resume ----------------------------------------------------------------------------------
    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            torch.save({"term": "sprpo", "state": self._sprpo.state_dict()},
                       os.path.join(checkpoint_folder(self, trial), STATE_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        path = os.path.join(resume_from_checkpoint, STATE_FILE)
        if not os.path.exists(path):
            raise ValueError(f"{resume_from_checkpoint} has no {STATE_FILE}: it was not written by a trainer with the "
                             f"sprpo term; resuming would restart its noise scale from "
                             f"sigma={self._sprpo.params.sigma}")
        saved = load_state(path)
        if saved.get("term") != "sprpo":
            raise ValueError(f"{path} holds the state of term {saved.get('term')!r}, not 'sprpo'")
        self._sprpo.load_state_dict(saved["state"])


#: the name :func:`agentcredit.trl.credit.term_mixin` looks up
TermMixin = SPrPOMixin
