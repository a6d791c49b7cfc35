"""GiGPO: group-in-group policy optimisation, the main step-level baseline.

Paper: Feng, Xue, Liu, An, "Group-in-Group Policy Optimization for LLM Agent Training", NeurIPS 2025,
arXiv:2505.10978. Follows ``gigpo/core_gigpo.py`` of verl-agent step for step (spec credit §3).

The formulas are :data:`FORMULA` (what ``agentcredit describe`` and the docs show).

F is the unbiased std + eps (``norm_std=True``, "GiGPO w/ std", verl-agent mode ``mean_std_norm``) or 1
(``mean_norm``). An anchor group of one visit has A^S = 0 (verl-agent's step_norm_reward: mean = itself);
revisits of a state inside one trajectory are separate members of its anchor group. Episode statistics are
taken over step rows by default (verl-agent's ``compute_mean_std_cross_steps=True``; pass
``episode_stats="trajectories"`` for the paper's Eq. 3). ``similarity_thresh`` (verl-agent's ``enable_similarity``
with ``similarity_thresh``) also merges anchor states whose texts reach that ``difflib`` ratio, order-invariantly
(:mod:`credit_plugins.similarity`); it needs the ``state`` column as texts.
"""

from __future__ import annotations


import torch

from ..estimator import Estimator, param, params_dataclass
from ..segments import group_normalise
from ..steptable import StepTable
from .grpo import EPISODE_STATS, episode_advantage

#: The formula the estimator computes, as ``agentcredit describe``, the docs page and the registry record
#: (``Estimator.formula``) show it.
FORMULA = """\
A^E(tau_i)  = (R(tau_i) - mean_g R) / F(g)                    episode level, Eq. 3 (the GRPO term)
R_t         = sum_{k>=t} gamma^(k-t) r_k                      discounted step return, Eq. 5
G^S(s~)     = {(a_t, R_t) : s_t = s~, same task group}        anchor-state groups, Eq. 6
             (s_t ~ s~ with similarity_thresh p: same cluster of difflib ratio >= p, credit_plugins.similarity)
A^S(a_t)    = (R_t - mean_{G^S} R) / F(G^S)                   step level, Eq. 7
A           = A^E + step_weight * A^S                          Eq. 8
"""


@params_dataclass
class GiGPOParams:
    """Hyperparameters of GiGPO (defaults: verl-agent's ALFWorld launcher)."""

    gamma: float = param(0.95, "Discount of the step return R_t (the launchers' 0.95; verl's yaml default is 1.0).",
                         low=0.0, high=1.0)
    step_weight: float = param(1.0, "Weight omega of the step-level term A^S (verl-agent step_advantage_w). "
                               "0 gives GRPO exactly.")
    norm_std: bool = param(True, "Divide both terms by their group std ('mean_std_norm'); False is 'mean_norm'.")
    eps: float = param(1e-6, "Added to the std before dividing.", low=0.0, low_open=True,
                       why="a zero-variance group would divide by zero")
    episode_stats: str = param("steps", "Episode statistics over 'steps' (verl-agent default) or 'trajectories' "
                               "(the paper's Eq. 3).", choices=EPISODE_STATS)
    similarity_thresh: float | None = param(
        None, "None: anchor groups of exactly equal states. A value p also merges, within a task group, states whose "
        "texts reach difflib's ratio p (verl-agent's enable_similarity; its configs use 0.9-0.95); 1 = exact, 0 = one "
        "anchor per group. Needs state texts.", low=0.0, high=1.0,
        why="a difflib ratio lies in [0, 1]")


def step_advantage(steps: StepTable, *, gamma: float, norm_std: bool, eps: float,
                   similarity_thresh: float | None = None) -> torch.Tensor:
    """[S] float64 A^S: the discounted step return normalised within its anchor-state group (states merged at
    ``similarity_thresh``, :meth:`StepTable.anchor_at`)."""
    anchor, n_anchor = steps.anchor_at(similarity_thresh)
    return group_normalise(steps.reward_to_go(gamma), anchor, n_anchor,
                           norm_std=norm_std, eps=eps, singleton_mean_zero=False)


def gigpo(steps: StepTable, p: GiGPOParams) -> torch.Tensor:
    a_episode = episode_advantage(steps, norm_std=p.norm_std, eps=p.eps, episode_stats=p.episode_stats)
    if p.step_weight == 0:
        return a_episode
    return a_episode + p.step_weight * step_advantage(steps, gamma=p.gamma, norm_std=p.norm_std, eps=p.eps,
                                                      similarity_thresh=p.similarity_thresh)


ESTIMATOR = Estimator(
    name="gigpo",
    fn=gigpo,
    params=GiGPOParams,
    paper="Feng, Xue, Liu, An 2025, Group-in-Group Policy Optimization for LLM Agent Training (arXiv:2505.10978)",
    formula=FORMULA,
    requires=("state",),
    similarity="similarity_thresh",
)
