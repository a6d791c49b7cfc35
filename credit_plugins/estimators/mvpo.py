"""MVPO: milestone viability potential policy optimisation (GiGPO plus a potential for zero-credit anchors).

Paper: Zhou, Li, "Learning from Viable Failure Prefixes: Milestone Viability Potential Policy Optimization for
Long-Horizon LLM Agents", arXiv:2609.37111 (§4, Alg. 1, App. A.3). spec credit §6; no author code exists.

The formulas are :data:`FORMULA` (what ``agentcredit describe`` and the docs show).

n_s and std_s are the size and unbiased std of the anchor group (task group, state) of GiGPO; with kappa = 0 the
estimator is GiGPO w/std with the same step_weight (X4). ``sbar`` (EMA of the batch success rate), ``s_0`` and
the milestone weights ``w`` persist across batches: :class:`MVPO` holds them (``state_dict`` for checkpoints).

Inputs: ``state`` (anchor), ``extras['signature']`` [S] (required; any hashable per row, e.g. ALFWorld's
``kitchen|apple+knife|d6``; build the depth part with :func:`depth_bin`), ``extras['milestones']`` [S, M] in {0, 1}
(optional: without it the milestones count as all 0: the milestone term is 0, ``w`` gets Eq. 13 with u = 0, and
only Sbar/Lbar drive Eq. 15, only -delta r_loop drives Eq. 29), ``extras['loop_flag']`` [S] in {0, 1} (optional,
default 0). Signature and milestone parsers (App. A.3) are env-side and live in the env adapters.

Decisions on what the paper leaves open (spec credit §6.2, §15.5); each is a parameter where it is a constant:

* Union-Find scope: per task group; nodes are the distinct (group, signature); no MergeRule beyond exact equality.
  Cycle rule (Eq. 28), read as a true closure: for two visits of one region in one trajectory at t' < t, every
  region on rows t'..t is merged, repeated over *all* trajectories until no trajectory re-enters a region it
  left. Spec credit §6.2 item 3 reads as a single scan of the raw signatures; we take its closure instead because T6.5
  asks for idempotence and order independence, and a single scan has neither: a merge can create a new revisit
  (a = X Y X merges {X, Y}; then b = X Z Y re-enters it, so Z joins; and so on down a chain of trajectories).
  The closure is the unique finest partition, coarser than (group, signature), in which each region's visits
  form one contiguous run per trajectory; so regions of regions are the same regions, whatever the row order or
  labels. Each pass is the connected components of the region graph whose edges are the row-to-row links inside a
  revisit interval, over every trajectory with a row in a region that the previous pass merged (the only ones
  that can re-enter a region now); the passes stop when one merges nothing.
* AMP (Eq. 12): Y = final success of the row's trajectory; E(.) over the step rows of the whole batch (the weights
  are global, X11); u_m = 0 when h_m is constant over the batch, and a batch without ``milestones`` counts as
  all-zero milestones (u = 0). ``beta_amp = 0.1`` (the spec's suggestion). When sum(u) = 0 (no milestone separates
  success from failure: an all-fail batch, MVPO's target regime, or an all-success one) ``amp_zero_sum`` decides:
  ``"eq13"`` (default, Eq. 13 as written) gives w <- (1 - beta_amp) w, ``"keep"`` leaves w unchanged. We
  recommend ``"keep"`` for training (see :func:`amp_update`); the default follows the paper. The weights are
  updated with the current batch *before* its potential is computed (the order of Alg. 1 / spec credit §6.2).
* Eq. 15: ``alpha_s = alpha_l = 1``; Norm = z-score (unbiased std + eps) over the regions of the task group (each
  region one sample); a group whose regions all have one raw value (or with one region) gets Phi = 0.
  Sbar(c) is the success fraction of the distinct trajectories visiting c; hbar, Lbar are visit means.
* Eq. 29 (``potential_form="eq29"``, ``delta = 0.2``): with the row milestone score m_t = sum_m w_m h_tm,
  pbar(c) = visit mean of the discounted (gamma) milestone return-to-go sum_l>=t gamma^(l-t) m_l, min-max
  normalised over the batch (0 if constant); r_rec(c) = fraction of visits after which the best milestone score
  improves, max_{l>t} m_l > max_{l<=t} m_l; r_loop(c) = visit mean of loop_flag. No further Norm (the group z-score
  of Eq. 17 removes any per-group affine map of Phi except through Eq. 16's smoothing).
* Eq. 16: ``lambda_cnt = 2`` (middle of the suggested 1-4); Phibar = mean of Phi over all regions of the batch.
* Eq. 17: terminal next potential ``terminal_potential="hold"`` (Phi~(c_T), so A^pot_T = (gamma-1) Phi~(c_T)) or
  ``"outcome"`` (1 on success, 0 otherwise). Normalisation: z-score over the step rows of the task group (unbiased
  std + eps); a group of one row gets 0.
* Eqs. 18-19: ``eps_route = 1e-6``, compared with the anchor group's unbiased std of G (the std GiGPO divides by).
* Eq. 20: ``alpha_kappa = 0.05``, ``kappa_min = 0.05`` (ALFWorld; WebShop uses 0.01). The batch success rate is the
  fraction of successful trajectories; the first batch initialises both sbar and s_0 (so kappa_1 = 1); sbar is
  updated with the current batch before kappa_k is taken. ``kappa=<float>`` fixes kappa (tests, ablations) while
  the state still advances.
* A^epi uses ``episode_stats="steps"`` by default, GiGPO's verl-agent default, so that kappa = 0 equals ``gigpo``
  with the same parameters; ``"trajectories"`` is the paper's Eq. 2.
* Numerics: the z-scores of Norm and Eq. 17 return 0 for a set whose spread is within rounding
  (max - min <= 1e-9 (1 + max|x|), ``segments.segment_standardise`` with ``flat="range"``), the value in exact
  arithmetic. Without this, Eq. 17 would blow rounding noise
  of a constant Phi (already divided by std + eps once) up to O(1e-3). GiGPO's own terms are computed by
  ``gigpo.step_advantage`` unchanged, so X4 holds bit for bit outside constant anchor groups (there GiGPO returns
  its rounding noise, about 1e-11, where MVPO routes to kappa A^pot = 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from ..estimator import Estimator, Extra, StatefulEstimator, make_params, param, params_dataclass
from ..segments import dense_ids, discounted_cumsum, segment_mean_std, segment_standardise, segment_sum
from ..steptable import StepTable
from .gigpo import step_advantage
from .grpo import EPISODE_STATS, episode_advantage

#: The formula the estimator computes, as ``agentcredit describe``, the docs page and the registry record
#: (``Estimator.formula``) show it.
FORMULA = """\
A^epi_i     = (R_i - mean_g R) / (std_g R + eps)                       Eq. 2 (GRPO w/std, as GiGPO's A^E)
A^anc_it    = (G_it - mean_s G) / (std_s G + eps),  G_t = sum_l>=t gamma^(l-t) r_l    Eqs. 3-5 (GiGPO A^S)
c_it        = region of (group, signature z_it): Union-Find of equal signatures + cycle rule    Eqs. 9, 28
u_m         = [E(Y | h_m=1) - E(Y | h_m=0)]_+ ,  w <- (1-beta_amp) w + beta_amp u / (sum u + eps)   Eqs. 12-13
Phi(c)      = Norm(sum_m w_m hbar_m(c) + alpha_s Sbar(c) - alpha_l Lbar(c))        Eq. 15 ("eq15")
            | pbar(c) + delta (r_rec(c) - r_loop(c))                              Eq. 29 ("eq29")
Phi~(c)     = eta Phi(c) + (1-eta) Phibar,  eta = |O(c)| / (|O(c)| + lambda_cnt)    Eq. 16
A^pot_it    = zscore_g(gamma Phi~(c_i,t+1) - Phi~(c_it))                        Eq. 17
A^route_it  = A^anc if n_s>1 and std_s G > eps_route;  kappa_k A^pot if n_s>1;  0 if n_s=1   Eqs. 18-19
kappa_k     = clip(1 - clip((sbar_k - s_0) / (1 - s_0 + eps), 0, 1), kappa_min, 1)         Eq. 20
A_it        = A^epi_i + step_weight * A^route_it                                Eq. 21
extras: signature [S] (required); milestones [S, M], loop_flag [S] (optional, 0/1)
"""

__all__ = ["MVPOParams", "MVPO", "MVPOTerms", "ESTIMATOR", "depth_bin", "kappa_schedule", "amp_utilities",
           "amp_update", "viability_regions", "mvpo_terms", "initial_state", "AMP_ZERO_SUM"]

POTENTIAL_FORMS = ("eq15", "eq29")
AMP_ZERO_SUM = ("eq13", "keep")
TERMINAL_POTENTIALS = ("hold", "outcome")
W0 = (0.2, 0.3, 0.5, 10.0, 0.0)  # App. A.3: ALFWorld / WebShop milestone weights
SPREAD_TOL = 1e-9  # relative spread below which a z-scored set is flat (module docstring, Numerics)


@params_dataclass
class MVPOParams:
    """Hyperparameters of MVPO (defaults: the paper's ALFWorld setting; [RECON] where the paper gives none)."""

    # extra_fields the verl bridge forwards as StepTable extras: required, and used when every row has them

    # ---- GiGPO part (kappa = 0 reproduces gigpo with these) ----
    step_weight: float = param(0.5, "Weight omega of the routed step term (0.5 ALFWorld/WebShop, 1.0 search-QA).")
    gamma: float = param(0.95, "Discount of the step return G_t and of the potential difference gamma Phi' - Phi.",
                         low=0.0, high=1.0)
    norm_std: bool = param(True, "Divide A^epi and A^anchor by their group std (MVPO uses the w/std setting).")
    eps: float = param(1e-6, "Added to every std before dividing, and to the sums of Eqs. 13 and 20.", low=0.0,
                       low_open=True, why="a zero-variance group would divide by zero")
    episode_stats: str = param("steps", "A^epi statistics over 'steps' (verl-agent/GiGPO default, kappa=0 equals "
                               "gigpo) or 'trajectories' (the paper's Eq. 2).", choices=EPISODE_STATS)
    similarity_thresh: float | None = param(
        None, "Anchor groups as gigpo's similarity_thresh: None exact states; p also merges states whose texts reach "
        "difflib's ratio p within a task group (needs state texts).", low=0.0, high=1.0,
        why="a difflib ratio lies in [0, 1]")
    # ---- routing and the kappa schedule ----
    eps_route: float = param(1e-6, "Anchor groups with std of G <= eps_route (zero-credit) get kappa * A^pot "
                             "instead of A^anchor [RECON].", low=0.0)
    kappa: float | None = param(None, "Fix kappa to this value in [0, 1] (tests, ablations); None follows Eq. 20. "
                                "The state advances either way.", low=0.0, high=1.0)
    kappa_min: float = param(0.05, "Floor of kappa (0.05 ALFWorld, 0.01 WebShop).", low=0.0, high=1.0)
    alpha_kappa: float = param(0.05, "EMA rate of the batch success rate sbar.", low=0.0, high=1.0, low_open=True)
    # ---- milestones (AMP) ----
    milestone_weights: tuple[float, ...] = param(W0, "Initial milestone weights w_0 (App. A.3); their number M "
                                                 "must equal the width of extras['milestones'].", low=0.0,
                                                 min_len=1, why="AMP utilities are clipped at 0")
    beta_amp: float = param(0.1, "EMA rate of the AMP milestone weights (Eq. 13) [RECON].", low=0.0, high=1.0,
                            low_open=True)
    amp_zero_sum: str = param("eq13", "Eq. 13 when no milestone has utility (sum u = 0, e.g. an all-fail batch): "
                              "'eq13' w <- (1 - beta_amp) w as written; 'keep' leaves w unchanged (recommended "
                              "for training, see amp_update).", choices=AMP_ZERO_SUM)
    # ---- potential ----
    potential_form: str = param("eq15", "'eq15': Norm(w.hbar + alpha_s Sbar - alpha_l Lbar); 'eq29': "
                                "pbar + delta (r_rec - r_loop) [DISCREPANCY in the paper].", choices=POTENTIAL_FORMS)
    alpha_s: float = param(1.0, "Weight of the region success rate Sbar in Eq. 15 [RECON].", low=0.0)
    alpha_l: float = param(1.0, "Weight of the region loop rate Lbar in Eq. 15 [RECON].", low=0.0)
    delta: float = param(0.2, "Weight of r_rec - r_loop in Eq. 29.", low=0.0)
    lambda_cnt: float = param(2.0, "Count smoothing prior of Eq. 16 (0 disables it) [RECON: 1-4 suggested].", low=0.0)
    terminal_potential: str = param("hold", "Next potential of the last step: 'hold' Phi~(c_T) or 'outcome' 1/0 by "
                                    "success [RECON].", choices=TERMINAL_POTENTIALS)

    def __post_init__(self):
        self.milestone_weights = tuple(float(w) for w in self.milestone_weights)  # a list from a config, as a tuple


# ---- small pure pieces ------------------------------------------------------------------------------------------
def depth_bin(t, width: int = 3):
    """App. A.3's depth component of a signature: ``width * floor(t / width)`` (ALFWorld/WebShop: width 3, so
    steps 0-2 -> 0, 3-5 -> 3, ...). Works on an int or an integer tensor/array."""
    if width < 1:
        raise ValueError(f"width={width}; the depth bin width must be >= 1")
    return (t // width) * width


def default_signature(state, t: int, width: int = 3) -> str:
    """A step's ``signature`` when the env has no coarser progress parser (App. A.3's fallback): the canonical state
    and the depth bin, ``"<state>|d<width * floor(t / width)>"``. The bridges' turn rollouts and agent loops use it
    when a run's estimator reads ``signature`` and the env supplies none."""
    return f"{state}|d{depth_bin(int(t), width)}"


def kappa_schedule(success_ema: float, success_init: float, kappa_min: float, eps: float) -> float:
    """Eq. 20: ``g = clip((sbar - s_0) / (1 - s_0 + eps), 0, 1)``, ``kappa = clip(1 - g, kappa_min, 1)``."""
    g = min(max((success_ema - success_init) / (1.0 - success_init + eps), 0.0), 1.0)
    return min(max(1.0 - g, kappa_min), 1.0)


def amp_utilities(milestones: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Eq. 12: ``u_m = [E(Y | h_m = 1) - E(Y | h_m = 0)]_+`` over the rows; 0 where h_m is constant.

    ``milestones`` [S, M] in {0, 1}, ``y`` [S] in {0, 1}. The means are ratios of exact integer counts, so the
    result does not depend on row order.
    """
    h = milestones.to(torch.float64)
    y = y.to(torch.float64)
    n1 = h.sum(0)
    k1 = torch.mv(h.t(), y)
    n0 = h.shape[0] - n1
    k0 = float(y.sum()) - k1
    out = []
    for a, b, c, d in zip(k1.tolist(), n1.tolist(), k0.tolist(), n0.tolist()):
        out.append(max(a / b - c / d, 0.0) if b > 0 and d > 0 else 0.0)
    return out


def amp_update(weights: list[float], utilities: list[float], beta_amp: float, eps: float,
               zero_sum: str = "eq13") -> list[float]:
    """Eq. 13: ``w <- (1 - beta) w + beta u / (sum u + eps)``.

    When ``sum u = 0`` (no milestone separates success from failure: an all-fail or all-success batch, or
    milestones constant over the batch) ``zero_sum`` decides: ``"eq13"`` applies Eq. 13 as written, which gives
    ``(1 - beta) w``; ``"keep"`` returns ``w`` unchanged.

    ``"eq13"`` is the default because it is what the paper writes. We recommend ``"keep"`` for training. A batch
    with ``sum u = 0`` carries no evidence about which milestone matters, but Eq. 13 treats it as evidence that
    none does. All-fail batches are MVPO's target regime (early training), so over a run of k of them w shrinks
    to ``(1 - beta)^k w`` (beta 0.1: 12% after 20 batches, 0.5% after 50). Under Eq. 15 the milestone term then
    fades against ``alpha_l Lbar`` (``Sbar`` is 0 in an all-fail group) exactly where milestones are the only
    progress signal. And after such a run the first batch with a contrast sets w to about ``beta u / sum u``, so
    the prior w_0 is lost to one batch's utilities. (Eq. 29's potential does not change under a common positive
    scale of w, so there only that last point applies.)
    """
    if zero_sum not in AMP_ZERO_SUM:
        raise ValueError(f"zero_sum={zero_sum!r}; choose one of {AMP_ZERO_SUM}")
    total = 0.0
    for u in utilities:
        total += u
    if total <= 0 and zero_sum == "keep":
        return list(weights)
    return [(1.0 - beta_amp) * w + beta_amp * u / (total + eps) for w, u in zip(weights, utilities)]


def viability_regions(group: torch.Tensor, traj: torch.Tensor, signature: torch.Tensor,
                      return_first_visit: bool = False):
    """Eqs. 9 and 28: dense region id per row and the number of regions.

    Rows must be sorted by ``(traj, t)`` (a StepTable's order); ``group`` and ``traj`` are dense ids. Regions start
    as the distinct ``(group, signature)``; for two consecutive visits of one region in one trajectory at rows
    p < q, the links p->p+1, ..., q-1->q join every region in between (the cycle rule). Each pass takes the
    connected components of those links; passes repeat, on every trajectory with a row in a region the pass
    merged, until one merges nothing: the closure (module docstring), so the result is idempotent
    (``viability_regions(group, traj, region)`` gives the same partition) and independent of row order and labels.
    With ``return_first_visit``, also the [S] bool mask of each trajectory's first row in each region.
    """
    _, sig_ids = torch.unique(signature, return_inverse=True)
    region, n_regions = dense_ids(group * (int(sig_ids.max()) + 1 if sig_ids.numel() else 1) + sig_ids)
    s = region.numel()
    n_traj = int(traj[-1]) + 1 if s else 0
    first_visit = torch.ones(s, dtype=torch.bool)
    rows = None  # the rows of the trajectories still to scan, in (traj, t) order; None = all
    while rows is None or rows.numel() > 1:
        reg, tr = (region, traj) if rows is None else (region[rows], traj[rows])
        key = tr * n_regions + reg
        sorted_key, by_key = torch.sort(key, stable=True)  # (traj, region, t) order within the scanned rows
        again = sorted_key[1:] == sorted_key[:-1]
        first, second = by_key[:-1][again], by_key[1:][again]
        if rows is None:
            first_visit[second] = False
        else:
            first_visit[rows] = True
            first_visit[rows[second]] = False
        m = key.numel()
        cover = torch.bincount(first, minlength=m + 1) - torch.bincount(second, minlength=m + 1)
        link = cover.cumsum(0)[: m - 1] > 0  # link[r]: scanned rows r and r+1 lie inside one revisit interval
        link &= reg[:-1] != reg[1:]  # (consecutive scanned rows of one trajectory are consecutive steps)
        if not bool(link.any()):
            break
        src, dst = reg[:-1][link].numpy(), reg[1:][link].numpy()
        graph = coo_matrix((np.ones(src.size, dtype=np.int8), (src, dst)), shape=(n_regions, n_regions)).tocsr()
        n_new, labels = connected_components(graph, directed=True, connection="weak")
        labels = torch.from_numpy(labels.astype(np.int64))
        merged = torch.bincount(labels, minlength=n_new)[labels] > 1  # [old region] it joined another one
        # a trajectory can re-enter a region only if one of its regions grew: rescan every such trajectory, not
        # only the scanned ones (a trajectory untouched so far can meet a region that grew in this pass)
        touched = torch.zeros(n_traj, dtype=torch.bool)
        touched[traj[merged[region]]] = True
        region = labels[region]
        n_regions = int(n_new)
        rows = touched[traj].nonzero().reshape(-1)
    if return_first_visit:
        return region, n_regions, first_visit
    return region, n_regions


def _segment_cummax_rank(rank: torch.Tensor, seg: torch.Tensor, n_ranks: int) -> torch.Tensor:
    """Running max of integer ``rank`` within runs of equal, non-decreasing ``seg`` (exact integer arithmetic)."""
    key = seg * n_ranks + rank
    return torch.cummax(key, 0).values - seg * n_ranks


# ---- the estimator ----------------------------------------------------------------------------------------------
@dataclass
class MVPOTerms:
    """Every intermediate of one MVPO batch, rows in the StepTable's sorted order (float64)."""

    advantage: torch.Tensor  # A = A^epi + omega A^route
    a_epi: torch.Tensor
    a_anchor: torch.Tensor
    a_pot_raw: torch.Tensor  # gamma Phi~(c') - Phi~(c), before the group z-score
    a_pot: torch.Tensor  # group z-scored
    a_route: torch.Tensor
    route_anchor: torch.Tensor  # bool: A^route = A^anchor
    route_potential: torch.Tensor  # bool: A^route = kappa A^pot
    region: torch.Tensor  # [S] dense region id
    n_regions: int
    phi: torch.Tensor  # [R] Phi(c)
    phi_smooth: torch.Tensor  # [R] Phi~(c)
    kappa: float
    weights: list[float] = field(default_factory=list)  # the milestone weights used (after this batch's update)
    success_rate: float = 0.0


def initial_state(p: MVPOParams) -> dict[str, Any]:
    """The state before the first batch: no success EMA yet, milestone weights w_0."""
    return {"batches": 0, "success_ema": None, "success_init": None, "milestone_weights": list(p.milestone_weights),
            "kappa": 1.0}


def _inputs(steps: StepTable, p: MVPOParams):
    """The signature, milestone columns [M, S] float64 (or None) and loop flags of ``steps``, validated."""
    steps.require("state", by="estimator 'mvpo'")
    sig = steps.extra("signature", None)
    if sig is None:
        raise ValueError("estimator 'mvpo' needs extras['signature']: one progress signature per step row "
                         "(e.g. 'kitchen|apple+knife|d6', App. A.3); pass StepTable(..., extras={'signature': ...})")
    if sig.ndim != 1 or sig.is_floating_point() or sig.dtype == torch.bool:
        raise ValueError(f"extras['signature'] must be one int or string key per row, got a {sig.dtype} tensor of "
                         f"shape {tuple(sig.shape)}")
    sig = sig.to(torch.int64)
    ms = steps.extra("milestones", None)
    if ms is not None:
        m = len(p.milestone_weights)
        if ms.ndim != 2 or ms.shape[1] != m:
            raise ValueError(f"extras['milestones'] has shape {tuple(ms.shape)} but milestone_weights has M={m} "
                             f"entries; give an [S, {m}] 0/1 block or milestone_weights of its width")
        if ms.dtype != torch.bool and bool(((ms != 0) & (ms != 1)).any()):
            raise ValueError("extras['milestones'] must hold 0/1 indicators h_tm")
        ms = ms.t().to(torch.float64).contiguous()  # one contiguous column per milestone
    loop = torch.zeros(steps.n_steps, dtype=torch.float64)
    lf = steps.extra("loop_flag", None)
    if lf is not None:
        if lf.ndim != 1:
            raise ValueError(f"extras['loop_flag'] must be one 0/1 flag per row, got shape {tuple(lf.shape)}")
        loop = lf.to(torch.float64)
        if bool(((loop != 0) & (loop != 1)).any()):
            raise ValueError("extras['loop_flag'] must hold 0/1 flags")
    return sig, ms, loop


def _potential_eq15(p, region, n_regions, region_group, n_groups, ms, weights, success_visit, loop, count):
    raw = torch.zeros(n_regions, dtype=torch.float64)
    if ms is not None:
        for m, w in enumerate(weights):  # fixed summation order: reproducible to the bit across implementations
            raw = raw + w * (segment_sum(ms[m], region, n_regions) / count)
    lbar = segment_sum(loop, region, n_regions) / count
    raw = raw + p.alpha_s * success_visit - p.alpha_l * lbar
    return segment_standardise(raw, region_group, n_groups, ddof=1, eps=p.eps, flat="range", flat_tol=SPREAD_TOL)


def _potential_eq29(p, steps, region, n_regions, ms, weights, loop, count):
    n = steps.n_steps
    score = torch.zeros(n, dtype=torch.float64)
    if ms is not None:
        for m, w in enumerate(weights):
            score = score + w * ms[m]
    togo = discounted_cumsum(score, steps.is_last, p.gamma)
    lo, hi = float(togo.min()), float(togo.max())
    togo_n = (togo - lo) / (hi - lo) if hi > lo else torch.zeros_like(togo)
    # r_rec: the best milestone score after t beats the best up to t (integer ranks keep the comparison exact)
    values, rank = torch.unique(score, return_inverse=True)
    u = values.numel()
    best_so_far = _segment_cummax_rank(rank, steps.row_traj, u)
    rev = torch.flip(rank, [0])
    rev_traj = (steps.n_traj - 1) - torch.flip(steps.row_traj, [0])
    best_from = torch.flip(_segment_cummax_rank(rev, rev_traj, u), [0])  # max over l >= t
    best_after = torch.full_like(best_from, -1)
    best_after[:-1] = best_from[1:]
    best_after[steps.is_last] = -1
    improves = (best_after > best_so_far).to(torch.float64)
    pbar = segment_sum(togo_n, region, n_regions) / count
    r_rec = segment_sum(improves, region, n_regions) / count
    r_loop = segment_sum(loop, region, n_regions) / count
    return pbar + p.delta * (r_rec - r_loop)


def mvpo_terms(steps: StepTable, p: MVPOParams, state: dict[str, Any]) -> tuple[MVPOTerms, dict[str, Any]]:
    """One MVPO batch: all terms (sorted row order) and the new state. Pure: ``state`` is not modified."""
    sig, ms, loop = _inputs(steps, p)
    weights = list(state["milestone_weights"])
    if len(weights) != len(p.milestone_weights):
        raise ValueError(f"the MVPO state has {len(weights)} milestone weights but milestone_weights has "
                         f"{len(p.milestone_weights)}; load a state saved with the same milestones")
    n, n_groups = steps.n_steps, steps.n_groups
    if n == 0:
        empty = torch.zeros(0, dtype=torch.float64)
        flag = torch.zeros(0, dtype=torch.bool)
        return MVPOTerms(empty, empty, empty, empty, empty, empty, flag, flag, torch.zeros(0, dtype=torch.int64), 0,
                         empty, empty, float(state["kappa"]), weights, 0.0), dict(state)
    success = steps.success.to(torch.float64)

    # step 11 state: batch success rate -> EMA -> kappa_k (the first batch sets s_0)
    rate = float(steps.traj_success.to(torch.float64).sum()) / steps.n_traj
    if state["success_ema"] is None:
        ema = init = rate
    else:
        ema = (1.0 - p.alpha_kappa) * state["success_ema"] + p.alpha_kappa * rate
        init = state["success_init"]
    kappa = kappa_schedule(ema, init, p.kappa_min, p.eps) if p.kappa is None else float(p.kappa)
    # step 5: AMP utilities and weights
    # (no milestones block = all-zero milestones: u = 0, and amp_zero_sum decides as for any zero-sum batch)
    utilities = amp_utilities(ms.t(), success) if ms is not None else [0.0] * len(weights)
    weights = amp_update(weights, utilities, p.beta_amp, p.eps, zero_sum=p.amp_zero_sum)

    # step 1: GiGPO terms
    a_epi = episode_advantage(steps, norm_std=p.norm_std, eps=p.eps, episode_stats=p.episode_stats)
    a_anchor = step_advantage(steps, gamma=p.gamma, norm_std=p.norm_std, eps=p.eps,
                              similarity_thresh=p.similarity_thresh)
    anchor, n_anchor = steps.anchor_at(p.similarity_thresh)
    _, anchor_std, anchor_n = segment_mean_std(steps.reward_to_go(p.gamma), anchor, n_anchor, ddof=1)

    # steps 3, 6: regions and their statistics
    region, n_regions, first_visit = viability_regions(steps.row_group, steps.row_traj, sig, return_first_visit=True)
    region_group = torch.zeros(n_regions, dtype=torch.int64).scatter_(0, region, steps.row_group)
    count = torch.bincount(region, minlength=n_regions).to(torch.float64)
    visitors = region[first_visit]  # one entry per distinct (region, trajectory)
    success_visit = (segment_sum(success[first_visit], visitors, n_regions)
                     / torch.bincount(visitors, minlength=n_regions).to(torch.float64))

    # steps 7-8: potential and count smoothing
    if p.potential_form == "eq15":
        phi = _potential_eq15(p, region, n_regions, region_group, n_groups, ms, weights, success_visit, loop, count)
    else:
        phi = _potential_eq29(p, steps, region, n_regions, ms, weights, loop, count)
    eta = count / (count + p.lambda_cnt)
    phi_smooth = eta * phi + (1.0 - eta) * phi.mean()

    # step 9: potential advantage, z-scored within the task group
    here = phi_smooth[region]
    nxt = torch.empty_like(here)
    nxt[:-1] = here[1:]
    terminal = here if p.terminal_potential == "hold" else success
    nxt = torch.where(steps.is_last, terminal, nxt)
    a_pot_raw = p.gamma * nxt - here
    a_pot = segment_standardise(a_pot_raw, steps.row_group, n_groups, ddof=1, eps=p.eps, flat="range",
                                flat_tol=SPREAD_TOL)

    # steps 10, 12: routing and the final combination
    multi = anchor_n[anchor] > 1
    route_anchor = multi & (anchor_std[anchor] > p.eps_route)
    route_potential = multi & ~route_anchor
    zero = torch.zeros(n, dtype=torch.float64)
    a_route = torch.where(route_anchor, a_anchor, torch.where(route_potential, kappa * a_pot, zero))
    advantage = a_epi + p.step_weight * a_route

    new_state = {"batches": state["batches"] + 1, "success_ema": ema, "success_init": init,
                 "milestone_weights": weights, "kappa": kappa}
    terms = MVPOTerms(advantage=advantage, a_epi=a_epi, a_anchor=a_anchor, a_pot_raw=a_pot_raw, a_pot=a_pot,
                      a_route=a_route, route_anchor=route_anchor, route_potential=route_potential, region=region,
                      n_regions=n_regions, phi=phi, phi_smooth=phi_smooth, kappa=kappa, weights=weights,
                      success_rate=rate)
    return terms, new_state


class MVPO(StatefulEstimator):
    """MVPO with its cross-batch state. ``est = MVPO(step_weight=0.5)`` (or ``get("mvpo").create(...)``), then
    ``adv = est(steps)`` once per training batch; ``est.state_dict()`` goes into the checkpoint.

    State (plain Python values): ``batches`` seen, ``success_ema`` (sbar), ``success_init`` (s_0),
    ``milestone_weights`` (w) and the last ``kappa``. After each call :attr:`stats` holds loggable scalars.
    """

    STATE_DOC = "the success EMA sbar and its initial value s_0 (kappa schedule, Eq. 20) and the AMP milestone weights w"
    STATE_SCHEMA = {"batches": (int, {"low": 0, "high": 2**63 - 1}),
                    "success_ema": (float | None, {"low": 0.0, "high": 1.0}),
                    "success_init": (float | None, {"low": 0.0, "high": 1.0}),
                    "milestone_weights": (list[float], {}), "kappa": (float, {"low": 0.0, "high": 1.0})}

    def __init__(self, params: MVPOParams | None = None, **values: Any):
        if params is not None and values:
            raise ValueError("MVPO: pass either an MVPOParams or keyword parameters, not both")
        self.params = params if params is not None else make_params(MVPOParams, values, owner="estimator 'mvpo'")
        self._state = initial_state(self.params)
        self.stats: dict[str, float] = {}

    def __call__(self, steps: StepTable) -> torch.Tensor:
        """Advantages ``[S]`` float32 in the rows' input order; advances the state by one batch."""
        with torch.no_grad():
            terms, new_state = mvpo_terms(steps, self.params, self._state)
        self._state = new_state
        self.stats = {
            "mvpo/kappa": terms.kappa, "mvpo/success_rate": terms.success_rate,
            "mvpo/success_ema": new_state["success_ema"], "mvpo/regions": float(terms.n_regions),
            "mvpo/route_anchor_frac": float(terms.route_anchor.to(torch.float64).mean()),
            "mvpo/route_potential_frac": float(terms.route_potential.to(torch.float64).mean()),
        }
        return steps.to_input_order(terms.advantage)  # float64; the locked wrapper checks it and casts to float32

    def state_dict(self) -> dict[str, Any]:
        s = self._state
        return {"batches": int(s["batches"]),
                "success_ema": None if s["success_ema"] is None else float(s["success_ema"]),
                "success_init": None if s["success_init"] is None else float(s["success_init"]),
                "milestone_weights": [float(w) for w in s["milestone_weights"]], "kappa": float(s["kappa"])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = self.check_state(state)  # keys, types, finiteness, ranges (STATE_SCHEMA)
        weights = [float(w) for w in state["milestone_weights"]]
        if any(w < 0 for w in weights):
            raise ValueError(f"MVPO.load_state_dict: milestone_weights={weights} has a negative weight; AMP weights "
                             f"stay >= 0 (T6.7)")
        if len(weights) != len(self.params.milestone_weights):
            raise ValueError(f"MVPO.load_state_dict: {len(weights)} milestone weights, but these params have "
                             f"M={len(self.params.milestone_weights)}")
        if (state["success_ema"] is None) != (state["success_init"] is None):
            raise ValueError("MVPO.load_state_dict: success_ema and success_init must both be set or both be None")
        self._state = {"batches": int(state["batches"]),
                       "success_ema": None if state["success_ema"] is None else float(state["success_ema"]),
                       "success_init": None if state["success_init"] is None else float(state["success_init"]),
                       "milestone_weights": weights, "kappa": float(state["kappa"])}

    def reset(self) -> None:
        """Back to the initial state (as after construction)."""
        self._state = initial_state(self.params)

    def __repr__(self) -> str:
        return f"MVPO(batches={self._state['batches']}, kappa={self._state['kappa']:.4g})"


def mvpo(steps: StepTable, p: MVPOParams) -> torch.Tensor:
    """One batch from the initial state (what a fresh :class:`MVPO` returns on its first call), sorted order."""
    return mvpo_terms(steps, p, initial_state(p))[0].advantage


ESTIMATOR = Estimator(
    name="mvpo",
    fn=mvpo,
    params=MVPOParams,
    paper="Zhou, Li 2026, Learning from Viable Failure Prefixes: Milestone Viability Potential Policy Optimization "
          "(arXiv:2609.37111)",
    formula=FORMULA,
    requires=("state",),
    extras=(Extra("signature", "env"), Extra("milestones", "env", required=False),
            Extra("loop_flag", "env", required=False)),
    stateful=MVPO,
    similarity="similarity_thresh",
)
