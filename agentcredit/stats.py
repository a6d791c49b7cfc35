"""The statistics of held-out evaluations and of comparisons over seeds: the Wilson interval of a success rate, the
paired before/after difference of two evaluations of the same seeds, the Student-t interval of a mean over seeds,
differences paired by seed, and steps to a success threshold with censoring. Pure Python (scipy for the t quantile,
no torch); the TRL evaluation (:func:`agentcredit.trl.episodes.evaluate`), ``agentcredit train``'s summary,
``agentcredit compare`` and the benchmarks use these, and only these, implementations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Z95", "wilson_interval", "PairedDifference", "paired_difference", "t_interval", "paired_by_seed",
           "steps_to_threshold", "censored_steps"]

#: the two-sided 95 % standard-normal quantile
Z95 = 1.959963984540054


def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of ``successes`` in ``n`` trials (fractions in [0, 1]); ``(0, 1)`` when ``n <= 0``. Its
    bound at a rate of 0 is exactly 0, at a rate of 1 exactly 1 (not a rounding error away)."""
    if n <= 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    lo = 0.0 if successes <= 0 else max(0.0, center - half)
    hi = 1.0 if successes >= n else min(1.0, center + half)
    return (lo, hi)


@dataclass(frozen=True)
class PairedDifference:
    """``after - before`` success on the same seeds (:func:`paired_difference`); rates are fractions."""

    n: int
    before_only: int          # seeds solved before and not after
    after_only: int           # seeds solved after and not before
    difference: float         # (after_only - before_only) / n
    ci: tuple[float, float]   # Newcombe's paired 95 % interval
    mcnemar_p: float          # exact two-sided McNemar p-value

    def format(self) -> str:
        lo, hi = self.ci
        return (f"after - before, paired by seed: {100 * self.difference:+.1f} points [{100 * lo:+.1f}, "
                f"{100 * hi:+.1f}] (95 %), {self.after_only} seeds gained, {self.before_only} lost, "
                f"exact McNemar p = {self.mcnemar_p:.2g}")


def paired_difference(before: Sequence[bool], after: Sequence[bool], z: float = Z95) -> PairedDifference:
    """Change in success rate between two evaluations of the same seeds, paired seed by seed.

    The interval is Newcombe's (1998) method 10: the Wilson intervals of the two marginal rates combined with the
    phi correlation of the 2x2 table (``phi = 0`` when a margin is empty). The p-value is the exact two-sided
    McNemar test: under no change the ``b + c`` discordant seeds split as Binomial(b + c, 1/2). Pairing removes the
    between-seed variance that two independent Wilson intervals carry, so it is the sharper test of one run's
    before/after. The caller pairs the same seeds in the same order; lists of different lengths are a
    ``ValueError``.
    """
    before, after = [bool(x) for x in before], [bool(x) for x in after]
    if len(before) != len(after):
        raise ValueError(f"paired_difference: before has {len(before)} episodes and after {len(after)}; pair the "
                         f"same seeds")
    n = len(before)
    if n == 0:
        raise ValueError("paired_difference: no episodes to pair")
    a = sum(x and y for x, y in zip(before, after))
    b = sum(x and not y for x, y in zip(before, after))
    c = sum(y and not x for x, y in zip(before, after))
    d = n - a - b - c
    p1, p2 = (a + b) / n, (a + c) / n
    l1, u1 = wilson_interval(a + b, n, z)
    l2, u2 = wilson_interval(a + c, n, z)
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    phi = (a * d - b * c) / math.sqrt(margins) if margins else 0.0
    diff = p2 - p1
    lower = diff - math.sqrt(max(0.0, (p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2))
    upper = diff + math.sqrt(max(0.0, (u2 - p2) ** 2 - 2 * phi * (u2 - p2) * (p1 - l1) + (p1 - l1) ** 2))
    k, m = min(b, c), b + c
    p_value = min(1.0, 2 * sum(math.comb(m, i) for i in range(k + 1)) / 2 ** m) if m else 1.0
    return PairedDifference(n=n, before_only=b, after_only=c, difference=diff,
                            ci=(max(-1.0, lower), min(1.0, upper)), mcnemar_p=p_value)


def t_interval(xs: Sequence[float], level: float = 0.95) -> tuple[float, float] | None:
    """Student-t interval of the mean of ``xs``: ``mean -+ t_{(1+level)/2, n-1} * sd / sqrt(n)`` (``sd`` with
    ``n - 1``); ``None`` for fewer than two values (no spread to estimate)."""
    xs = [float(x) for x in xs]
    n = len(xs)
    if n < 2:
        return None
    from scipy import stats

    m = sum(xs) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    h = float(stats.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    return (m - h, m + h)


def paired_by_seed(values: dict, baseline: dict) -> dict:
    """``values[s] - baseline[s]`` on the seeds both have (same seed: same training seeds and sampling, so the
    pairs share their seed's luck): ``seeds``, ``differences``, ``mean`` (``None`` without a common seed) and
    ``t95`` (:func:`t_interval` of the differences)."""
    seeds = sorted(set(values) & set(baseline))
    diffs = [float(values[s]) - float(baseline[s]) for s in seeds]
    return {"seeds": seeds, "differences": diffs, "mean": sum(diffs) / len(diffs) if diffs else None,
            "t95": t_interval(diffs)}


def steps_to_threshold(curve: Sequence[tuple[int, float]], threshold: float) -> int | None:
    """The first step whose value is ``>= threshold`` in ``curve`` (``(step, value)`` pairs, any order); ``None``
    when no step reaches it (the run is censored at its budget)."""
    hits = [int(step) for step, value in curve if value is not None and float(value) >= threshold]
    return min(hits) if hits else None


def censored_steps(values: Sequence[int | None], budget: int) -> dict:
    """Steps to a threshold over runs of ``budget`` steps, where ``None`` is a run that never reached it.

    ``reached`` / ``runs`` counts them; ``mean_reached`` and ``t95_reached`` are over the runs that reached it only
    (optimistic when some did not); ``restricted_mean`` and ``t95_restricted`` count a run that never reached it at
    the budget, ``min(T, budget)`` for every run (the restricted mean: a lower bound on the mean when any run is
    censored, exact when none is)."""
    if budget < 1:
        raise ValueError(f"censored_steps: budget must be >= 1 step, got {budget}")
    hit = [int(v) for v in values if v is not None]
    capped = [min(int(v), budget) if v is not None else budget for v in values]
    return {"runs": len(capped), "reached": len(hit), "budget": int(budget),
            "mean_reached": sum(hit) / len(hit) if hit else None, "t95_reached": t_interval(hit),
            "restricted_mean": sum(capped) / len(capped) if capped else None, "t95_restricted": t_interval(capped)}
