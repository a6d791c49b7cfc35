"""Per-token on-policy distillation (OPD) estimators, vectorised and masked. Spec: ``DISTILL.md`` §2.2.

    E1  k1 advantage   A_t = sg[c·(lp_T(y_t) − lp_S(y_t))], optionally Σ_{s≥t} γ^{s−t}(...)   (tinker, P1/P2)
        k3             (r − 1) − log r,  r = p_T(y_t)/p_S(y_t)        (unbiased, ≥ 0; Schulman's k3)
    E2  reverse KL     Σ_v p_S(v)(log p_S(v) − log p_T(v))                                   (GKD β=1, MiniLLM)
        forward KL     Σ_v p_T(v)(log p_T(v) − log p_S(v))                                   (GKD β=0)
    E3  GJSD(β)        β KL(T‖M) + (1−β) KL(S‖M),  M = β p_T + (1−β) p_S;  β=1 → RKL, β=0 → FKL  (TRL GKD)
    E4  SG-FKL         Σ_{v∈V} p̄_T(v)(log p̄_T(v) − log p_S(v)),   V = teacher top-K ∪ stop tokens   (LSD Eq.17-19)
    E5  SG-RKL         Σ_{v∈V} p̄_S(v)(log p̄_S(v) − log p̄_T(v)),  p̄ = p renormalised on V        (LSD Eq.20-21)
    E6  gated NLL      −sg[σ(β(lp_T − lp_S))]·lp_S(y_t)                                        (SDAR / CCM Eq.2-3)
    E7  top-1 CE       −log p_S(argmax_v p_T(v))                                               (OPW Table 8)

Conventions (all functions):

* Inputs are per response position: ``[B, T]`` log-probs of the sampled tokens, or ``[B, T, V]`` logits. ``mask``
  is ``[B, T]`` (bool or 0/1); positions where it is 0 may hold anything (NaN, inf, garbage): they are never read
  into the arithmetic and come out as exactly 0, with a zero gradient.
* Results are per-token ``[B, T]`` float32 (float64 for float64 inputs, for exact checks). Logits are taken through
  ``log_softmax`` in float32 (bf16/fp16 inputs are upcast only at the valid positions); probabilities are ``exp`` of a log-softmax (≤ 0), never of a difference of
  two log-probs, except in :func:`k3` where the log-ratio is clamped (``max_log_ratio``).
* The teacher is checked: non-finite teacher values at valid positions are a ``ValueError`` naming the argument and
  the number of positions; student and teacher logits must have the same shape (same tokenizer / vocabulary).
* Reduce with :func:`reduce` (``token-mean``, ``seq-mean-token-mean``, ``seq-mean-token-sum``, ``sum``).

Decisions on points the spec leaves open [R]:

* GJSD follows TRL's ``GKDTrainer.generalized_jsd_loss`` exactly: β is the *teacher* weight of the mixture, and
  β = 0 / β = 1 are the special cases forward KL(T‖S) / reverse KL(S‖T). The interior formula tends to 0 at both ends
  (M → p_S or p_T), so the function is discontinuous at β ∈ {0, 1}; that is TRL's (and ms-swift's) convention.
* Top-K support (E4/E5) is the **teacher's** top-K plus the stop tokens (LSD §5.3, §5.4: stop tokens are always in
  the support so termination is supervised); a stop token already in the top-K is counted once.
* The k1 discounted future sum runs over *positions* (masked positions contribute 0 but count in the distance), as
  tinker's ``discounted_future_sum_vectorized`` does on the full token sequence; ``discount=0`` is per-token.
* k3 clamps the log-ratio to ``±max_log_ratio`` (default 20) before ``expm1``, so a teacher far more confident than the
  student cannot overflow; within the clamp k3 is exact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "opd_advantage", "k1", "k3", "sampled_logp", "reverse_kl", "forward_kl", "generalized_jsd", "topk_reverse_kl",
    "topk_forward_kl", "gated_nll", "teacher_top1_ce", "reduce", "discounted_future_sum", "REDUCE_MODES",
]

REDUCE_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "sum")


def _f(x: torch.Tensor) -> torch.Tensor:
    """Upcast to at least float32 (bf16/fp16 → float32; float64 stays float64)."""
    return x.double() if x.dtype == torch.float64 else x.float()


# ---- validation --------------------------------------------------------------------------------------------------
def _mask(mask: torch.Tensor | None, shape: torch.Size, what: str) -> torch.Tensor:
    if mask is None:
        return torch.ones(shape, dtype=torch.bool)
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{what}: mask has shape {tuple(mask.shape)}, expected {tuple(shape)} ([B, T], one entry per "
                         f"response position)")
    return mask if mask.dtype == torch.bool else mask != 0


def _check_pair(student: torch.Tensor, teacher: torch.Tensor, s_name: str, t_name: str, what: str) -> None:
    if student.shape == teacher.shape:
        return
    vocab = (student.dim() == 3 and teacher.dim() == 3 and student.shape[:2] == teacher.shape[:2])
    hint = (f"the vocabularies differ ({student.shape[-1]} vs {teacher.shape[-1]}); teacher and student must share "
            f"a tokenizer/vocabulary (DISTILL §1.2; a cross-tokenizer method is out of scope)" if vocab else
            "teacher and student must score the same positions with a shared tokenizer/vocabulary")
    raise ValueError(f"{what}: {s_name} has shape {tuple(student.shape)} but {t_name} has shape "
                     f"{tuple(teacher.shape)}; {hint}")


def _check_finite(values: torch.Tensor, name: str, what: str) -> None:
    """``values`` are the teacher's entries at valid positions only: [N] or [N, V]."""
    bad = ~torch.isfinite(values)
    if bad.dim() > 1:
        bad = bad.flatten(1).any(-1)
    n = int(bad.sum())
    if n:
        raise ValueError(f"{what}: {name} holds NaN/inf at {n} valid (mask=1) position(s) of {bad.numel()}; the "
                         f"teacher forward pass failed or was misaligned (masked-out positions are ignored)")


def _valid_logits(student_logits, teacher_logits, mask, what):
    """(m [B,T] bool, ls [N,V] f32 student log-probs, lt [N,V] f32 teacher log-probs) at valid positions."""
    if student_logits.dim() != 3:
        raise ValueError(f"{what}: student_logits must be [B, T, V], got shape {tuple(student_logits.shape)}")
    if teacher_logits is not None:
        _check_pair(student_logits, teacher_logits, "student_logits", "teacher_logits", what)
    m = _mask(mask, student_logits.shape[:2], what)
    ls = torch.log_softmax(_f(student_logits[m]), dim=-1)
    lt = None
    if teacher_logits is not None:
        t = _f(teacher_logits[m].detach())
        _check_finite(t, "teacher_logits", what)
        lt = torch.log_softmax(t, dim=-1)
    return m, ls, lt


def _scatter(values: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """[N] values at the valid positions → [B, T] (float32, or float64 for float64 inputs), exact zeros elsewhere."""
    out = values.new_zeros(m.shape)
    return out.masked_scatter(m, values) if values.numel() else out


def _pair_logp(student_logp, teacher_logp, mask, what):
    _check_pair(student_logp, teacher_logp, "student_logp", "teacher_logp", what)
    if student_logp.dim() != 2:
        raise ValueError(f"{what}: log-probs must be [B, T], got shape {tuple(student_logp.shape)}")
    m = _mask(mask, student_logp.shape, what)
    t = _f(teacher_logp[m].detach())
    _check_finite(t, "teacher_logp", what)
    return m, _f(student_logp[m]), t


# ---- sampled-token estimators (E1, k3, E6) -----------------------------------------------------------------------
def sampled_logp(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token_ids]: ``[B, T, V], [B, T] -> [B, T]`` float32 (logsumexp in float32)."""
    x = _f(logits)
    return x.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, dim=-1)


def discounted_future_sum(x: torch.Tensor, gamma: float) -> torch.Tensor:
    """``y_t = Σ_{s≥t} γ^{s−t} x_s`` along the last dim, ``[B, T]`` float32; γ ∈ [0, 1].

    Vectorised reverse cumulative sums in float64 over chunks short enough that γ^chunk stays far from underflow
    (one chunk for γ ≥ 0.99 and T ≤ 60k), so there is one Python iteration per chunk, not per token.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"discount must be in [0, 1], got {gamma}")
    if gamma == 0.0:
        return _f(x)
    if gamma == 1.0:
        return x.double().flip(-1).cumsum(-1).flip(-1).to(_f(x).dtype)
    x64 = x.double()
    n = x64.shape[-1]
    chunk = max(1, min(n, int(600.0 / -math.log(gamma))))
    out = torch.empty_like(x64)
    carry = x64.new_zeros(x64.shape[:-1])
    for end in range(n, 0, -chunk):
        start = max(0, end - chunk)
        length = end - start
        pw = gamma ** torch.arange(length, dtype=torch.float64, device=x.device)  # γ^i
        seg = (x64[..., start:end] * pw).flip(-1).cumsum(-1).flip(-1) / pw
        seg = seg + carry.unsqueeze(-1) * (gamma * pw.flip(-1))                # γ^{length−i} · y_end
        out[..., start:end] = seg
        carry = seg[..., 0]
    return out.to(_f(x).dtype)


def opd_advantage(student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor | None = None,
                  coef: float = 1.0, discount: float = 0.0) -> torch.Tensor:
    """E1: the k1 log-ratio as an advantage, ``A_t = sg[coef · (lp_T − lp_S)]`` (DISTILL §2.2, pattern P1/P2).

    ``student_logp`` is ``lp_old`` (the trainer's recomputed behaviour log-prob), ``teacher_logp`` the teacher's
    log-prob of the same sampled token (aligned: computed from a context ending before y_t). ``[B, T] -> [B, T]``
    float32, detached, 0 at masked positions. ``discount`` = tinker's ``kl_discount_factor``: 0 = per-token
    (greedy), 1 = reward-to-go of the per-token rewards.
    """
    m, s, t = _pair_logp(student_logp, teacher_logp, mask, "opd_advantage")
    adv = _scatter(coef * (t - s.detach()), m)
    return discounted_future_sum(adv, discount) * m if discount else adv


def k1(student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """k1 reverse-KL estimate per sampled token, ``lp_S − lp_T`` (= −opd_advantage; E_{y~p_S} = KL(S‖T)).

    Keeps the gradient through ``student_logp`` (a direct-loss form); 0 at masked positions.
    """
    m, s, t = _pair_logp(student_logp, teacher_logp, mask, "k1")
    return _scatter(s - t, m)


def k3(student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor | None = None,
       max_log_ratio: float = 20.0) -> torch.Tensor:
    """k3 estimate of KL(S‖T) per sampled token: ``(r − 1) − log r``, ``log r = clamp(lp_T − lp_S, ±max_log_ratio)``.

    Non-negative and, for y ~ p_S and an unclamped ratio, unbiased (E[r] = 1). Computed as ``expm1(l) − l``.
    """
    m, s, t = _pair_logp(student_logp, teacher_logp, mask, "k3")
    lr = (t - s).clamp(-max_log_ratio, max_log_ratio)
    return _scatter(torch.expm1(lr) - lr, m)


def gated_nll(student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor | None = None,
              beta: float = 5.0) -> torch.Tensor:
    """E6 (SDAR / CCM): ``−sg[σ(β(lp_T − lp_S))] · lp_S`` per sampled token; gradient through ``student_logp``."""
    m, s, t = _pair_logp(student_logp, teacher_logp, mask, "gated_nll")
    gate = torch.sigmoid(beta * (t - s.detach()))
    return _scatter(-gate * s, m)


# ---- full-distribution estimators (E2, E3, E7) -------------------------------------------------------------------
def _kl_rows(lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    """KL(p‖q) per row from log-probs [N, V]: Σ p (log p − log q); terms with p = 0 are exactly 0."""
    p = lp.exp()
    return torch.where(p > 0, p * (lp - lq), torch.zeros_like(p)).sum(-1)


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
               mask: torch.Tensor | None = None) -> torch.Tensor:
    """E2: ``KL(p_S ‖ p_T)`` over the full vocabulary per position, ``[B, T, V] × 2 -> [B, T]`` (grad via student)."""
    m, ls, lt = _valid_logits(student_logits, teacher_logits, mask, "reverse_kl")
    return _scatter(_kl_rows(ls, lt), m)


def forward_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
               mask: torch.Tensor | None = None) -> torch.Tensor:
    """``KL(p_T ‖ p_S)`` over the full vocabulary per position (GJSD β = 0), ``[B, T]``."""
    m, ls, lt = _valid_logits(student_logits, teacher_logits, mask, "forward_kl")
    return _scatter(_kl_rows(lt, ls), m)


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor | None = None,
                    beta: float = 0.5) -> torch.Tensor:
    """E3, TRL/GKD convention: ``β KL(T‖M) + (1−β) KL(S‖M)``, ``M = β p_T + (1−β) p_S``; β=0 → KL(T‖S) (forward),
    β=1 → KL(S‖T) (reverse), as TRL special-cases them. For 0 < β < 1 the value lies in
    ``[0, −β ln β − (1−β) ln(1−β)] ⊆ [0, ln 2]``. ``log M`` is a float32 logsumexp of the two log-probs."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"generalized_jsd: beta must be in [0, 1], got {beta}")
    m, ls, lt = _valid_logits(student_logits, teacher_logits, mask, "generalized_jsd")
    if beta == 0.0:
        return _scatter(_kl_rows(lt, ls), m)
    if beta == 1.0:
        return _scatter(_kl_rows(ls, lt), m)
    lm = torch.logsumexp(torch.stack([ls + math.log(1.0 - beta), lt + math.log(beta)]), dim=0)
    return _scatter(beta * _kl_rows(lt, lm) + (1.0 - beta) * _kl_rows(ls, lm), m)


def teacher_top1_ce(student_logits: torch.Tensor, teacher_logits: torch.Tensor | None = None,
                    mask: torch.Tensor | None = None, teacher_top1: torch.Tensor | None = None) -> torch.Tensor:
    """E7 (OPW's implemented warm-up loss): ``−log p_S(argmax_v p_T(v))`` per position, ``[B, T]``.

    Pass either the teacher's logits ``[B, T, V]`` or its argmax ids ``teacher_top1`` ``[B, T]`` (what a
    vLLM/remote teacher returns); ids outside ``[0, V)`` at valid positions are a ``ValueError``.
    """
    if (teacher_logits is None) == (teacher_top1 is None):
        raise ValueError("teacher_top1_ce: pass exactly one of teacher_logits [B, T, V] or teacher_top1 [B, T]")
    m, ls, lt = _valid_logits(student_logits, teacher_logits, mask, "teacher_top1_ce")
    if lt is not None:
        ids = lt.argmax(-1)
    else:
        if tuple(teacher_top1.shape) != tuple(student_logits.shape[:2]):
            raise ValueError(f"teacher_top1_ce: teacher_top1 has shape {tuple(teacher_top1.shape)}, expected "
                             f"{tuple(student_logits.shape[:2])} (the student's [B, T])")
        ids = teacher_top1[m].long()
        bad = int(((ids < 0) | (ids >= ls.shape[-1])).sum())
        if bad:
            raise ValueError(f"teacher_top1_ce: teacher_top1 holds {bad} id(s) outside the student's vocabulary "
                             f"[0, {ls.shape[-1]}); teacher and student must share a tokenizer/vocabulary")
    return _scatter(-ls.gather(-1, ids.unsqueeze(-1)).squeeze(-1), m)


# ---- top-K support estimators (E4, E5) ---------------------------------------------------------------------------
def _topk_support(student_logits, mask, teacher_logits, k, teacher_ids, teacher_logp, stop_token_ids, what):
    """(m, log p̄_S or log p_S on V, log p̄_T on V, keep) with V = teacher top-K ∪ stop tokens, each [N, K']."""
    if (teacher_logits is None) == (teacher_ids is None):
        raise ValueError(f"{what}: pass either teacher_logits [B, T, V] (with k) or teacher_ids and teacher_logp "
                         f"[B, T, K] (a precomputed teacher support)")
    m, ls, lt = _valid_logits(student_logits, teacher_logits, mask, what)
    vocab = ls.shape[-1]
    stop = torch.as_tensor(list(dict.fromkeys(int(i) for i in stop_token_ids)), dtype=torch.long,
                           device=ls.device).reshape(-1)                         # de-duplicated, order kept
    if stop.numel() and bool(((stop < 0) | (stop >= vocab)).any()):
        raise ValueError(f"{what}: stop_token_ids {stop.tolist()} fall outside the vocabulary [0, {vocab})")
    if lt is not None:
        if k is None or not 1 <= int(k) <= vocab:
            raise ValueError(f"{what}: k must be an int in [1, V={vocab}] with teacher_logits, got {k}")
        lt_k, ids = lt.topk(int(k), dim=-1)
        first = torch.ones_like(ids, dtype=torch.bool)
        if stop.numel():
            # a stop token already in the top-K is counted once ([N, S, K] comparison, not [N, K', K'])
            in_topk = (stop.view(1, -1, 1) == ids.unsqueeze(1)).any(-1)
            first = torch.cat([first, ~in_topk], dim=-1)
            ids = torch.cat([ids, stop.expand(ids.shape[0], -1)], dim=-1)
            lt_k = lt.gather(-1, ids)
    else:
        if teacher_logp is None:
            raise ValueError(f"{what}: teacher_ids needs teacher_logp (the teacher log-probs on those ids)")
        _check_pair(teacher_ids, teacher_logp, "teacher_ids", "teacher_logp", what)
        if tuple(teacher_ids.shape[:2]) != tuple(m.shape) or teacher_ids.dim() != 3:
            raise ValueError(f"{what}: teacher_ids has shape {tuple(teacher_ids.shape)}, expected "
                             f"[{m.shape[0]}, {m.shape[1]}, K] (the student's [B, T] plus the support size)")
        ids = teacher_ids[m].long()
        lt_k = _f(teacher_logp[m].detach())
        _check_finite(lt_k, "teacher_logp", what)
        bad = int(((ids < 0) | (ids >= vocab)).sum())
        if bad:
            raise ValueError(f"{what}: teacher_ids holds {bad} id(s) outside the student's vocabulary [0, {vocab}); "
                             f"teacher and student must share a tokenizer/vocabulary")
        if stop.numel() and ids.shape[0]:
            present = (ids.unsqueeze(-1) == stop).any(-2).all(-1)
            if not bool(present.all()):
                raise ValueError(f"{what}: {int((~present).sum())} valid position(s) lack a stop token "
                                 f"{stop.tolist()} in teacher_ids; the support must include the stop tokens "
                                 f"(DISTILL §5.4) so termination is supervised")
        # a repeated id in a precomputed support is counted once: keep its first occurrence
        width = ids.shape[-1]
        first = torch.ones_like(ids, dtype=torch.bool)
        if width > 1 and ids.shape[0]:
            eq = ids.unsqueeze(-1) == ids.unsqueeze(-2)                              # [N, K, K]
            earlier = torch.ones(width, width, dtype=torch.bool, device=ids.device).tril(-1)
            first = ~(eq & earlier).any(-1)
    neg_inf = torch.tensor(float("-inf"), device=ls.device)
    lt_bar = lt_k - torch.logsumexp(torch.where(first, lt_k, neg_inf), dim=-1, keepdim=True)
    ls_v = ls.gather(-1, ids)
    ls_bar = ls_v - torch.logsumexp(torch.where(first, ls_v, neg_inf), dim=-1, keepdim=True)
    return m, ls_v, ls_bar, lt_bar, first


def topk_reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor | None = None,
                    mask: torch.Tensor | None = None, k: int | None = 32, *, teacher_ids: torch.Tensor | None = None,
                    teacher_logp: torch.Tensor | None = None,
                    stop_token_ids: Sequence[int] = ()) -> torch.Tensor:
    """E5 (LSD SG-RKL): ``Σ_{v∈V} p̄_S(v)(log p̄_S(v) − log p̄_T(v))``, both renormalised on
    ``V = teacher top-K ∪ stop tokens``. Equals :func:`reverse_kl` when K = V.

    Give the teacher as full ``teacher_logits`` (top-``k`` taken here) or as a precomputed support
    ``teacher_ids``/``teacher_logp`` ``[B, T, K]`` (renormalised here; with ``stop_token_ids`` they must be in it).
    """
    m, _, ls_bar, lt_bar, keep = _topk_support(student_logits, mask, teacher_logits, k, teacher_ids, teacher_logp,
                                               stop_token_ids, "topk_reverse_kl")
    p = ls_bar.exp()
    return _scatter(torch.where(keep & (p > 0), p * (ls_bar - lt_bar), torch.zeros_like(p)).sum(-1), m)


def topk_forward_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor | None = None,
                    mask: torch.Tensor | None = None, k: int | None = 32, *, teacher_ids: torch.Tensor | None = None,
                    teacher_logp: torch.Tensor | None = None,
                    stop_token_ids: Sequence[int] = ()) -> torch.Tensor:
    """E4 (LSD SG-FKL, its default): ``Σ_{v∈V} p̄_T(v)(log p̄_T(v) − log p_S(v))``: teacher renormalised on
    ``V = teacher top-K ∪ stop tokens``, the student **not** (its full-vocabulary log-probs). Equals
    :func:`forward_kl` when K = V. Same teacher arguments as :func:`topk_reverse_kl`."""
    m, ls_v, _, lt_bar, keep = _topk_support(student_logits, mask, teacher_logits, k, teacher_ids, teacher_logp,
                                             stop_token_ids, "topk_forward_kl")
    q = lt_bar.exp()
    return _scatter(torch.where(keep & (q > 0), q * (lt_bar - ls_v), torch.zeros_like(q)).sum(-1), m)


# ---- aggregation ---------------------------------------------------------------------------------------------------
def reduce(values: torch.Tensor, mask: torch.Tensor | None = None, mode: str = "token-mean") -> torch.Tensor:
    """Aggregate per-token ``values`` ``[B, T]`` over valid positions to a scalar (verl's ``loss_agg_mode`` names).

    * ``token-mean``: Σ m·v / Σ m over the whole batch (AlignOPSD, agentic LSD).
    * ``seq-mean-token-mean``: mean over sequences of each sequence's token mean (single-turn LSD, Eq. 13).
    * ``seq-mean-token-sum``: mean over sequences of each sequence's token sum.
    * ``sum``: Σ m·v.

    Masked positions are never read (NaN there does not leak). Sequences with no valid token are left out of the
    ``seq-mean-*`` means [R]; an all-masked batch reduces to 0.
    """
    if mode not in REDUCE_MODES:
        raise ValueError(f"reduce: unknown mode {mode!r}; valid modes are {list(REDUCE_MODES)}")
    m = _mask(mask, values.shape, "reduce")
    v = torch.where(m, values, torch.zeros((), dtype=values.dtype, device=values.device))
    mf = m.to(v.dtype)
    if mode == "sum":
        return v.sum()
    if mode == "token-mean":
        return v.sum() / mf.sum().clamp_min(1)
    count = mf.sum(-1)
    per_seq = v.sum(-1) / count.clamp_min(1) if mode == "seq-mean-token-mean" else v.sum(-1)
    has = (count > 0).to(v.dtype)
    return (per_seq * has).sum() / has.sum().clamp_min(1)
