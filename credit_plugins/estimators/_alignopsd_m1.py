"""AlignOPSD mechanism 1 (decision-aligned supervision rectification): the vectorised pieces.

Follows ``verl/trainer/ppo/thinking_correspondence.py`` of ``mingju-c/Align-OPSD`` (``build_structural_mask``,
``select_sparse_sources``, ``combine_cross_teacher_scores``); see :mod:`credit_plugins.estimators.alignopsd` for the
formulas and the decisions. Everything here works on the table's sorted rows (by ``(traj, t)``) and, for the
source x target matrices, on :class:`TaskBlocks`: one padded square block per task group, so no loop runs over rows,
targets or trajectories.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..steptable import StepTable

__all__ = ["TaskBlocks", "task_blocks", "unit_rows", "similarity_blocks", "eligibility_blocks", "select_block_sources",
           "sources_per_row", "source_weights", "confidence", "aggregate_cross", "rectify"]

AGGREGATIONS = ("probability_mixture", "log_mean")


@dataclass(frozen=True)
class TaskBlocks:
    """The rows of each task group laid out as one padded block.

    ``rows[g, p]`` is the sorted-row index at position ``p`` of group ``g`` (-1 past the group's end); inside a
    group the rows keep the table's ``(traj, t)`` order, so a rollout's turns are consecutive positions.
    ``pos[r]`` is row ``r``'s position in its block, ``rollout[g, p]`` the rollout's index inside its group (-1 on
    padding).
    """

    rows: torch.Tensor  # [G, M] int64
    present: torch.Tensor  # [G, M] bool
    pos: torch.Tensor  # [S] int64
    rollout: torch.Tensor  # [G, M] int64
    n_rollouts: int  # most rollouts in one group

    def gather(self, values: torch.Tensor, fill: float | bool = 0) -> torch.Tensor:
        """``[G, M, ...]`` block view of a per-row tensor ``values`` ``[S, ...]``; ``fill`` on padding."""
        out = values[self.rows.clamp(min=0)]
        pad = ~self.present
        return out.masked_fill(pad.reshape(pad.shape + (1,) * (values.ndim - 1)), fill)

    def per_row(self, block: torch.Tensor, row_group: torch.Tensor) -> torch.Tensor:
        """``[S, ...]`` per-row view of a block tensor ``[G, M, ...]`` (inverse of :meth:`gather`)."""
        return block[row_group, self.pos]


def task_blocks(steps: StepTable) -> TaskBlocks:
    n, g = steps.n_steps, steps.row_group
    count = torch.bincount(g, minlength=steps.n_groups)
    width = int(count.max()) if n else 0
    perm = torch.sort(g, stable=True).indices  # grouped by task, (traj, t) order kept inside a group
    start = torch.cumsum(count, 0) - count
    pos = torch.empty(n, dtype=torch.int64)
    pos[perm] = torch.arange(n) - start[g[perm]]
    rows = torch.full((steps.n_groups, width), -1, dtype=torch.int64)
    rows[g, pos] = torch.arange(n)
    # rank of each trajectory inside its group (trajectory ids are sorted, like the rows)
    tg = steps.traj_group
    tperm = torch.sort(tg, stable=True).indices
    tcount = torch.bincount(tg, minlength=steps.n_groups)
    tstart = torch.cumsum(tcount, 0) - tcount
    trank = torch.empty(steps.n_traj, dtype=torch.int64)
    trank[tperm] = torch.arange(steps.n_traj) - tstart[tg[tperm]]
    present = rows >= 0
    rollout = torch.where(present, trank[steps.row_traj][rows.clamp(min=0)], -1)
    return TaskBlocks(rows=rows, present=present, pos=pos, rollout=rollout,
                      n_rollouts=int(tcount.max()) if n else 0)


def unit_rows(emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """L2-normalised float64 rows and the mask of non-empty ones (an all-zero row means "thinking empty")."""
    e = emb.to(torch.float64)
    norm = e.norm(dim=-1)
    nonzero = norm > 0
    return e / torch.where(nonzero, norm, 1.0)[:, None], nonzero


def similarity_blocks(blocks: TaskBlocks, teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """``H[g, target, source] = cos(E_teacher[source], E_student[target])`` within each task block (float64).

    Stored target-major (the transpose of the authors' ``H[source, target]``): a target's candidate sources are
    the last dimension.
    """
    return blocks.gather(student) @ blocks.gather(teacher).transpose(1, 2)


def eligibility_blocks(blocks: TaskBlocks, teacher_ok: torch.Tensor, student_ok: torch.Tensor) -> torch.Tensor:
    """``B[g, target, source]``: same task, different rollout, both thinking texts non-empty."""
    t_ok = blocks.gather(teacher_ok, False)
    s_ok = blocks.gather(student_ok, False)
    other = blocks.rollout[:, :, None] != blocks.rollout[:, None, :]
    return other & s_ok[:, :, None] & t_ok[:, None, :]


def select_block_sources(h: torch.Tensor, b: torch.Tensor, blocks: TaskBlocks, tau: float, k: int) -> torch.Tensor:
    """``[G, M, K]`` block positions of the chosen sources of every target (-1 = none).

    Candidates: ``B & H >= tau``; one best per source rollout; then the global top-K. Order and ties: descending H,
    then the source's position (its ``(traj, t)`` order), as the authors' sort by ``(-H, identity)``.
    """
    g, m, _ = h.shape
    cand = b & (h >= tau)
    key = torch.where(cand, h, -math.inf)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices  # ties keep the position order
    cand_s = torch.gather(cand, -1, order)
    rollout_s = torch.gather(blocks.rollout[:, None, :].expand(g, m, m), -1, order).clamp(min=0)
    rank = torch.arange(m).expand(g, m, m)
    first = torch.full((g, m, max(blocks.n_rollouts, 1)), m, dtype=torch.int64)
    first.scatter_reduce_(-1, rollout_s, torch.where(cand_s, rank, m), "amin")
    keep = cand_s & (torch.gather(first, -1, rollout_s) == rank)  # the best candidate of each source rollout
    kept_rank = torch.cumsum(keep.to(torch.int64), -1) - 1
    slot = torch.where(keep & (kept_rank < k), kept_rank, k)
    chosen = torch.full((g, m, k + 1), -1, dtype=torch.int64)
    chosen.scatter_(-1, slot, torch.where(slot < k, order, -1))  # slot k collects the rest and is dropped
    return chosen[..., :k]


def sources_per_row(steps: StepTable, blocks: TaskBlocks, chosen: torch.Tensor,
                    h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sorted row: ``src`` [S, K] sorted-row indices of its sources (-1 none) and their ``sim`` [S, K] H
    (0 where none)."""
    pos = blocks.per_row(chosen, steps.row_group)  # [S, K]
    has = pos >= 0
    src = torch.where(has, blocks.rows[steps.row_group[:, None], pos.clamp(min=0)], -1)
    h_row = blocks.per_row(h, steps.row_group)  # [S, M]
    sim = torch.where(has, torch.gather(h_row, 1, pos.clamp(min=0)), 0.0)
    return src, sim


def source_weights(sim: torch.Tensor, has: torch.Tensor, t_agg: float) -> torch.Tensor:
    """``omega = softmax_s(H[s, t] / T_agg)`` over a row's chosen sources; 0 on empty slots and source-less rows."""
    logits = torch.where(has, sim / t_agg, -math.inf)
    top = logits.max(dim=-1, keepdim=True).values
    e = torch.where(has, torch.exp(logits - torch.where(torch.isfinite(top), top, 0.0)), 0.0)
    total = e.sum(-1, keepdim=True)
    return e / torch.where(total > 0, total, 1.0)


def confidence(sim: torch.Tensor, omega: torch.Tensor, tau: float) -> torch.Tensor:
    """``rho_t = sum_s omega_s clip((H[s, t] - tau) / (1 - tau), 0, 1)`` (0 without sources)."""
    return (omega * ((sim - tau) / (1.0 - tau)).clamp(0.0, 1.0)).sum(-1)


def aggregate_cross(logp_cross: torch.Tensor, omega: torch.Tensor, has: torch.Tensor, lp_diag: torch.Tensor,
                    mode: str) -> torch.Tensor:
    """``l^cross_t`` [S, L]: ``log sum_s omega_s exp(l_s)`` (probability_mixture) or ``sum_s omega_s l_s``
    (log_mean); the diagonal score on rows without a source (the authors' default)."""
    any_src = has.any(-1)
    if mode == "probability_mixture":
        log_w = torch.where(has, torch.log(torch.where(has, omega, 1.0)), -math.inf)  # [S, K]
        terms = torch.where(has[:, :, None], log_w[:, :, None] + logp_cross, -math.inf)
        cross = torch.logsumexp(terms, dim=1)
    else:
        cross = (torch.where(has[:, :, None], omega[:, :, None] * logp_cross, 0.0)).sum(1)
    return torch.where(any_src[:, None], cross, lp_diag)


def rectify(lp_diag: torch.Tensor, lp_cross_agg: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """``l^rect_t = (1 - alpha_t) l^diag_t + alpha_t l^cross_t``."""
    a = alpha[:, None]
    return (1.0 - a) * lp_diag + a * lp_cross_agg
