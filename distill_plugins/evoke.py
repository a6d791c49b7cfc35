"""EVOKE: goal diversity at fixed states (Guo et al., 2026, "Eliciting World Knowledge in Agents for Transferable
Decision-Making").

At a recorded decision state the environment state and the interaction history stay fixed while the goal changes:
the policy scores the same legal actions under each alternative goal and is trained to order them as the env's
solver does under that goal (``AgentEnv.goal_rankings``), so contextual habits or single-goal correlations cannot
order them. The formulas are :data:`FORMULA`; the registry record is :mod:`distill_plugins.terms.evoke`, the TRL
mixin :mod:`agentcredit.trl.evoke`.

Reconstructed (the paper's exact loss is not available here; see the docs page): an action's score is the policy's
sequence log-probability of its answer ``a</action>`` (at the sampling temperature), the default loss is a listwise
softmax cross-entropy toward the best action(s) (ties share the target mass), ``pairwise`` is the RankNet logistic
loss over strictly ordered pairs, and a (state, goal) group whose actions all tie is left out.
"""

from __future__ import annotations

from typing import Any

import torch

from credit_plugins.estimator import param, params_dataclass

__all__ = ["EVOKEParams", "evoke_loss", "ranking_accuracy", "weight_at", "candidate_batch", "group_scores",
           "FORMULA", "LOSSES", "SCHEDULES"]

#: What EVOKE computes, as ``agentcredit describe evoke`` and the docs page show it.
FORMULA = """\
per sampled state s (history h fixed) and alternative goal g (up to `goals` per state, `states` states per round):
  score_g(a) = log pi_theta(a </action> | prompt(g, h, s))   (sum over the answer's tokens, sampling temperature)
  Q*_g(s, a) from the env's solver; groups whose Q*_g all tie are left out
listwise:  L_g = - sum_{a in B_g} (1/|B_g|) log softmax_a score_g(a),   B_g = argmax_a Q*_g(s, a)
pairwise:  L_g = mean_{(a, b): Q*_g(a) > Q*_g(b)} log(1 + exp(-(score_g(a) - score_g(b))))
L_EVOKE = mean_g L_g;   loss = L_RL + w_k * L_EVOKE
w_k = weight (constant) | weight * min(1, k / schedule_steps) (warmup) | weight * max(0, 1 - k / schedule_steps) (linear)
rank_acc = share of strictly ordered pairs with score_g(a) > score_g(b) (ties in score: 1/2)
top1_acc = share of groups whose highest-scored action is in B_g (tied top scores: their share in B_g)
"""

LOSSES = ("listwise", "pairwise")
SCHEDULES = ("constant", "warmup", "linear")


@params_dataclass(frozen=True)
class EVOKEParams:
    weight: float = param(0.1, "w: coefficient of L_EVOKE added to the RL loss", low=0.0)
    goals: int = param(2, "alternative goals ranked per sampled state", low=1, high=64)
    states: int = param(4, "decision states sampled (uniformly, reservoir) per generation round and process",
                        low=1, high=4096)
    loss: str = param("listwise", "'listwise' (softmax cross-entropy toward the best action) or 'pairwise' "
                                  "(logistic loss over ordered pairs)", choices=LOSSES)
    schedule: str = param("constant", "weight schedule over optimizer steps k: 'constant', 'warmup' (linear rise "
                                      "to weight over schedule_steps) or 'linear' (linear decay to 0)",
                          choices=SCHEDULES)
    schedule_steps: int = param(100, "length of the warmup / decay in optimizer steps", low=1)
    seed: int = param(0, "seed of the state sampling and goal draws (its state is checkpointed)", low=0)


def weight_at(params: EVOKEParams, step: int) -> float:
    """``w_k`` of :data:`FORMULA` at optimizer step ``step`` (0-based)."""
    frac = min(1.0, max(int(step), 0) / params.schedule_steps)
    if params.schedule == "warmup":
        return params.weight * frac
    if params.schedule == "linear":
        return params.weight * (1.0 - frac)
    return params.weight


def _check(scores: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if scores.dim() != 2 or scores.shape != values.shape:
        raise ValueError(f"evoke: scores {tuple(scores.shape)} and values {tuple(values.shape)} must both be "
                         f"[groups, actions]")
    if mask is None:
        mask = torch.ones(scores.shape, dtype=torch.bool, device=scores.device)
    if mask.shape != scores.shape:
        raise ValueError(f"evoke: mask {tuple(mask.shape)} must match scores {tuple(scores.shape)}")
    if not bool(torch.isfinite(values[mask]).all()):
        raise ValueError("evoke: the target values hold NaN/inf at valid candidates; pass the env's finite Q* values")
    return mask.bool()


def _pairs(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[G, A, A] bool: candidate a is strictly better than b under the group's goal (both valid)."""
    both = mask.unsqueeze(2) & mask.unsqueeze(1)
    return both & (values.unsqueeze(2) > values.unsqueeze(1))


def evoke_loss(scores: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None = None,
               form: str = "listwise") -> torch.Tensor:
    """``L_EVOKE`` (:data:`FORMULA`) of ``scores`` ``[G, A]`` (the policy's candidate scores, one row per (state,
    goal)) against the solver's ``values`` ``[G, A]``; ``mask`` marks the real candidates (rows may be padded).
    Groups without a strict order are left out; with none left the loss is ``0`` (still attached to ``scores``)."""
    if form not in LOSSES:
        raise ValueError(f"evoke: loss={form!r}; choose one of {list(LOSSES)}")
    mask = _check(scores, values, mask)
    values = values.to(scores.dtype)
    pairs = _pairs(values, mask)
    informative = pairs.flatten(1).any(1)
    if not bool(informative.any()):
        return scores.sum() * 0.0
    s = scores.masked_fill(~mask, float("-inf"))
    if form == "listwise":
        best = mask & (values == values.masked_fill(~mask, float("-inf")).amax(1, keepdim=True))
        target = best.to(scores.dtype) / best.sum(1, keepdim=True).clamp_min(1)
        logp = torch.log_softmax(s, dim=1).masked_fill(~mask, 0.0)
        per_group = -(target * logp).sum(1)
    else:
        diff = scores.unsqueeze(2) - scores.unsqueeze(1)
        pair_loss = torch.nn.functional.softplus(-diff).masked_fill(~pairs, 0.0)
        per_group = pair_loss.flatten(1).sum(1) / pairs.flatten(1).sum(1).clamp_min(1)
    return per_group[informative].mean()


@torch.no_grad()
def ranking_accuracy(scores: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, float]:
    """``rank_acc`` (pairwise agreement, ties in score count 1/2), ``top1_acc`` and ``groups`` (the groups with a
    strict order, the only ones counted) of :data:`FORMULA`; both accuracies are NaN when no group counts."""
    mask = _check(scores, values, mask)
    values = values.to(torch.float64)
    scores = scores.detach().to(torch.float64)
    pairs = _pairs(values, mask)
    informative = pairs.flatten(1).any(1)
    n = int(informative.sum())
    if n == 0:
        return {"rank_acc": float("nan"), "top1_acc": float("nan"), "groups": 0.0}
    diff = scores.unsqueeze(2) - scores.unsqueeze(1)
    agree = torch.where(diff > 0, 1.0, torch.where(diff == 0, 0.5, 0.0)).to(torch.float64)
    rank_acc = float((agree * pairs).sum() / pairs.sum())
    best = mask & (values == values.masked_fill(~mask, float("-inf")).amax(1, keepdim=True))
    masked = scores.masked_fill(~mask, float("-inf"))
    top = mask & (masked == masked.amax(1, keepdim=True))  # score ties at the top: each counts its share
    hit = (top & best).sum(1).double() / top.sum(1).clamp_min(1)
    return {"rank_acc": rank_acc, "top1_acc": float(hit[informative].mean()), "groups": float(n)}


def candidate_batch(groups: list[dict[str, Any]], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every (group, candidate) as one row (a group: ``{"prompt": ids, "answers": [ids, ...], "values": [...]}``),
    in TRL's completion layout: ``ids`` / ``att`` ``[N, P + L]`` (prompt
    left-padded to P, answer right-padded to L) and the answer mask ``[N, L]``."""
    rows = [(g["prompt"], a) for g in groups for a in g["answers"]]
    p_len = max(len(p) for p, _ in rows)
    a_len = max(len(a) for _, a in rows)
    ids = torch.full((len(rows), p_len + a_len), pad, dtype=torch.long)
    att = torch.zeros_like(ids)
    amask = torch.zeros(len(rows), a_len)
    for i, (p, a) in enumerate(rows):
        ids[i, p_len - len(p):p_len] = torch.tensor(p)
        ids[i, p_len:p_len + len(a)] = torch.tensor(a)
        att[i, p_len - len(p):p_len + len(a)] = 1
        amask[i, :len(a)] = 1
    return ids, att, amask


def group_scores(logps: torch.Tensor, amask: torch.Tensor, groups: list[dict[str, Any]]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The answer log-probs ``logps`` ``[N, L]`` of :func:`candidate_batch`'s rows summed per answer and laid out as
    ``[G, A]`` scores, with the groups' values and the candidate mask (padding columns: score 0, masked)."""
    seq = (logps.float() * amask.to(logps.device)).sum(1)
    width = max(len(g["answers"]) for g in groups)
    group = torch.tensor([j for j, g in enumerate(groups) for _ in g["answers"]], device=seq.device)
    slot = torch.tensor([i for g in groups for i in range(len(g["answers"]))], device=seq.device)
    scores = seq.new_zeros(len(groups), width).index_put((group, slot), seq)
    values = torch.zeros(len(groups), width, dtype=torch.float64)
    mask = torch.zeros(len(groups), width, dtype=torch.bool)
    for j, g in enumerate(groups):
        values[j, :len(g["values"])] = torch.tensor(g["values"], dtype=torch.float64)
        mask[j, :len(g["values"])] = True
    return scores, values.to(scores.device), mask.to(scores.device)
