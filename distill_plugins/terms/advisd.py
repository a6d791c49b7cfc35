"""The registry record of AdviSD (:mod:`distill_plugins.advisd` implements it; kept here so that the method module
never imports the registry package that lists it)."""

from distill_plugins.advisd import FORMULA, AdviSDParams

from . import TermSpec

__all__ = ["SPEC"]

SPEC = TermSpec(
    name="advisd", params=AdviSDParams,
    paper="Agrawal et al., 2026, Learning to Advise Frontier LLMs via Targeted Multi-Turn Self-Distillation (AdviSD)",
    summary="The trained policy is an advisor: each turn it writes advice that a frozen executor reads with the "
            "observation before it acts. Outcome RL trains the advisor; a self-distillation term pulls it toward "
            "its own feedback-conditioned copy (its prompt plus the episode's outcome) on the decisions whose advice "
            "most changed the advisor's likelihood of the recorded executor response (or a matched-count random set).",
    formula=FORMULA,
    reads="the one-row-per-turn rollout (agentcredit.rollout: turns), whose turns it turns into advisor turns; a "
          "frozen executor (a copy of the starting weights, or the `executor` model; same tokenizer); per round "
          "two no-grad advisor forwards over the executor responses (with / without advice) and, per micro-batch, "
          "a student forward with gradient and a no-grad teacher forward over the selected decisions' advice",
    bridges=("trl",))
