"""Vectorised segment reductions: the few primitives every estimator is built from.

All work on flat 1-D tensors with a dense segment index in ``[0, n)``; no Python loop runs per row.
Statistics are taken in float64.
"""

from __future__ import annotations

import math

import torch

__all__ = ["segment_sum", "segment_mean", "segment_mean_std", "segment_standardise", "group_normalise",
           "discounted_cumsum", "dense_ids", "FLAT_RULES"]

#: How :func:`segment_standardise` decides that a segment has no spread (its z-scores are then exactly 0).
FLAT_RULES = ("range", "std")


def segment_sum(values: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """``out[k] = sum(values[index == k])`` for k in ``[0, n)``, in float64."""
    return torch.bincount(index, weights=values.to(torch.float64), minlength=n).to(torch.float64)


def segment_mean(values: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """``out[k] = mean(values[index == k])`` in float64 (0 for empty segments)."""
    count = torch.bincount(index, minlength=n).to(torch.float64)
    return segment_sum(values, index, n) / count.clamp(min=1)


def _moments(values: torch.Tensor, index: torch.Tensor, n: int):
    """float64 ``(mean [n], deviation x - mean [S], sum of squared deviations [n], count [n])``, two-pass."""
    v = values.to(torch.float64)
    count = torch.bincount(index, minlength=n).to(torch.float64)
    mean = segment_sum(v, index, n) / count.clamp(min=1)
    dev = v - mean[index]
    return mean, dev, segment_sum(dev * dev, index, n), count


def segment_mean_std(values: torch.Tensor, index: torch.Tensor, n: int, ddof: int = 1):
    """Per-segment ``(mean, std, count)``; std uses ``ddof`` (1 = unbiased, as ``torch.std``).

    Segments with ``count <= ddof`` get std 0 (callers decide what a singleton means). Two-pass, so the
    variance is not the cancellation-prone ``E[x^2] - E[x]^2``.
    """
    mean, _, ss, count = _moments(values, index, n)
    return mean, (ss / (count - ddof).clamp(min=1)).sqrt(), count


def segment_standardise(values: torch.Tensor, index: torch.Tensor, n: int, *, ddof: int, eps: float = 0.0,
                        flat: str = "range", flat_tol: float = 0.0) -> torch.Tensor:
    """[S] float64 z-score ``(x - mean_k) / (std_k + eps)`` of each value within its segment; 0 on flat segments.

    ``ddof`` is explicit: 0 divides by the population std, 1 by the sample (unbiased) std. A flat segment has no
    spread, so exact arithmetic gives every member a centred value of 0; its z-score is returned as exactly 0
    rather than the rounding noise of the centring divided by a tiny std. Which segments are flat (``flat``):

    * ``"range"``: ``max - min <= flat_tol * (1 + max|x|)``.
    * ``"std"``: the population std (ddof 0, whatever ``ddof`` is) is ``< flat_tol``.

    A segment of one value, or of equal values, is flat under either rule and any ``flat_tol`` (the mean of equal
    values can differ from them by rounding, which would otherwise be divided by a rounding-size std). ``eps`` is
    added to the std of the other segments only.
    """
    if ddof not in (0, 1):
        raise ValueError(f"segment_standardise: ddof={ddof!r}; use 0 (population std) or 1 (sample std)")
    if flat not in FLAT_RULES:
        raise ValueError(f"segment_standardise: flat={flat!r}; choose one of {FLAT_RULES}")
    _, dev, ss, count = _moments(values, index, n)
    std = (ss / (count - ddof).clamp(min=1)).sqrt()
    v = values.to(torch.float64)
    hi = torch.full((n,), -math.inf, dtype=torch.float64).scatter_reduce_(0, index, v, "amax")
    lo = torch.full((n,), math.inf, dtype=torch.float64).scatter_reduce_(0, index, v, "amin")
    if flat == "range":
        is_flat = (hi - lo) <= flat_tol * (1.0 + torch.maximum(hi.abs(), lo.abs()))
    else:
        is_flat = ((ss / count.clamp(min=1)).sqrt() < flat_tol) | (hi == lo)
    is_flat = is_flat | (count < 2)
    z = dev / torch.where(is_flat, 1.0, std + eps)[index]
    return torch.where(is_flat[index], 0.0, z)


def group_normalise(values: torch.Tensor, index: torch.Tensor, n: int, *, norm_std: bool, eps: float,
                    singleton_mean_zero: bool) -> torch.Tensor:
    """``(x - mean_g) / (std_g + eps)`` (or ``x - mean_g`` without ``norm_std``) with unbiased std per group.

    A group of one sample has no spread. verl keeps two conventions for it, selected here:
    ``singleton_mean_zero=True`` uses ``mean=0, std=1`` (verl GRPO / GiGPO episode level: the sample keeps its raw
    value); ``False`` uses ``mean=x, std=1`` (GiGPO step level: the result is exactly 0).
    """
    v = values.to(torch.float64)
    mean, std, count = segment_mean_std(v, index, n)
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean) if singleton_mean_zero else mean
    std = torch.where(single, torch.ones_like(std), std)
    centred = v - mean[index]
    return centred / (std[index] + eps) if norm_std else centred


def discounted_cumsum(values: torch.Tensor, is_last: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reward-to-go ``R_t = sum_{k >= t} gamma^(k-t) r_k`` within each run of rows that ends at ``is_last``.

    Rows must be sorted by (trajectory, t). Solves the linear recurrence ``R_t = r_t + gamma * R_{t+1}`` with a
    doubling scan: ``R_i = a_i + b_i * R_{i+s}`` where ``b_i`` is 0 once the run has ended, so each of the
    ``ceil(log2(T_max))`` passes is one vectorised update over all rows.
    """
    a = values.to(torch.float64).clone()
    b = torch.full(a.shape, float(gamma), dtype=torch.float64).masked_fill_(is_last, 0.0)  # gamma exact in float64
    # invariant: b_i != 0 only while row i + shift is still in i's run, so the last `shift` rows need no update
    shift = 1
    while shift < a.numel() and bool(b.any()):
        a[:-shift] += b[:-shift] * a[shift:]
        b[:-shift] = b[:-shift] * b[shift:]
        shift *= 2
    return a


def dense_ids(*keys: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Dense ids in ``[0, n)`` of the distinct tuples ``(keys[0][i], keys[1][i], ...)`` and their count ``n``.

    Exact (no hash mixing): each key column is first made dense, then the columns are combined positionally.
    """
    combined = None
    for key in keys:
        _, ids = torch.unique(key, return_inverse=True)
        if combined is None:
            combined = ids
        else:
            combined = combined * (int(ids.max()) + 1 if ids.numel() else 1) + ids
            _, combined = torch.unique(combined, return_inverse=True)
    n = int(combined.max()) + 1 if combined.numel() else 0
    return combined, n
