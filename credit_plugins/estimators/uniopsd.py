"""UniOPSD: GiGPO whose step tier is fused with a successful-peer hindsight teacher, and token-modulated by it.

Paper: "UniOPSD: Unified On-Policy Self-Distillation", arXiv:2609.34810. Follows the authors' code
``Zenghuang-Fu/Uniopsd`` (``rlsd_utils.compute_opsd_step_tier``, ``compute_rlsd_token_advantage(form="fusion")``,
``rlsd_ray_trainer`` with ``c_mode: corr``) step for step; spec distill §7 [S-code].

The formulas are :data:`FORMULA` (what ``agentcredit describe`` and the docs show).

Inputs, one StepTable row per (trajectory, turn): ``state`` (anchor key), rewards (the episode return is their
sum), and three extras of shape ``[S, L]`` (the row's response tokens, right-padded): ``logp_old`` (behaviour
log-probs), ``logp_teacher`` (log-probs of the same tokens under the peer-prefixed prompt, scored by the same policy;
rows without a teacher carry ``logp_old`` itself, so delta = 0 there) and ``response_mask`` (0/1 or bool, 1 on trainable
tokens). "Taught" rows are those with sum_t |delta| > 0 on the mask. Which rows get a teacher (the first successful
peer of the group; successes and all-fail groups get none) is decided upstream, by
:func:`distill_plugins.hindsight.choose_peers`, when the teacher log-probs are computed.

Cross-batch state (:class:`UniOPSD`): the correlation EMA rhobar (``None`` before the first measurement), n_prev
(the number of both-evidence rows of the last measurement) and the batch counter m. After every batch rhobar is
updated on the both-evidence rows, if there are at least two and A^S and A^O both vary there, with the Pearson
correlation rho_m = corr(A^S, A^O): ``rhobar = decay rhobar + (1 - decay) rho_m`` (``rho_m`` itself the first time),
n_prev = |both|. rho_hat uses only previous batches, so the first batch runs teacher-off (rho_hat = 0 => c* = 1 =>
F = A^S): with ``lam0 = 0`` it is plain GiGPO (mean_norm).

Where this follows the authors' code rather than the paper summary ([S-code]):

* m counts batches from 1 (verl's ``global_steps`` is 1 on the first update), so lambda_1 = lam0 (1 - 1/T_decay);
  m >= T_decay gives 0 (``warmdown_steps = 0`` gives lambda = 0 throughout).
* Medians are ``torch.median``, the *lower* median of an even-sized set. They are taken over the both-evidence
  rows, falling back to each source's own rows (has step evidence / taught), then to 1; divided by max(median, eps).
* u is clamped to [1e-3, 1]; the rho_hat shrinkage uses max(n_prev, 1); c* >= 1 - 1e-6 sets c = 1 on every row
  (the teacher is off, vacuum rows included); c* is clipped to [0, 1] and c_k's denominator floored at eps.
* The scale s is 0 when fewer than two rows are taught or std_T(d) <= eps; both stds are unbiased (torch.std).
  Var_t(delta_k) is the within-row variance with denominator L_k (mask tokens of the row, at least 1), var_g R the
  anchor-group variance of the discounted step return with denominator n - 1. rho_m uses population stds.
* The token weight keys off sign(F_k) (the fused step tier), not sign(A^E + F).
* A^S carries omega (the spec's "omega (R - mean)"), so s matches the spread of omega A^S; p^S uses the raw R.

Decisions where the spec is open ([R]):

* A row with no mask token is allowed: its output row is 0, its delta is 0 (untaught) and it still counts in its
  anchor group (its return is a real sample). NaN/inf in ``logp_old`` / ``logp_teacher`` on mask tokens is a
  ``ValueError`` naming the field and the count; off the mask they are ignored (padding may hold anything).
* Numerics: an anchor group whose discounted returns agree within rounding (max - min <= 1e-9 (1 + max |R|)) has no
  step evidence and A^S = 0 exactly there (the value in exact arithmetic; GiGPO's own A^S carries ~1e-16 of
  rounding noise there, which would otherwise make p^S = n/eps and silently turn a vacuum row into an arbitrating
  one). The same relative tolerance (1e-12) decides whether A^S and A^O "vary" for the rho update.
* ``frozen_rho`` (the paper's "frozen rho = 0.25" ablation): rho_hat = frozen_rho on every batch, no shrinkage;
  rhobar and n_prev still advance, for the diagnostics.
* The diagnostics (:attr:`UniOPSD.stats`) are this batch's: ``rho_hat``, ``c_star`` and ``lambda`` are the values
  used for it (the authors log c* after the update, i.e. the next batch's); ``corr`` is rho_m (0 when it could not
  be measured; ``corr_measured`` says which), ``sign_disagree`` the fraction of both-evidence rows where
  sign(A^S) != sign(A^O), ``both_coverage`` |both| / S, ``c_mean`` and ``c_frac_mid`` (0.1 < c < 0.9) over all rows,
  ``clip_saturation_frac`` the mask tokens whose unclipped exp(sign(F) delta) reaches a clip bound (the authors'
  diagnostic keys off the sign of the GiGPO sum; this one off sign(F), the sign the weights use),
  ``dead_token_frac`` the mask tokens with Ahat = 0, ``opsd_rescue_frac`` the rows with A^S = 0 but F != 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..estimator import Estimator, Extra, StatefulEstimator, make_params, param
from ..segments import segment_sum
from ..steptable import StepTable
from .gigpo import step_advantage
from .grpo import EPISODE_STATS, episode_advantage

FORMULA = """\
delta_kt  = logp_teacher - logp_old  (mask tokens),  dbar_k = mean_t delta_kt,  g(k) = anchor group (group, state)
A^E_k     = e_k - mean_group e                                       GiGPO episode tier (mean_norm)
A^S_k     = omega (R_k - mean_g(k) R),  R_k = sum_l>=t gamma^(l-t) r_l   GiGPO step tier (mean_norm)
A^O_k     = s (dbar_k - mean_g(k) dbar),  s = std_T(A^S) / (std_T(dbar - mean_g dbar) + eps)   T = taught rows
p^S_k     = n_g / max(var_g R, eps),  p^O_k = 1 / max(s^2 Var_t(delta_k) / L_k, eps)
z^S, z^O  = p^S / median_both p^S,  p^O / median_both p^O              both = step evidence and taught
rho_hat   = max(0, rhobar - kappa / sqrt(n_prev max(1/(1-decay), 1))),  q = min(rho_hat^2, u (1 - 1e-6))
c*        = u (u - q) / (u^2 - 2 u q + q)                              global trust in the environment
c_k       = a z^S_k / (a z^S_k + z^O_k) (both),  c* (taught, no step evidence),  1 (untaught);  a = c*/(1-c*)
F_k       = c_k A^S_k + (1 - c_k) A^O_k
w_kt      = clip(exp(sign(F_k) delta_kt), 1 - eps_w, 1 + eps_w),  lambda_m = lam0 max(1 - m / T_decay, 0)
Ahat_kt   = A^E_k + F_k [(1 - lambda_m) + lambda_m w_kt]  on mask tokens, 0 elsewhere
extras: logp_old, logp_teacher [S, L] float; response_mask [S, L] 0/1 or bool
"""

__all__ = ["UniOPSDParams", "UniOPSD", "UniOPSDTerms", "ESTIMATOR", "uniopsd", "uniopsd_terms", "initial_state",
           "c_star", "shrunk_rho", "lambda_at", "token_inputs"]

EXTRAS = ("logp_old", "logp_teacher", "response_mask")
C_STAR_ONE = 1.0 - 1e-6      # c* at or above this switches the teacher off (authors' threshold)
CONST_RTOL = 1e-9            # anchor-group returns equal within this relative spread carry no step evidence
VARY_RTOL = 1e-12            # A^S / A^O "vary" on the both-evidence rows beyond this relative spread


@dataclass
class UniOPSDParams:
    """Hyperparameters of UniOPSD (defaults: the authors' ``uniopsd.yaml`` / ``*_corr_*.yaml``)."""

    gamma: float = param(0.95, "Discount of GiGPO's step return R_t.")
    step_weight: float = param(1.0, "Weight omega of the GiGPO step tier A^S (step_advantage_w).")
    norm_std: bool = param(False, "GiGPO normalisation: False is 'mean_norm' (the paper configs), True divides both "
                           "tiers by their group std ('mean_std_norm').")
    episode_stats: str = param("steps", "A^E statistics over 'steps' (verl-agent default) or 'trajectories'.")
    similarity_thresh: float | None = param(
        None, "Anchor groups as gigpo's similarity_thresh: None exact states; p also merges states whose texts reach "
        "difflib's ratio p within a task group (needs state texts).", low=0.0, high=1.0,
        why="a difflib ratio lies in [0, 1]")
    a_reliability: float = param(0.5, "u = Var(T)/Var(A^S), the assumed reliability of the environment's step "
                                 "estimate; in (0, 1].")
    rho_decay: float = param(0.9, "EMA decay of the correlation rhobar between A^S and A^O; in [0, 1).")
    rho_shrink_z: float = param(2.33, "kappa: rho_hat = rhobar - kappa / sqrt(n_prev / (1 - decay)) (one-sided 1%).")
    lam0: float = param(0.5, "lambda_0, initial weight of the token modulation w (rlsd_lambda); in [0, 1].")
    warmdown_steps: int = param(100, "T_decay: lambda decays linearly to 0 at batch T_decay (0: lambda = 0).")
    clip_eps: float = param(0.2, "eps_w: the token weight w is clipped to [1 - eps_w, 1 + eps_w]; in [0, 1).")
    eps: float = param(1e-6, "Floor of variances, precisions and denominators.")
    frozen_rho: float | None = param(None, "If set, rho_hat is this value on every batch (the paper's 'frozen "
                                     "rho = 0.25' ablation); None estimates it from previous batches.")
    peer_success_threshold: float | None = param(
        None, "What makes a trajectory a successful peer, read by the hindsight scoring "
        "(distill_plugins.hindsight.choose_peers), not here: None = the rollout's success flag (robust to progress "
        "shaping); a number = episode return >= it (the authors' peer_success_threshold 1.0 on ALFWorld's 10/0).")

    def __post_init__(self):
        checks = [
            ("gamma", 0.0 <= self.gamma <= 1.0, "the discount must lie in [0, 1]"),
            ("step_weight", math.isfinite(self.step_weight), "use a finite weight (1.0 in the paper)"),
            ("a_reliability", 0.0 < self.a_reliability <= 1.0, "u is a reliability in (0, 1] (0.5 in the paper)"),
            ("rho_decay", 0.0 <= self.rho_decay < 1.0, "the EMA decay must lie in [0, 1) (0.9 in the paper)"),
            ("rho_shrink_z", 0.0 <= self.rho_shrink_z < math.inf, "kappa must be finite and >= 0 (2.33)"),
            ("lam0", 0.0 <= self.lam0 <= 1.0, "lambda_0 must lie in [0, 1] (0.5 in the paper)"),
            ("clip_eps", 0.0 <= self.clip_eps < 1.0, "eps_w must lie in [0, 1) so the weight stays > 0 (0.2)"),
            ("eps", self.eps > 0, "it must be > 0 so a zero variance does not divide by zero"),
            ("peer_success_threshold", self.peer_success_threshold is None or math.isfinite(self.peer_success_threshold),
             "use None (the success flag) or a finite return (1.0)"),
        ]
        for name, ok, fix in checks:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r}; {fix}")
        if isinstance(self.warmdown_steps, bool) or not isinstance(self.warmdown_steps, int) or self.warmdown_steps < 0:
            raise ValueError(f"warmdown_steps={self.warmdown_steps!r}; give the number of batches (an int >= 0, "
                             f"100 in the paper) over which lambda decays to 0")
        if self.episode_stats not in EPISODE_STATS:
            raise ValueError(f"episode_stats={self.episode_stats!r}; choose one of {EPISODE_STATS}")
        if self.frozen_rho is not None and not 0.0 <= self.frozen_rho <= 1.0:
            raise ValueError(f"frozen_rho={self.frozen_rho!r}; use None (estimate rho) or a value in [0, 1] "
                             f"(0.25 in the paper's ablation)")


# ---- scalar schedule pieces ----------------------------------------------------------------------------------
def c_star(rho_hat: float, u: float) -> float:
    """Global trust in the environment's step estimate, ``u (u - q) / (u^2 - 2 u q + q)``, q = min(rho^2, u(1-1e-6)).

    From A^S = T + e_S, A^O = a T + e_O with Var(A^S) = Var(A^O) = s^2, u = Var(T)/s^2 and rho = a u:
    c* = prec_S / (prec_S + a^2 prec_O). rho -> 0 gives 1, u -> 1 gives 1, rho^2 -> u gives 0.
    """
    u = min(max(float(u), 1e-3), 1.0)
    q = min(min(max(float(rho_hat), 0.0), 1.0) ** 2, u * (1.0 - 1e-6))
    den = u * u - 2.0 * u * q + q
    return 1.0 if den <= 0 else min(max(u * (u - q) / den, 0.0), 1.0)


def shrunk_rho(rho_ema: float | None, n_prev: int, decay: float, z: float) -> float:
    """``max(0, rhobar - z / sqrt(max(n_prev, 1) max(1/(1-decay), 1)))``; 0 before the first measurement."""
    if rho_ema is None:
        return 0.0
    n = max(int(n_prev), 1) * max(1.0 / max(1.0 - decay, 1e-9), 1.0)
    return max(0.0, float(rho_ema) - z / max(math.sqrt(n), 1e-9))


def lambda_at(m: int, lam0: float, warmdown_steps: int) -> float:
    """``lam0 max(1 - m / T_decay, 0)``; 0 for m >= T_decay (and for T_decay = 0)."""
    if m >= warmdown_steps:
        return 0.0
    return lam0 * (1.0 - m / warmdown_steps)


# ---- inputs ------------------------------------------------------------------------------------------------------
#: Token entries per block of the token passes (2 MB of float64): the [S, L] work runs block by block over rows, so
#: its temporaries stay in cache and are reused instead of being fresh [S, L] allocations (page faults) per op.
BLOCK_ELEMS = 1 << 18


def row_blocks(n_rows: int, width: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` covering ``range(n_rows)`` in blocks of about :data:`BLOCK_ELEMS` entries."""
    step = max(1, BLOCK_ELEMS // max(int(width), 1))
    return [(i, min(i + step, n_rows)) for i in range(0, n_rows, step)]


@dataclass
class TokenRows:
    """The token blocks reduced per row (sorted order): what the per-row pieces read from ``[S, L]``. ``delta`` and
    ``mask`` are ``None`` when the pass did not keep them (the stateful call's fast path re-reads the inputs)."""

    delta: torch.Tensor | None      # [S, L] float64, 0 off mask
    mask: torch.Tensor | None       # [S, L] bool
    count: torch.Tensor             # [S] int64 mask tokens of the row
    total: torch.Tensor             # [S] float64 sum_t delta
    var: torch.Tensor               # [S] float64 within-row variance of delta (denominator max(L_k, 1))
    abs_total: torch.Tensor         # [S] float64 sum_t |delta|


def _bad_mask(mask: torch.Tensor) -> None:
    bad = ~((mask == 0) | (mask == 1))
    if bool(bad.any()):
        raise ValueError(f"extras['response_mask'] has {int(bad.sum())} value(s) other than 0/1 (e.g. "
                         f"{float(mask[bad][0])}); give 0/1 or bool, 1 on trainable response tokens")


class TokenBlocks:
    """The validated ``[S, L]`` token inputs, read block by block over rows: :meth:`block` fills reusable buffers
    with delta = logp_teacher - logp_old (float64, 0 off mask) and the mask of rows ``i:j``."""

    def __init__(self, steps: StepTable):
        steps.require(*EXTRAS, by="estimator 'uniopsd'")
        logp_old, logp_teacher, mask = (steps.extra(name) for name in EXTRAS)
        if logp_old.ndim != 2:
            raise ValueError(f"extras['logp_old'] has shape {tuple(logp_old.shape)}; UniOPSD needs [S, L] per-token "
                             f"log-probs (one row per step, right-padded response tokens)")
        for name, x in (("logp_teacher", logp_teacher), ("response_mask", mask)):
            if tuple(x.shape) != tuple(logp_old.shape):
                raise ValueError(f"extras[{name!r}] has shape {tuple(x.shape)} but extras['logp_old'] has "
                                 f"{tuple(logp_old.shape)}; logp_old, logp_teacher and response_mask must all be [S, L] "
                                 f"over the same response tokens")
        if mask.dtype != torch.bool and mask.is_complex():
            raise ValueError("extras['response_mask'] is complex; give 0/1 or bool per token")
        self.logp_old, self.logp_teacher, self.given_mask = logp_old, logp_teacher, mask
        self.shape = tuple(logp_old.shape)
        self.blocks = row_blocks(*self.shape)
        rows = self.blocks[0][1] - self.blocks[0][0] if self.blocks else 0
        self._delta = torch.empty(rows, self.shape[1], dtype=torch.float64)
        self._maskf = torch.empty(rows, self.shape[1], dtype=torch.float64)
        self._mask = torch.empty(rows, self.shape[1], dtype=torch.bool)
        # logp_old as float64 before the subtraction: sub_ with a float32 operand would promote it into a fresh
        # [rows, L] allocation on every block (its page faults cost several times the subtraction)
        self._old64 = torch.empty(rows, self.shape[1], dtype=torch.float64) if logp_old.dtype != torch.float64 else None
        self.scratch = torch.empty(rows, self.shape[1], dtype=torch.float64)  # the callers' per-block temporary

    def block(self, i: int, j: int, want_bool: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(delta, mask as float64 0/1, mask as bool or None)`` of rows ``i:j`` (views of buffers reused by the next
        call). delta is zeroed off the mask by a multiply (a fraction of ``masked_fill_``'s cost on CPU; off-mask
        zeros may be -0.0); a block whose off-mask inputs are NaN/inf is zeroed with ``masked_fill_`` instead."""
        n = j - i
        given = self.given_mask[i:j]
        mf = self._maskf[:n]
        mf.copy_(given)
        d = self._delta[:n]
        d.copy_(self.logp_teacher[i:j])
        old = self.logp_old[i:j]
        if self._old64 is not None:
            old = self._old64[:n]
            old.copy_(self.logp_old[i:j])
        d.sub_(old)                                 # in float64, as logp_teacher.double() - logp_old.double()
        d.mul_(mf)
        if not bool(torch.isfinite(d.sum())):        # NaN/inf in the block (padding may hold anything)
            d.copy_(self.logp_teacher[i:j])
            d.sub_(self.logp_old[i:j])
            d.masked_fill_(~given if given.dtype == torch.bool else given != 1, 0.0)
        m = None
        if want_bool:
            m = given if given.dtype == torch.bool else torch.eq(given, 1, out=self._mask[:n])
        return d, mf, m


def token_rows(steps: StepTable, keep: bool = True, blocks: TokenBlocks | None = None) -> TokenRows:
    """Validated token inputs and their per-row reductions, in one blocked pass over the ``[S, L]`` blocks:
    delta = logp_teacher - logp_old (float64) on mask tokens, 0 off mask; see :func:`token_inputs`. ``keep=False``
    keeps only the per-row reductions (no ``[S, L]`` delta / mask)."""
    blocks = blocks if blocks is not None else TokenBlocks(steps)
    logp_old, logp_teacher, given_mask = blocks.logp_old, blocks.logp_teacher, blocks.given_mask
    S, L = blocks.shape
    f64 = torch.float64
    delta = torch.empty(S, L, dtype=f64) if keep else None
    mask = (given_mask if given_mask.dtype == torch.bool else torch.empty(S, L, dtype=torch.bool)) if keep else None
    count = torch.empty(S, dtype=torch.int64)
    total = torch.empty(S, dtype=f64)
    var = torch.empty(S, dtype=f64)
    abs_total = torch.empty(S, dtype=f64)
    for i, j in blocks.blocks:
        d, mf, m = blocks.block(i, j)
        torch.sum(m, dim=1, out=count[i:j])
        if given_mask.dtype != torch.bool and int(torch.count_nonzero(given_mask[i:j])) != int(count[i:j].sum()):
            _bad_mask(given_mask)  # a value other than 0 and 1 (NaN included): the nonzero ones are not all 1
        if keep:
            delta[i:j] = d
            if mask is not given_mask:
                mask[i:j] = m
        torch.sum(d, dim=1, out=total[i:j])
        n_tok = count[i:j].to(f64).clamp(min=1.0)
        dev = torch.sub(d, (total[i:j] / n_tok)[:, None], out=blocks.scratch[: j - i])
        dev.mul_(mf)
        var[i:j] = dev.pow_(2).sum(dim=1) / n_tok
        torch.abs(d, out=dev)
        torch.sum(dev, dim=1, out=abs_total[i:j])
    if not bool(torch.isfinite(total).all()):  # a NaN/inf delta makes its row's sum non-finite
        m = given_mask if given_mask.dtype == torch.bool else given_mask == 1
        for name, x in (("logp_old", logp_old), ("logp_teacher", logp_teacher)):
            bad = m & ~torch.isfinite(x)
            if bool(bad.any()):
                raise ValueError(f"extras[{name!r}] has {int(bad.sum())} NaN/inf value(s) on mask tokens; recompute "
                                 f"the log-probs in float32 (or mask those tokens out in response_mask)")
        # finite inputs whose difference overflows float64 (or whose row sum does): check_output names them
    return TokenRows(delta=delta, mask=mask, count=count, total=total, var=var, abs_total=abs_total)


def token_inputs(steps: StepTable) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated ``(delta, mask)``: delta ``[S, L]`` float64 = logp_teacher - logp_old on mask tokens (0 off mask), mask
    ``[S, L]`` bool; sorted order."""
    rows = token_rows(steps)
    return rows.delta, rows.mask


# ---- the per-batch pieces ------------------------------------------------------------------------------------
def anchor_spread(values: torch.Tensor, anchor: torch.Tensor, n_anchor: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[S] ``(n_g, constant_g)`` of each row's anchor group: its size and whether its values agree within rounding."""
    n = torch.bincount(anchor, minlength=n_anchor).to(torch.float64)
    hi = torch.full((n_anchor,), -math.inf, dtype=torch.float64).scatter_reduce(0, anchor, values, "amax")
    lo = torch.full((n_anchor,), math.inf, dtype=torch.float64).scatter_reduce(0, anchor, values, "amin")
    constant = (hi - lo) <= CONST_RTOL * (1.0 + torch.maximum(hi.abs(), lo.abs()))
    return n[anchor], constant[anchor]


def anchor_variance(values: torch.Tensor, anchor: torch.Tensor, n_anchor: int) -> torch.Tensor:
    """[S] unbiased (n - 1) variance of each row's anchor group (0 for a singleton); two-pass."""
    count = torch.bincount(anchor, minlength=n_anchor).to(torch.float64)
    mean = segment_sum(values, anchor, n_anchor) / count.clamp(min=1)
    dev = values - mean[anchor]
    return (segment_sum(dev * dev, anchor, n_anchor) / (count - 1).clamp(min=1))[anchor]


def anchor_centred(values: torch.Tensor, anchor: torch.Tensor, n_anchor: int) -> torch.Tensor:
    """[S] ``x_k - mean_{g(k)} x``."""
    count = torch.bincount(anchor, minlength=n_anchor).to(torch.float64)
    return values - (segment_sum(values, anchor, n_anchor) / count.clamp(min=1))[anchor]


def scale_match(a_step: torch.Tensor, d: torch.Tensor, taught: torch.Tensor, eps: float) -> float:
    """s = std_T(A^S) / (std_T(d) + eps) on the taught rows T; 0 if |T| <= 1 or std_T(d) <= eps."""
    if int(taught.sum()) <= 1:
        return 0.0
    s_d = float(d[taught].std())
    if not s_d > eps:
        return 0.0
    return float(a_step[taught].std()) / (s_d + eps)


def median_normalised(prec: torch.Tensor, own: torch.Tensor, both: torch.Tensor, eps: float) -> torch.Tensor:
    """``prec / max(median, eps)`` on ``own`` rows (0 elsewhere); lower median over ``both``, else ``own``, else 1."""
    pool = both if bool(both.any()) else own
    med = float(prec[pool].median()) if bool(pool.any()) else 1.0
    return torch.where(own, prec / max(med, eps), torch.zeros_like(prec))


def reliability(cstar: float, z_s: torch.Tensor, z_o: torch.Tensor, both: torch.Tensor, taught: torch.Tensor,
                eps: float) -> torch.Tensor:
    """[S] c_k: arbitration on both-evidence rows, c* on vacuum rows (taught, no step evidence), 1 untaught."""
    if cstar >= C_STAR_ONE:
        return torch.ones_like(z_s)
    a = cstar / (1.0 - cstar)
    num = a * z_s
    den = num + z_o
    arbitrated = torch.where(den > 0, num / den.clamp(min=eps), torch.ones_like(den))
    c = torch.where(both, arbitrated, torch.where(taught, torch.full_like(z_s, cstar), torch.ones_like(z_s)))
    return c.clamp(0.0, 1.0)


def varies(x: torch.Tensor) -> bool:
    """``x`` is not constant beyond rounding (relative spread > 1e-12)."""
    if x.numel() < 2:
        return False
    hi, lo = float(x.max()), float(x.min())
    return hi - lo > VARY_RTOL * (1.0 + max(abs(hi), abs(lo)))


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson correlation with population stds (callers ensure both vary), clipped to [-1, 1] against rounding
    (perfectly (anti-)correlated sets give |r| = 1 + 2e-16 in float64)."""
    ac, bc = a - a.mean(), b - b.mean()
    r = float((ac * bc).mean() / (a.std(unbiased=False) * b.std(unbiased=False)))
    return min(1.0, max(-1.0, r))


# ---- one batch ---------------------------------------------------------------------------------------------------
@dataclass
class UniOPSDTerms:
    """Every intermediate of one batch (sorted order; [S] unless noted), for tests and diagnostics."""

    advantage: torch.Tensor | None  # [S, L] float64 (None in the stateful call's fast path)
    a_episode: torch.Tensor
    a_step: torch.Tensor         # omega A^S
    a_opsd: torch.Tensor         # A^O
    fused: torch.Tensor          # F
    c: torch.Tensor
    taught: torch.Tensor
    has_step: torch.Tensor
    both: torch.Tensor
    z_s: torch.Tensor
    z_o: torch.Tensor
    delta: torch.Tensor | None   # [S, L], 0 off mask (None in the stateful call's fast path)
    mask: torch.Tensor | None    # [S, L] bool (None in the stateful call's fast path)
    scale: float
    rho_hat: float
    c_star: float
    lam: float
    m: int
    corr: float | None           # rho_m, None when not measurable
    w_raw: torch.Tensor | None = None  # [S, L] unclipped exp(sign(F) delta) (the saturation diagnostic)
    token_counts: dict[str, float] | None = None  # the token sums of the diagnostics, taken in the blocked pass


def initial_state(p: UniOPSDParams | None = None) -> dict[str, Any]:
    return {"step": 0, "rho_ema": None, "n_prev": 0}


def uniopsd_terms(steps: StepTable, p: UniOPSDParams, state: dict[str, Any]) -> tuple[UniOPSDTerms, dict[str, Any]]:
    """One batch from ``state``: the terms and the state after it."""
    terms, new_state, _ = _batch(steps, p, state, want32=False)
    return terms, new_state


F32_SAFE = 0.99 * float(torch.finfo(torch.float32).max)  # |Ahat| bounds below this cast to finite float32


def _batch(steps: StepTable, p: UniOPSDParams, state: dict[str, Any], want32: bool,
           keep: bool = True) -> tuple[UniOPSDTerms, dict[str, Any], torch.Tensor | None]:
    """:func:`uniopsd_terms`, and with ``want32`` the advantages as float32 in the rows' input order, written in the
    token pass, when every one is finite there (None otherwise: the caller casts the float64 ones, and the check
    names what overflowed). ``keep=False`` (with ``want32``) keeps no ``[S, L]`` float64 term: ``delta``, ``mask``
    and ``advantage`` of the terms are None, and the token passes re-read the inputs block by block; it falls back to
    ``keep=True`` when the float32 output cannot be written."""
    steps.require("state", by="estimator 'uniopsd'")
    blocks = TokenBlocks(steps)
    rows = token_rows(steps, keep=keep, blocks=blocks)
    delta, mask = rows.delta, rows.mask
    anchor, n_anchor = steps.anchor_at(p.similarity_thresh)

    # outcome tiers (GiGPO); A^S is 0 exactly where the anchor group has no return spread
    ret = steps.reward_to_go(p.gamma)
    n_k, constant = anchor_spread(ret, anchor, n_anchor)
    a_episode = episode_advantage(steps, norm_std=p.norm_std, eps=p.eps, episode_stats=p.episode_stats)
    a_step = p.step_weight * step_advantage(steps, gamma=p.gamma, norm_std=p.norm_std, eps=p.eps,
                                            similarity_thresh=p.similarity_thresh)
    a_step = torch.where(constant, torch.zeros_like(a_step), a_step)

    # teacher step estimate, centred in the same anchor group and scale-matched on the taught rows
    n_tok = rows.count.to(torch.float64).clamp(min=1.0)
    dbar = rows.total / n_tok
    delta_var = rows.var
    taught = rows.abs_total > 0
    d = anchor_centred(dbar, anchor, n_anchor)
    scale = scale_match(a_step, d, taught, p.eps)
    a_opsd = scale * d

    # evidence sets and median-normalised precisions
    has_step = (n_k >= 2) & ~constant
    both = has_step & taught
    r_var = anchor_variance(ret, anchor, n_anchor)
    prec_s = torch.where(has_step, n_k / r_var.clamp(min=p.eps), torch.zeros_like(r_var))
    prec_o = torch.where(taught, 1.0 / (delta_var / n_tok * scale * scale).clamp(min=p.eps), torch.zeros_like(r_var))
    z_s = median_normalised(prec_s, has_step, both, p.eps)
    z_o = median_normalised(prec_o, taught, both, p.eps)

    # global trust from previous batches, per-row reliability, fused step credit
    rho_hat = (float(p.frozen_rho) if p.frozen_rho is not None
               else shrunk_rho(state["rho_ema"], state["n_prev"], p.rho_decay, p.rho_shrink_z))
    cstar = c_star(rho_hat, p.a_reliability)
    c = reliability(cstar, z_s, z_o, both, taught, p.eps)
    fused = c * a_step + (1.0 - c) * a_opsd

    # bounded token modulation
    m = int(state["step"]) + 1
    lam = lambda_at(m, p.lam0, p.warmdown_steps)
    n_mask = int(rows.count.sum())
    out32 = dest = None
    if want32 and blocks.shape[0] * blocks.shape[1]:
        # |Ahat| <= |A^E| + |F| (1 + eps_w): below F32_SAFE every value casts to a finite float32
        bound = float((a_episode.abs() + fused.abs() * (1.0 + p.clip_eps)).max())
        if bound < F32_SAFE:
            out32 = torch.empty(blocks.shape, dtype=torch.float32)
            order = steps.order
            if not torch.equal(order, torch.arange(order.numel(), dtype=order.dtype)):
                dest = order  # sorted row p is input row order[p]
    if out32 is None and not keep:  # the float64 advantages are needed: check_output names what overflowed
        return _batch(steps, p, state, want32, keep=True)
    advantage, token_counts = modulated_tokens(blocks, a_episode, fused, lam, p.clip_eps, n_mask, out32, dest, keep)
    token_counts.update(n_mask=float(n_mask), delta_sum=float(rows.total.sum()),
                        delta_abs_sum=float(rows.abs_total.sum()))

    # the correlation EMA for the next batch
    corr = None
    if int(both.sum()) > 1 and varies(a_step[both]) and varies(a_opsd[both]):
        corr = pearson(a_step[both], a_opsd[both])
    new_state = {"step": m, "rho_ema": state["rho_ema"], "n_prev": int(state["n_prev"])}
    if corr is not None:
        ema = state["rho_ema"]
        new_state["rho_ema"] = corr if ema is None else p.rho_decay * float(ema) + (1.0 - p.rho_decay) * corr
        new_state["n_prev"] = int(both.sum())
    terms = UniOPSDTerms(advantage=advantage, a_episode=a_episode, a_step=a_step, a_opsd=a_opsd, fused=fused, c=c,
                         taught=taught, has_step=has_step, both=both, z_s=z_s, z_o=z_o, delta=delta, mask=mask,
                         scale=scale, rho_hat=rho_hat, c_star=cstar, lam=lam, m=m, corr=corr,
                         token_counts=token_counts)
    return terms, new_state, out32


def modulated_tokens(blocks: TokenBlocks, a_episode: torch.Tensor, fused: torch.Tensor, lam: float, clip_eps: float,
                     n_mask: int, out32: torch.Tensor | None = None, dest: torch.Tensor | None = None,
                     keep: bool = True) -> tuple[torch.Tensor | None, dict[str, float]]:
    """``Ahat = A^E + F [(1 - lambda) + lambda clip(exp(sign(F) delta))]`` on mask tokens (0 elsewhere), [S, L]
    float64, block by block over rows; with the mask-token counts of a saturated weight and of Ahat = 0 (``n_mask``:
    the mask tokens). ``out32`` (optional, [S, L] float32) receives Ahat cast to float32, row ``p`` at row
    ``dest[p]`` (the same rows when ``dest`` is None). ``keep=False`` returns no float64 ``[S, L]`` (None)."""
    S, L = blocks.shape
    lo, hi = 1.0 - clip_eps, 1.0 + clip_eps
    sign = torch.sign(fused)
    advantage = torch.empty(S, L, dtype=torch.float64) if keep else None
    scratch = None if keep else blocks.scratch
    n_sat = n_nonzero = 0
    for i, j in blocks.blocks:
        d, mf, m = blocks.block(i, j, want_bool=not lo < hi)
        a = advantage[i:j] if keep else scratch[: j - i]
        torch.mul(sign[i:j, None], d, out=a)
        a.exp_()                                                              # w_raw
        if lo < hi:  # off the mask delta = 0, so w_raw = 1 lies inside (lo, hi): count over the whole block
            n_sat += int(torch.count_nonzero(a <= lo)) + int(torch.count_nonzero(a >= hi))
        else:
            n_sat += int(torch.count_nonzero(((a <= lo).logical_or_(a >= hi)).logical_and_(m)))
        a.clamp_(lo, hi).mul_(lam).add_(1.0 - lam).mul_(fused[i:j, None]).add_(a_episode[i:j, None])
        if out32 is not None:
            a.mul_(mf)                              # 0 off the mask (every value is finite here: see the caller)
        else:
            a.masked_fill_(mf == 0, 0.0)
        n_nonzero += int(torch.count_nonzero(a))  # all on mask tokens: the rest are the dead ones
        if out32 is not None:
            if dest is None:
                out32[i:j] = a
            else:
                out32.index_copy_(0, dest[i:j], a.to(torch.float32))
    return advantage, {"n_saturated": float(n_sat), "n_dead": float(n_mask - n_nonzero)}


def batch_stats(terms: UniOPSDTerms, p: UniOPSDParams, state: dict[str, Any]) -> dict[str, float]:
    """The spec distill §7.3 diagnostics of one batch (see the module docstring)."""
    def frac(x: torch.Tensor) -> float:
        return float(x.to(torch.float64).mean()) if x.numel() else 0.0

    t = terms
    mask = t.mask
    both = t.both
    counts = t.token_counts
    if counts is None:  # terms built by hand: the token sums from the [S, L] blocks
        w_raw = t.w_raw if t.w_raw is not None else torch.exp(torch.sign(t.fused)[:, None] * t.delta)
        saturated = (w_raw <= 1.0 - p.clip_eps).logical_or_(w_raw >= 1.0 + p.clip_eps).logical_and_(mask)
        counts = {"n_mask": float(mask.sum()), "n_saturated": float(saturated.sum()),
                  "n_dead": float((t.advantage == 0).logical_and_(mask).sum()), "delta_sum": float(t.delta.sum()),
                  "delta_abs_sum": float(t.delta.abs().sum())}
    n_mask = int(counts["n_mask"])

    def per_token(total) -> float:  # mean over the mask tokens of a quantity summed over them
        return float(total) / n_mask if n_mask else 0.0

    stats = {
        "corr": t.corr if t.corr is not None else 0.0,
        "corr_measured": float(t.corr is not None),
        "sign_disagree": frac(torch.sign(t.a_step[both]) != torch.sign(t.a_opsd[both])),
        "both_coverage": frac(both),
        "taught_frac": frac(t.taught),
        "c_mean": frac(t.c),
        "c_frac_mid": frac((t.c > 0.1) & (t.c < 0.9)),
        "clip_saturation_frac": per_token(counts["n_saturated"]),
        "dead_token_frac": per_token(counts["n_dead"]),
        "opsd_rescue_frac": frac((t.a_step == 0) & (t.fused != 0)),
        "opsd_scale": t.scale,
        "teacher_kl": per_token(-counts["delta_sum"]),  # delta is 0 off the mask
        "gap_abs_mean": per_token(counts["delta_abs_sum"]),
        "lambda": t.lam,
        "rho_hat": t.rho_hat,
        "c_star": t.c_star,
        "step": float(t.m),
    }
    if state["rho_ema"] is not None:
        stats["rho_ema"] = float(state["rho_ema"])
    return {f"uniopsd/{k}": float(v) for k, v in stats.items()}


class UniOPSD(StatefulEstimator):
    """UniOPSD with its cross-batch state. ``est = UniOPSD(lam0=0.5)`` (or ``get("uniopsd").create(...)``), then
    ``adv = est(steps)`` once per training batch (``[S, L]`` float32, input order); ``est.state_dict()`` goes into
    the checkpoint. After each call :attr:`stats` holds the spec distill §7.3 diagnostics (``uniopsd/...``).
    """

    STATE_DOC = "the correlation EMA rhobar of A^S and A^O with its row count n_prev (trust c*) and the batch counter m"
    STATE_SCHEMA = {"step": (int, {"low": 0, "high": 2**63 - 1}), "rho_ema": (float | None, {"low": -1.0, "high": 1.0}),
                    "n_prev": (int, {"low": 0, "high": 2**63 - 1})}

    def __init__(self, params: UniOPSDParams | None = None, **values: Any):
        if params is not None and values:
            raise ValueError("UniOPSD: pass either a UniOPSDParams or keyword parameters, not both")
        self.params = params if params is not None else make_params(UniOPSDParams, values,
                                                                    owner="estimator 'uniopsd'")
        self._state = initial_state(self.params)
        self.stats: dict[str, float] = {}
        self._last: tuple[StepTable, dict[str, Any]] | None = None
        self._last_terms: UniOPSDTerms | None = None

    def __call__(self, steps: StepTable) -> torch.Tensor:
        """Token advantages ``[S, L]`` float32 in the rows' input order (off the mask 0, possibly -0.0: zeroed by a
        multiply); advances the state by one batch."""
        with torch.no_grad():
            terms, new_state, out32 = _batch(steps, self.params, self._state, want32=True, keep=False)
        self._last, self._last_terms = (steps, self._state), (terms if terms.advantage is not None else None)
        self._state = new_state
        self.stats = batch_stats(terms, self.params, new_state)
        if out32 is not None:
            return out32  # float32, cast in the token pass (every value finite there); the locked wrapper checks it
        return steps.to_input_order(terms.advantage)  # float64; the locked wrapper checks it and casts to float32

    @property
    def last_terms(self) -> UniOPSDTerms | None:
        """Every intermediate of the last batch (:class:`UniOPSDTerms`, ``[S, L]`` float64 terms included), or None
        before the first call. The call itself keeps no ``[S, L]`` float64 term (it writes the float32 output block
        by block), so these are computed on first access, from the last batch's StepTable (held until the next call;
        do not modify it in place in between) and the state before it: the same function, the same values."""
        with self._agentcredit_lock():  # a concurrent call replaces _last and _last_terms together, under the lock
            if self._last_terms is None and self._last is not None:
                steps, state = self._last
                with torch.no_grad():
                    self._last_terms = uniopsd_terms(steps, self.params, state)[0]
            return self._last_terms

    def state_dict(self) -> dict[str, Any]:
        s = self._state
        return {"step": int(s["step"]), "rho_ema": None if s["rho_ema"] is None else float(s["rho_ema"]),
                "n_prev": int(s["n_prev"])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = self.check_state(state)  # keys, types, finiteness, ranges (STATE_SCHEMA)
        step, rho, n_prev = state["step"], state["rho_ema"], state["n_prev"]
        self._state = {"step": int(step), "rho_ema": None if rho is None else float(rho), "n_prev": int(n_prev)}

    def reset(self) -> None:
        """Back to the initial state (as after construction)."""
        self._state = initial_state(self.params)

    def __repr__(self) -> str:
        return f"UniOPSD(step={self._state['step']}, rho_ema={self._state['rho_ema']})"


def uniopsd(steps: StepTable, p: UniOPSDParams) -> torch.Tensor:
    """One batch from the initial state (what a fresh :class:`UniOPSD` returns on its first call), sorted order."""
    return uniopsd_terms(steps, p, initial_state(p))[0].advantage


ESTIMATOR = Estimator(
    name="uniopsd",
    fn=uniopsd,
    params=UniOPSDParams,
    paper="UniOPSD: Unified On-Policy Self-Distillation (arXiv:2609.34810); code Zenghuang-Fu/Uniopsd",
    formula=FORMULA,
    requires=("state",),
    extras=tuple(Extra(n, "hindsight") for n in EXTRAS),
    output="token",
    stateful=UniOPSD,
    similarity="similarity_thresh",
)
