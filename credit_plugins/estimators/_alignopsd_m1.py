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

from ..hashing import GOLDEN64 as _GOLDEN, MASK64, mix64, signed64 as _signed  # noqa: F401
from ..steptable import StepTable

__all__ = ["TaskBlocks", "task_blocks", "unit_rows", "similarity_blocks", "eligibility_blocks", "select_block_sources",
           "content_key", "row_content", "mix64", "correspondence_chunks", "chunk_rows", "Correspondence",
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


# ---- content keys (tie-breaking that never looks at labels or row order) -------------------------------------------
TIE_SALT = 0x5EED_A11C  # salt of the source tie-break key (fixed, so select_sources does not depend on ``seed``)


KEY_BLOCK_ELEMS = 1 << 17  # entries per row block of content_key's hashing


def content_key(values: torch.Tensor, salt: int) -> torch.Tensor:
    """[S] int64 hash of each row of ``values`` [S, F] (float64 bit patterns, -0.0 read as 0.0):
    ``mix64(sum_j mix64(bits_j + (j + 1) golden + salt))`` with wrapping sums. A function of the row's values
    only, never of its position or labels."""
    v = values.to(torch.float64) + 0.0
    bits = v.contiguous().view(torch.int64)
    cols = (torch.arange(1, v.shape[1] + 1, dtype=torch.int64) * _signed(_GOLDEN)) + _signed(salt)
    n, step = bits.shape[0], max(1, KEY_BLOCK_ELEMS // max(bits.shape[1], 1))
    if n <= step:
        return mix64(mix64(bits + cols).sum(-1))
    sums = torch.empty(n, dtype=torch.int64)
    for i in range(0, n, step):  # row blocks that stay in cache; the wrapping sums are exact in any grouping
        torch.sum(mix64(bits[i:i + step] + cols), -1, out=sums[i:i + step])
    return mix64(sums)


def row_content(steps: StepTable, emb_teacher: torch.Tensor, emb_student: torch.Tensor) -> torch.Tensor:
    """[S, 2 + 2D] float64 content of each sorted row used for tie-breaking: turn index, reward, raw teacher and
    student thinking embeddings (what :func:`select_sources` can see)."""
    return torch.cat([steps.t.to(torch.float64)[:, None], steps.reward.to(torch.float64)[:, None],
                      emb_teacher.to(torch.float64), emb_student.to(torch.float64)], 1)


def similarity_blocks(blocks: TaskBlocks, teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """``H[g, target, source] = cos(E_teacher[source], E_student[target])`` within each task block (float64).

    Stored target-major (the transpose of the authors' ``H[source, target]``): a target's candidate sources are
    the last dimension. Materialises ``[G, M, M]``; the estimator uses :func:`correspondence_chunks` instead.
    """
    return blocks.gather(student) @ blocks.gather(teacher).transpose(1, 2)


def eligibility_blocks(blocks: TaskBlocks, teacher_ok: torch.Tensor, student_ok: torch.Tensor) -> torch.Tensor:
    """``B[g, target, source]``: same task, different rollout, both thinking texts non-empty."""
    t_ok = blocks.gather(teacher_ok, False)
    s_ok = blocks.gather(student_ok, False)
    other = blocks.rollout[:, :, None] != blocks.rollout[:, None, :]
    return other & s_ok[:, :, None] & t_ok[:, None, :]


def select_block_sources(h: torch.Tensor, b: torch.Tensor, blocks: TaskBlocks, tau: float, k: int,
                         key: torch.Tensor) -> torch.Tensor:
    """``[G, C, K]`` block positions of the chosen sources of targets ``h``/``b`` ``[G, C, M]`` (-1 = none).

    Candidates: ``B & H >= tau``; one best per source rollout; then the global top-K. Order and ties: descending
    H, then the source's content key ``key`` ``[G, M]`` (ascending; a hash of the row's data, never its label or
    position). Only rows of identical content (equal keys) fall back to the block position.
    O(C M) work, no sort over M.
    """
    g, c, m = h.shape
    r_n = max(blocks.n_rollouts, 1)
    big = torch.iinfo(torch.int64).max
    cand = b & (h >= tau)
    hk = torch.where(cand, h, -math.inf)
    roll = blocks.rollout.clamp(min=0)[:, None, :].expand(g, c, m)
    best = torch.full((g, c, r_n), -math.inf, dtype=torch.float64).scatter_reduce_(-1, roll, hk, "amax")
    at_best = cand & (hk == torch.gather(best, -1, roll))
    keys = key[:, None, :].expand(g, c, m)
    kmin = torch.full((g, c, r_n), big, dtype=torch.int64).scatter_reduce_(
        -1, roll, torch.where(at_best, keys, big), "amin")
    win = at_best & (keys == torch.gather(kmin, -1, roll))
    posn = torch.arange(m).expand(g, c, m)
    pos_r = torch.full((g, c, r_n), m, dtype=torch.int64).scatter_reduce_(-1, roll, torch.where(win, posn, m), "amin")
    # rank the rollouts' winners by (-H, key)
    o1 = torch.sort(kmin, dim=-1, stable=True).indices
    o2 = torch.sort(torch.gather(best, -1, o1), dim=-1, descending=True, stable=True).indices
    order = torch.gather(o1, -1, o2)
    best_s = torch.gather(best, -1, order)
    pos_s = torch.gather(pos_r, -1, order)
    chosen = torch.where(torch.isfinite(best_s), pos_s, -1)[..., :k]
    if chosen.shape[-1] < k:
        chosen = torch.cat([chosen, torch.full((g, c, k - chosen.shape[-1]), -1, dtype=torch.int64)], -1)
    return chosen


SPLIT_PIECES = 3  # fixed-point pieces per unit-vector component (3 x ~22 bits: below float64 rounding)


def split_bits(d: int) -> int:
    """Bits ``b`` per fixed-point piece for embedding dimension ``d``: a level of :func:`exact_similarity` sums at
    most ``SPLIT_PIECES * d`` products of two integers ``<= 2^b``, which stays below ``2^53`` (exact in float64)."""
    return int((53 - math.ceil(math.log2(max(SPLIT_PIECES * d, 1)))) // 2)


def split_pieces(unit: torch.Tensor) -> list[torch.Tensor]:
    """``unit`` (components in [-1, 1]) as ``SPLIT_PIECES`` fixed-point pieces ``x_i = X_i 2^(-i b)`` with integer
    ``|X_i| <= 2^b`` (``b = split_bits(D)``), ``x = sum_i x_i`` up to ``2^-(SPLIT_PIECES b + 1)`` per component.
    Every step is exact in float64 (scaling by powers of two, rounding to an integer, subtracting a coarser
    rounding of the same number)."""
    b = split_bits(unit.shape[-1])
    rest, out = unit.to(torch.float64), []
    for i in range(1, SPLIT_PIECES + 1):
        scale = float(2 ** (i * b))
        piece = torch.round(rest * scale) / scale
        out.append(piece)
        rest = rest - piece
    return out


def exact_similarity(stu: list[torch.Tensor], tea: list[torch.Tensor]) -> torch.Tensor:
    """``H[g, c, s] = sum_d stu[g, c, d] tea[g, s, d]`` from the fixed-point pieces of :func:`split_pieces`
    (``[G, C, D]`` and ``[G, M, D]`` each): for each level ``L = i + j`` (2 .. SPLIT_PIECES + 1) the products
    ``x_i y_j`` lie on the grid ``2^(-L b)`` and their sum over ``d`` and over the pairs of the level is an integer
    below ``2^53`` times that grid, so BLAS computes every level **exactly**, whatever its tiling or summation order;
    the levels are then added in a fixed order. Each entry is therefore a function of the two rows only, bit-equal
    whatever the chunk shape or the positions of the rows (a plain BLAS matmul rounds differently per tile, which
    would break exact ties), at the cost of ``SPLIT_PIECES (SPLIT_PIECES + 1) / 2`` matmuls. The dropped levels
    and the split's remainder bound the error by ``~2^-(SPLIT_PIECES b) sqrt(D)``, below float64 rounding."""
    h = None
    for level in range(2, SPLIT_PIECES + 2):
        acc = None
        for i in range(1, level):
            j = level - i
            if i > SPLIT_PIECES or j > SPLIT_PIECES:
                continue
            t = tea[j - 1].transpose(1, 2)
            acc = torch.bmm(stu[i - 1], t) if acc is None else torch.baddbmm(acc, stu[i - 1], t)
        h = acc if h is None else h.add_(acc)
    return h


def level_operands(stu: list[torch.Tensor], tea: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The pieces of :func:`split_pieces` stacked for :func:`exact_similarity_levels`: the student's along ``D``
    (``[G, C, SPLIT_PIECES D]``, pieces 1, 2, ...) and, per level ``L = 2 .. SPLIT_PIECES + 1``, the teacher's
    pieces ``L - 1, L - 2, ..., 1`` along ``D``, transposed (``[G, (L - 1) D, M]``), so that the student prefix of
    ``L - 1`` pieces times it is the sum over the level's pairs ``(i, L - i)``."""
    n = len(stu)
    levels = [(tea[0] if level == 2 else torch.cat([tea[level - 1 - i] for i in range(1, level)], -1)).transpose(1, 2)
              for level in range(2, n + 2)]
    return torch.cat(stu, -1), levels


def exact_similarity_levels(stu_cat: torch.Tensor, tea_levels: list[torch.Tensor]) -> torch.Tensor:
    """:func:`exact_similarity` from :func:`level_operands`, one matmul per level instead of one per pair. Each
    level's sum (over ``d`` and over its pairs) is exact whatever the summation order (the same integer products,
    below ``2^53``), and the levels are added in the same order, so the result is bit-equal to it."""
    d = stu_cat.shape[-1] // len(tea_levels)
    h = None
    for n_pairs, t in enumerate(tea_levels, start=1):
        acc = torch.bmm(stu_cat[..., :n_pairs * d], t)
        h = acc if h is None else h.add_(acc)
    return h


DEFAULT_CHUNK_ELEMENTS = 1 << 21  # target x source entries per chunk (a few tens of MB of temporaries)
BYTES_PER_ENTRY = 64  # rough peak bytes per [G, C, M] entry (H, B, profiles, logits, keys, indices, temporaries)
MAX_BLOCK_BYTES = 4 << 30  # refuse a single chunk estimated above this many bytes


@dataclass
class Correspondence:
    """Per-block outputs of the chunked M1 selection and M2 profile distances (block layout ``[G, M, ...]``)."""

    chosen: torch.Tensor  # [G, M, K] block positions of the sources (-1 none)
    sim: torch.Tensor  # [G, M, K] their H (0 where none)
    prof_valid: torch.Tensor  # [G, M] bool
    dist: torch.Tensor  # [G, M] profile distance to the previous turn of the same rollout
    dist_valid: torch.Tensor  # [G, M] bool


def chunk_rows(blocks: TaskBlocks, chunk_elements: int | None = None, max_bytes: int | None = None) -> int:
    """Target positions per chunk so that a ``[G, C, M]`` slab holds about ``chunk_elements`` entries (default
    :data:`DEFAULT_CHUNK_ELEMENTS`); raises a ValueError when even one target position per group cannot fit
    ``max_bytes`` (default :data:`MAX_BLOCK_BYTES`), before anything of that size is allocated."""
    chunk_elements = DEFAULT_CHUNK_ELEMENTS if chunk_elements is None else chunk_elements
    max_bytes = MAX_BLOCK_BYTES if max_bytes is None else max_bytes
    g, m = blocks.rows.shape
    per_row = max(g * m, 1)
    need = per_row * 2 * BYTES_PER_ENTRY  # one target position plus its predecessor
    if need > max_bytes:
        raise ValueError(f"alignopsd: the task blocks are {g} group(s) x {m} rows (largest task group: {m} turn rows); "
                         f"even one target row per group needs about {need / 2**30:.2f} GiB of similarity "
                         f"workspace (limit {max_bytes / 2**30:.2f} GiB). Use smaller task groups (fewer "
                         f"rollouts or turns per task), split the batch into fewer groups per call, or raise "
                         f"credit_plugins.estimators._alignopsd_m1.MAX_BLOCK_BYTES")
    return max(1, min(m, chunk_elements // per_row, max_bytes // (per_row * BYTES_PER_ENTRY) - 1))


BUCKETS_PER_OCTAVE = 4  # groups whose sizes agree within 2^(1/4) share one padded block width


def size_buckets(blocks: TaskBlocks) -> list[tuple[torch.Tensor, int]]:
    """The task groups bucketed by size: ``(group indices, block width)`` per bucket, widest first. Groups of
    similar size are padded to their bucket's widest member instead of the batch's largest group, so the
    ``[G, C, M]`` work is ``~sum_g M_g^2`` rather than ``G max_g M_g^2``."""
    sizes = blocks.present.sum(1)
    level = torch.ceil(torch.log2(sizes.clamp(min=1).to(torch.float64)) * BUCKETS_PER_OCTAVE).to(torch.int64)
    out = []
    for lv in torch.unique(level).flip(0).tolist():
        idx = (level == lv).nonzero().squeeze(1)
        out.append((idx, int(sizes[idx].max())))
    return out


def correspondence_chunks(blocks: TaskBlocks, teacher: torch.Tensor, t_ok: torch.Tensor, student: torch.Tensor,
                          s_ok: torch.Tensor, key: torch.Tensor, tau: float, k: int, t_prof: float, distance: str,
                          n_rows: int, chunk: int | None = None) -> Correspondence:
    """Source selection (M1), profiles and adjacent distances (M2) over chunks of target positions.

    The groups are processed in :func:`size_buckets` (each bucket a narrower block); in each, every chunk builds
    ``H``/``B`` for ``C`` target positions (plus the previous position, for the adjacent distance) against every
    source of the block: peak memory ``O(G C M)``, never ``[G, M, M]``. The results depend neither on the chunk
    size nor on the bucketing (every group's computation is its own; the similarities are exact).
    """
    g, m = blocks.rows.shape
    chosen = torch.full((g, m, k), -1, dtype=torch.int64)
    sim = torch.zeros(g, m, k, dtype=torch.float64)
    prof_valid = torch.zeros(g, m, dtype=torch.bool)
    dist = torch.zeros(g, m, dtype=torch.float64)
    dvalid = torch.zeros(g, m, dtype=torch.bool)
    if g == 0 or m == 0:
        return Correspondence(chosen, sim, prof_valid, dist, dvalid)
    chunk_rows(blocks)  # the memory guard names the largest group before any bucket is allocated
    for idx, width in size_buckets(blocks):
        rollout = blocks.rollout[idx, :width]
        sub = TaskBlocks(rows=blocks.rows[idx, :width], present=blocks.present[idx, :width], pos=blocks.pos,
                         rollout=rollout, n_rollouts=int(rollout.max()) + 1)
        c = _correspondence_block(sub, teacher, t_ok, student, s_ok, key, tau, k, t_prof, distance, n_rows, chunk)
        chosen[idx, :width], sim[idx, :width], prof_valid[idx, :width] = c.chosen, c.sim, c.prof_valid
        dist[idx, :width], dvalid[idx, :width] = c.dist, c.dist_valid
    return Correspondence(chosen, sim, prof_valid, dist, dvalid)


def _correspondence_block(blocks: TaskBlocks, teacher: torch.Tensor, t_ok: torch.Tensor, student: torch.Tensor,
                          s_ok: torch.Tensor, key: torch.Tensor, tau: float, k: int, t_prof: float, distance: str,
                          n_rows: int, chunk: int | None = None) -> Correspondence:
    """:func:`correspondence_chunks` on one block (one size bucket)."""
    from ._alignopsd_m2 import (  # m2 imports TaskBlocks from here
        profile_distance,
        profiles,
        safe_log,
    )

    g, m = blocks.rows.shape
    chunk = chunk or chunk_rows(blocks)
    stu_cat, tea_levels = level_operands(split_pieces(blocks.gather(student)), split_pieces(blocks.gather(teacher)))
    tok, sok = blocks.gather(t_ok, False), blocks.gather(s_ok, False)
    key_b = blocks.gather(key, 0)
    chosen = torch.full((g, m, k), -1, dtype=torch.int64)
    sim = torch.zeros(g, m, k, dtype=torch.float64)
    prof_valid = torch.zeros(g, m, dtype=torch.bool)
    dist = torch.zeros(g, m, dtype=torch.float64)
    dvalid = torch.zeros(g, m, dtype=torch.bool)
    for c0 in range(0, m, chunk):
        c1 = min(m, c0 + chunk)
        lo = max(c0 - 1, 0)  # one position of overlap: the predecessor of the chunk's first target
        h = exact_similarity_levels(stu_cat[:, lo:c1], tea_levels)  # [G, C', M]
        b = (blocks.rollout[:, lo:c1, None] != blocks.rollout[:, None, :]) & sok[:, lo:c1, None] & tok[:, None, :]
        off = c0 - lo
        ch = select_block_sources(h[:, off:], b[:, off:], blocks, tau, k, key_b)
        chosen[:, c0:c1] = ch
        sim[:, c0:c1] = torch.where(ch >= 0, torch.gather(h[:, off:], -1, ch.clamp(min=0)), 0.0)
        prof, pv = profiles(h, b, tau, t_prof)
        prof_valid[:, c0:c1] = pv[:, off:]
        if c1 - lo > 1:
            same = blocks.present[:, lo + 1:c1] & (blocks.rollout[:, lo + 1:c1] == blocks.rollout[:, lo:c1 - 1])
            ok = same & pv[:, 1:] & pv[:, :-1] & (b[:, 1:] == b[:, :-1]).all(-1)
            logs = safe_log(prof) if distance == "jsd" else None
            d = (profile_distance(prof[:, :-1], prof[:, 1:], distance, n_rows, logs[:, :-1], logs[:, 1:]) if logs is
                 not None else profile_distance(prof[:, :-1], prof[:, 1:], distance, n_rows))
            dist[:, lo + 1:c1] = torch.where(ok, d, 0.0)
            dvalid[:, lo + 1:c1] = ok
    return Correspondence(chosen, sim, prof_valid, dist, dvalid)


def sources_per_row(steps: StepTable, blocks: TaskBlocks, corr: Correspondence) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sorted row: ``src`` [S, K] sorted-row indices of its sources (-1 none) and their ``sim`` [S, K] H
    (0 where none)."""
    pos = blocks.per_row(corr.chosen, steps.row_group)  # [S, K]
    has = pos >= 0
    src = torch.where(has, blocks.rows[steps.row_group[:, None], pos.clamp(min=0)], -1)
    return src, blocks.per_row(corr.sim, steps.row_group)


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
