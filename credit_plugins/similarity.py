"""Similarity-based anchor grouping: GiGPO's optional clustering of near-identical anchor observations.

verl-agent's ``build_step_group(enable_similarity=True)`` clusters the anchor observations of each task group
greedily: an observation joins the first cluster whose leader it matches,
``difflib.SequenceMatcher(None, obs, leader).ratio() >= similarity_thresh``, else it leads a new cluster.

Here the measure and the greedy rule are the same, with one deliberate deviation: the result does not depend on
the order of the rows. verl-agent visits the rows in batch order, so its clusters change when the batch is
shuffled; here the *distinct* texts of a group are visited in sorted (code-point) order, so a group's clusters
depend only on the set of its texts. Identical texts are always one anchor.

Cost, per task group with D distinct texts of length about L: at most D(D-1)/2 comparisons, each first bounded by
difflib's ``real_quick_ratio`` (O(1)) and ``quick_ratio`` (O(L)), exact upper bounds of ``ratio``, which runs only
when both reach the threshold (O(L^2) worst case, near O(L) on typical text). A group of more than
:data:`MAX_DISTINCT` distinct texts is a ``ValueError``, before any comparison.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from difflib import SequenceMatcher
from typing import Any

import numpy as np

from .hashing import stable_hash

__all__ = ["MAX_DISTINCT", "check_threshold", "cluster_leaders", "similar_anchor_keys"]

#: most distinct texts one task group may hold for similarity clustering (about 8e6 comparisons at the bound)
MAX_DISTINCT = 4096

THRESHOLD_HELP = ("similarity_thresh: None (or 1) groups exactly equal states; a value in [0, 1) also merges states "
                  "whose texts reach this difflib ratio (verl-agent uses 0.9-0.95)")


def check_threshold(threshold: Any, name: str = "similarity_thresh") -> float | None:
    """``threshold`` as a float in [0, 1], or None (exact anchors); anything else is a ``ValueError``."""
    if threshold is None:
        return None
    if not isinstance(threshold, numbers.Real) or isinstance(threshold, bool) or \
            not math.isfinite(float(threshold)) or not 0.0 <= float(threshold) <= 1.0:
        raise ValueError(f"{name}={threshold!r}: give a number in [0, 1] or None ({THRESHOLD_HELP})")
    return float(threshold)


def cluster_leaders(texts: Iterable[str], threshold: float | None) -> dict[str, str]:
    """``{text: leader}`` for the distinct ``texts`` of one task group: visited in sorted order, each text joins
    the first leader ``L`` (in that order) with ``SequenceMatcher(None, text, L).ratio() >= threshold``, else it is
    a leader itself. ``threshold`` None or 1: every text is its own leader; 0: the first text leads them all."""
    threshold = check_threshold(threshold)
    texts = list(texts)
    bad = next((t for t in texts if not isinstance(t, str)), None)
    if bad is not None:
        raise ValueError(f"similarity clustering compares state texts, got {bad!r:.80} ({type(bad).__name__}); "
                         f"pass the states as strings")
    distinct = sorted(set(texts))
    if len(distinct) > MAX_DISTINCT:
        raise ValueError(f"similarity clustering: a task group holds {len(distinct)} distinct state texts, more than "
                         f"{MAX_DISTINCT} (up to {len(distinct) * (len(distinct) - 1) // 2} comparisons); use exact "
                         f"anchors (similarity_thresh=None), a more canonical state key or smaller groups")
    if threshold is None or threshold >= 1.0:
        return {t: t for t in distinct}
    if threshold <= 0.0 or len(distinct) < 2:
        return dict.fromkeys(distinct, distinct[0]) if distinct else {}
    leaders: list[SequenceMatcher] = []  # b = the leader's text: difflib caches its index across comparisons
    out: dict[str, str] = {}
    for text in distinct:
        for m in leaders:
            m.set_seq1(text)
            if m.real_quick_ratio() >= threshold and m.quick_ratio() >= threshold and m.ratio() >= threshold:
                out[text] = m.b
                break
        else:
            leaders.append(SequenceMatcher(None, text, text))
            out[text] = text
    return out


def similar_anchor_keys(texts: Sequence[str], groups: Sequence[Any] | np.ndarray,
                        threshold: float | None) -> np.ndarray:
    """``[n]`` int64 anchor key of each row: the stable hash of its cluster leader's text, clusters formed within
    each task group (:func:`cluster_leaders`); rows of different groups are never compared. ``threshold`` None or 1
    gives ``stable_hash(text)``, the exact-match keys."""
    threshold = check_threshold(threshold)
    texts, groups = list(texts), list(groups.tolist() if isinstance(groups, np.ndarray) else groups)
    if len(texts) != len(groups):
        raise ValueError(f"similar_anchor_keys: {len(texts)} texts but {len(groups)} groups; give one group per text")
    members: dict[Any, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    leader_of = {g: cluster_leaders((texts[i] for i in rows), threshold) for g, rows in members.items()}
    hashed: dict[str, int] = {}
    out = np.empty(len(texts), dtype=np.int64)
    for i, (text, g) in enumerate(zip(texts, groups)):
        lead = leader_of[g][text]
        key = hashed.get(lead)
        if key is None:
            key = hashed[lead] = stable_hash(lead)
        out[i] = key
    return out
