"""The registry record of SPrPO (:mod:`distill_plugins.sprpo` implements it; kept here so that the method module
never imports the registry package that lists it)."""

from distill_plugins.sprpo import FORMULA, SPrPOParams

from . import TermSpec

__all__ = ["SPEC"]

SPEC = TermSpec(
    name="sprpo", params=SPrPOParams,
    paper="Wang et al., 2026, Learning Perturbation Robust Policies for LLM Agents with Stable Optimization (SPrPO)",
    summary="Trains the policy's RL loss on a hidden-state-perturbed forward whose noise scale adapts to the measured "
            "sensitivity (KL between clean and perturbed policy) under a trust-region bound, so the policy becomes "
            "robust to hidden-state noise, pruning and quantisation.",
    formula=FORMULA,
    reads="the policy's decoder layers (forward hooks); TRL: one extra no-grad clean forward per measured step, "
          "verl: the actor's old log-probs",
    bridges=("trl", "verl"))
