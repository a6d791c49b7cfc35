"""AdviSD: advisor RL with selective self-distillation (Agrawal et al., 2026, "Learning to Advise Frontier LLMs via
Targeted Multi-Turn Self-Distillation").

A small trainable advisor writes natural-language advice for each turn; a frozen executor reads the observation plus
the advice and acts. Outcome RL (GRPO-style) trains the advisor; next to it, a self-distillation term pulls the
advisor toward a feedback-conditioned copy of itself (the same advisor whose prompt also holds the episode's outcome
feedback) on a SELECTED subset of decisions. A decision is selected by its advice influence: the advisor scores the
recorded executor response with and without the advice it issued, and the magnitude of that log-likelihood
difference ranks the decisions (no executor likelihoods, no extra executor rollouts). The formulas are
:data:`FORMULA`; the registry record is :mod:`distill_plugins.terms.advisd`, the TRL mixin :mod:`agentcredit.trl.advisd`.

Reconstructed (the paper's exact definitions are not available here; see docs/methods/terms/advisd.md): the influence
is the absolute MEAN (``reduce="sum"``: sum) over the response tokens of the log-prob difference; the selected count
is ``ceil(fraction * n)`` over the decisions of one generation round, ties broken toward the earlier decision; the
distillation loss is the full-vocabulary reverse KL ``KL(pi_student || sg(pi_teacher))`` per advice token, averaged
over the selected decisions' advice tokens; the feedback is a text template of the episode's outcome (no generated
reflection).
"""

from __future__ import annotations

import math
import string
from collections.abc import Sequence

import torch

from credit_plugins.estimator import param, params_dataclass

from .losses import reverse_kl

__all__ = ["AdviSDParams", "advice_influence", "select_count", "select_decisions", "select_across", "flatten_parts",
           "advisd_loss",
           "feedback_text", "advice_text",
           "FORMULA", "MODES", "REDUCES", "FEEDBACK_FIELDS"]

#: What AdviSD computes, as ``agentcredit describe advisd`` and the docs page show it.
FORMULA = """\
per decision i (one advisor turn: prompt x_i, advice a_i; the frozen executor's recorded response y_i):
  d_i = (1/|y_i|) sum_t [ log pi_adv(y_i,t | e(x_i, a_i), y_i,<t) - log pi_adv(y_i,t | e(x_i), y_i,<t) ]
        (e(x, a): the executor prompt with the advice, e(x): without it; reduce=sum drops the 1/|y_i|)
  influence_i = |d_i|                      (no grad; scored by the advisor, never by the executor)
  S = the k = ceil(fraction * n) decisions of the round with the largest influence  (mode magnitude; ties: earlier i)
    | k decisions drawn uniformly without replacement                                 (mode random, matched count)
  teacher: pi_T(. | x_i + f(episode)) = the same advisor, its prompt extended by the episode's outcome feedback f
  L_SD = sum_{i in S} sum_t KL( pi_theta(. | x_i, a_i,<t) || sg pi_T(. | x_i + f, a_i,<t) ) / sum_{i in S} |a_i|
         (0 when S is empty)
loss = L_RL(advisor, outcome rewards) + weight * L_SD
"""

MODES = ("magnitude", "random")
REDUCES = ("mean", "sum")
#: the fields a feedback template may use (:func:`feedback_text`)
FEEDBACK_FIELDS = ("outcome", "ret", "turns", "t", "action", "reward")
DEFAULT_FEEDBACK = ("\nFeedback on this episode: it {outcome} with return {ret:.2f} after {turns} turns; at this turn "
                    "the executor played {action} (reward {reward:.2f}).")


DEFAULT_ASK = "\nYou advise the player who picks the action. Reply with one short hint for this turn."
DEFAULT_ADVICE = "\nAdvice: {advice}"


def advice_text(template: str, advice: str) -> str:
    """The advice block of the executor's prompt: ``template`` with ``{advice}`` replaced (no other field)."""
    return template.replace("{advice}", advice)


def feedback_text(template: str, *, success: bool, ret: float, turns: int, t: int, action: str | None,
                  reward: float) -> str:
    """The outcome feedback ``f`` of :data:`FORMULA` appended to the teacher's prompt: ``template`` formatted with
    ``outcome`` ("succeeded" / "failed"), ``ret`` (the episode's return), ``turns``, ``t`` (this turn, 0-based),
    ``action`` (the executor's parsed action, "an invalid answer" when none) and ``reward`` (this turn's)."""
    return template.format(outcome="succeeded" if success else "failed", ret=float(ret), turns=int(turns), t=int(t),
                           action=action if action is not None else "an invalid answer", reward=float(reward))


def _check_template(template: str) -> None:
    try:
        names = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise ValueError(f"term 'advisd': feedback={template!r} is not a format string ({e}); write fields as "
                         f"{{name}} and literal braces as {{{{ }}}}") from None
    if any(n == "" or n[0].isdigit() for n in names):
        raise ValueError(f"term 'advisd': feedback={template!r} has a positional field ({{}} or {{0}}); name the "
                         f"field: {{{'}, {'.join(FEEDBACK_FIELDS)}}}")
    unknown = sorted({n.split(".")[0].split("[")[0] for n in names} - set(FEEDBACK_FIELDS))
    if unknown:
        raise ValueError(f"term 'advisd': feedback uses the field(s) {unknown}; a template may use only "
                         f"{{{'}, {'.join(FEEDBACK_FIELDS)}}}")
    try:
        feedback_text(template, success=True, ret=1.0, turns=1, t=0, action="x", reward=0.0)
    except (ValueError, TypeError, KeyError, IndexError) as e:
        raise ValueError(f"term 'advisd': feedback={template!r} does not format ({e}); ret and reward are floats, "
                         f"turns and t ints, outcome and action strings") from None


@params_dataclass(frozen=True)
class AdviSDParams:
    weight: float = param(0.1, "w: coefficient of L_SD added to the RL loss", low=0.0)
    fraction: float = param(0.25, "share of a round's decisions supervised by L_SD (k = ceil(fraction * n))",
                            low=0.0, high=1.0, low_open=True)
    mode: str = param("magnitude", "'magnitude' (the k largest |advice influence|) or 'random' (k uniformly drawn: "
                                   "the matched-count baseline)", choices=MODES)
    reduce: str = param("mean", "influence over the executor response's tokens: 'mean' or 'sum' of the log-prob "
                                "difference, then its magnitude", choices=REDUCES)
    feedback: str = param(DEFAULT_FEEDBACK, "template of the outcome feedback appended to the teacher's prompt; "
                                            "fields: " + ", ".join(FEEDBACK_FIELDS))
    ask: str = param(DEFAULT_ASK, "appended to the turn's user message to make the advisor's prompt (the advisor "
                                  "answers with its advice)")
    advice_format: str = param(DEFAULT_ADVICE, "appended to the turn's user message to make the executor's prompt; "
                                               "must hold {advice}")
    executor: str | None = param(None, "model path or local name of the frozen executor (None: a frozen copy of "
                                       "the advisor's starting weights; same tokenizer required)")
    advice_tokens: int = param(16, "most tokens of one piece of advice (also capped by max_completion_length)",
                               low=1, high=4096)
    seed: int = param(0, "seed of the random mode's draw (the draw of step k uses seed + k: nothing to checkpoint)",
                      low=0)

    def __post_init__(self) -> None:
        _check_template(self.feedback)
        if self.advice_format.count("{advice}") != 1:
            raise ValueError(f"term 'advisd': advice_format={self.advice_format!r} must hold {{advice}} exactly once "
                             f"(where the advisor's advice enters the executor's prompt), e.g. {DEFAULT_ADVICE!r}")


def _vector(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"advisd: {name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def advice_influence(logp_with: torch.Tensor, logp_without: torch.Tensor, mask: torch.Tensor,
                     reduce: str = "mean") -> torch.Tensor:
    """``influence_i`` of :data:`FORMULA`: ``|mean_t (logp_with - logp_without)|`` (or ``|sum_t ...|``) over each row's
    masked executor-response tokens. All three are ``[N, T]`` (the advisor's log-probs of the recorded executor
    response under the executor prompt with and without the advice); returns ``[N]`` float, detached; a row without
    any response token has influence 0. NaN/inf at a masked-in position is a ``ValueError``."""
    if reduce not in REDUCES:
        raise ValueError(f"advice_influence: reduce={reduce!r}; choose one of {list(REDUCES)}")
    lw, lo, m = _vector(logp_with, "logp_with"), _vector(logp_without, "logp_without"), _vector(mask, "mask")
    if lw.dim() != 2 or lw.shape != lo.shape or m.shape != lw.shape:
        raise ValueError(f"advice_influence: logp_with {tuple(lw.shape)}, logp_without {tuple(lo.shape)} and mask "
                         f"{tuple(m.shape)} must all be [decisions, response tokens] (pad shorter responses and "
                         f"mask the padding with 0)")
    m = m.bool() if m.dtype == torch.bool else m != 0
    diff = (lw.detach().double() - lo.detach().double())
    if not bool(torch.isfinite(diff[m]).all()):
        raise ValueError("advice_influence: logp_with/logp_without hold NaN/inf at masked-in response tokens; score "
                         "only real response tokens (mask padding with 0) and check the advisor's forward")
    total = torch.where(m, diff, torch.zeros((), dtype=diff.dtype)).sum(1)
    if reduce == "mean":
        total = total / m.sum(1).clamp_min(1)
    return total.abs().float()


def select_count(n: int, fraction: float) -> int:
    """``k = ceil(fraction * n)`` (0 when ``n`` is 0); ``fraction`` must lie in ``(0, 1]``."""
    f = _fraction(fraction)
    n = int(n)
    if n < 0:
        raise ValueError(f"select_count: n={n} must be >= 0")
    return 0 if n == 0 else min(n, max(1, math.ceil(f * n - 1e-9)))


def _fraction(fraction) -> float:
    try:
        f = float(fraction)
    except (TypeError, ValueError):
        raise ValueError(f"select_decisions: fraction must be a number in (0, 1], got {fraction!r}") from None
    if not (0.0 < f <= 1.0):
        raise ValueError(f"select_decisions: fraction={fraction!r} must lie in (0, 1] (the share of decisions "
                         f"supervised); pass count= for an absolute number")
    return f


def select_decisions(influence: torch.Tensor, fraction: float | None = None, *, count: int | None = None,
                     mode: str = "magnitude", generator: torch.Generator | None = None,
                     valid: torch.Tensor | None = None) -> torch.Tensor:
    """The selected decisions ``S`` of :data:`FORMULA` as a ``[N]`` bool mask: exactly ``k`` of the ``valid`` ones
    (``k = count``, or ``ceil(fraction * n_valid)``; give one of them). ``magnitude`` takes the ``k`` largest
    ``influence`` values (ties: the earlier index); ``random`` draws ``k`` uniformly without replacement from
    ``generator`` (the matched-count baseline; its influence values are not read beyond their shape)."""
    x = _vector(influence, "influence")
    if x.dim() != 1:
        raise ValueError(f"select_decisions: influence must be 1-D [decisions], got shape {tuple(x.shape)}; pass one "
                         f"value per decision (advice_influence returns that)")
    if mode not in MODES:
        raise ValueError(f"select_decisions: mode={mode!r}; choose one of {list(MODES)}")
    if valid is None:
        valid = torch.ones(x.shape, dtype=torch.bool, device=x.device)
    valid = _vector(valid, "valid")
    if valid.shape != x.shape:
        raise ValueError(f"select_decisions: valid {tuple(valid.shape)} must match influence {tuple(x.shape)}")
    valid = valid.bool()
    if mode == "magnitude" and not bool(torch.isfinite(x[valid]).all()):
        raise ValueError("select_decisions: influence holds NaN/inf at valid decisions; compute it with "
                         "advice_influence (finite log-probs) or mark those decisions invalid")
    n = int(valid.sum())
    if (fraction is None) == (count is None):
        raise ValueError("select_decisions: give exactly one of fraction= (a share in (0, 1]) or count= (an int)")
    if count is not None:
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= n:
            raise ValueError(f"select_decisions: count={count!r} must be an int in [0, {n}] (the number of valid "
                             f"decisions)")
        k = count
    else:
        k = select_count(n, fraction)
    idx = torch.nonzero(valid, as_tuple=False).flatten()
    out = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
    if k == 0:
        return out
    if mode == "magnitude":
        # stable sort on -|value| over the valid indices (ascending index): ties go to the earlier decision
        order = torch.sort(-x[idx].detach().double().abs(), stable=True).indices
        chosen = idx[order[:k].to(idx.device)]
    else:
        perm = torch.randperm(n, generator=generator)
        chosen = idx[perm[:k].to(idx.device)]
    out[chosen] = True
    return out


def flatten_parts(parts: Sequence[tuple[Sequence[float], Sequence[bool]]]
                  ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The round of :func:`select_across` as one table: ``parts[r]`` is process ``r``'s ``(influence, valid)``;
    returns their concatenations (``float64`` influence, ``bool`` valid, rank order) and each process's size."""
    sizes = [len(inf) for inf, _ in parts]
    if any(len(v) != n for (_, v), n in zip(parts, sizes)):
        raise ValueError("select_across: every process's influence and valid lists must have the same length")
    influence = torch.tensor([float(x) for inf, _ in parts for x in inf], dtype=torch.float64)
    valid = torch.tensor([bool(v) for _, val in parts for v in val], dtype=torch.bool)
    return influence, valid, sizes


def select_across(parts: Sequence[tuple[Sequence[float], Sequence[bool]]], fraction: float, *,
                  mode: str = "magnitude", generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """One selection over every process's decisions, as each process's share: ``parts[r]`` is process ``r``'s
    ``(influence, valid)`` (rank order, as an all-gather returns them); the result's ``r``-th mask is the ``r``
    slice of :func:`select_decisions` over their concatenation, so ``k = ceil(fraction * n_valid)`` counts the whole
    round and ties go to the lower rank, then the earlier decision. ``random`` needs the same ``generator`` state on
    every process (a shared seed): each then draws the same global sample."""
    influence, valid, sizes = flatten_parts(parts)
    chosen = select_decisions(influence, fraction, mode=mode, generator=generator, valid=valid)
    return list(torch.split(chosen, sizes))


def advisd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor,
                selected: torch.Tensor) -> torch.Tensor:
    """``L_SD`` of :data:`FORMULA`: the per-token reverse KL ``KL(pi_student || pi_teacher)`` over the vocabulary at
    the advice tokens (``student_logits`` / ``teacher_logits`` ``[N, T, V]`` at the same advice positions, ``mask``
    ``[N, T]`` the advice tokens), averaged over the tokens of the ``selected`` ``[N]`` decisions. The teacher is
    detached (gradient only through the student's selected tokens); no selected token: ``0`` (still attached)."""
    s, t = _vector(student_logits, "student_logits"), _vector(teacher_logits, "teacher_logits")
    m, sel = _vector(mask, "mask"), _vector(selected, "selected")
    if s.dim() != 3:
        raise ValueError(f"advisd_loss: student_logits must be [decisions, advice tokens, vocab], got "
                         f"{tuple(s.shape)}")
    if sel.shape != s.shape[:1]:
        raise ValueError(f"advisd_loss: selected {tuple(sel.shape)} must be [decisions] = {tuple(s.shape[:1])} "
                         f"(select_decisions returns that)")
    if m.shape != s.shape[:2]:
        raise ValueError(f"advisd_loss: mask {tuple(m.shape)} must be [decisions, advice tokens] = "
                         f"{tuple(s.shape[:2])}")
    keep = (m.bool() if m.dtype == torch.bool else m != 0) & sel.bool().unsqueeze(1)
    if not bool(keep.any()):
        return s.sum() * 0.0
    kl = reverse_kl(s, t.detach(), keep)
    return torch.where(keep, kl, torch.zeros((), dtype=kl.dtype, device=kl.device)).sum() / keep.sum()
