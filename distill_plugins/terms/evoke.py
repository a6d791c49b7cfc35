"""The registry record of EVOKE (:mod:`distill_plugins.evoke` implements it; kept here so that the method module
never imports the registry package that lists it)."""

from distill_plugins.evoke import FORMULA, EVOKEParams

from . import TermSpec

__all__ = ["SPEC"]

SPEC = TermSpec(
    name="evoke", params=EVOKEParams,
    paper="Guo et al., 2026, EVOKE: Eliciting World Knowledge in Agents for Transferable Decision-Making, "
          "arXiv:2609.38334",
    summary="Goal diversity at fixed states: at sampled decision states the policy ranks the legal actions under "
            "alternative goals (same state, same history) against the env solver's ordering; a listwise or pairwise "
            "ranking loss is added to the RL loss.",
    formula=FORMULA,
    reads="an env with goal_rankings(k, rng) (synthetic; minigrid task 'goal') played turn by turn (TRL: the "
          "one-row-per-turn rollout, agentcredit.rollout: turns; verl: the env loop agentcredit_env); one extra "
          "forward over the candidate answers under the alternative goals",
    bridges=("trl", "verl"))
