"""Framework-free pieces of the search rollouts (``env_adapters.trl_search``, ``env_adapters.verl_search``).

* :func:`require_search_env`: refuse an env that cannot be branched (no ``snapshot``/``restore``/``legal_actions``).
* :class:`Node`: one turn of a search tree (its row, its parent, the env state before its action).
* :func:`fork_starts`: one expansion iteration of AT²PO / SIPO (``CREDIT.md`` §8.1-8.2): rank the candidates (every
  non-leaf node and the root) by the host score ``H - alpha * b`` (``criterion="host"``) or SIPO's scale-free
  ``(H - mean_C H) / std_C H - lam * b`` (``"sfc"``), where ``H`` is the node's surprisal and ``b`` its number of
  existing siblings; write the ranking on every candidate (``sel_rank``, ``sel_ncand``, ``selected`` for the top
  ``beam``); return ``branches`` fork starts per selected node. [R] The root, which no segment defines, has the mean
  surprisal of its children; a selected root starts a new chain from the reset state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Node", "require_search_env", "fork_starts"]


def require_search_env(env, who: str) -> None:
    """Refuse an env without ``snapshot``/``restore``/``legal_actions`` with a message that names what is missing."""
    missing = [m for m in ("snapshot", "restore", "legal_actions") if not callable(getattr(env, m, None))]
    if missing:
        raise ValueError(f"{who} branches from saved env states, but {type(env).__name__} has no "
                         f"{', '.join(missing)}(); use an env that has them (minigrid, sokoban) or a turn-level "
                         f"estimator with TurnRollout")




@dataclass
class Node:
    """One turn of a tree: the row's ids and fields, its parent, and the env state before its action."""

    id: int
    parent: int                # -1: child of the root (the reset state)
    depth: int
    prompt_ids: list[int]
    completion_ids: list[int]
    state: int
    action: int
    reward: float
    valid: bool
    surprisal: float
    fresh: bool
    snapshot: Any              # env state before this node's action
    path_return: float         # sum of rewards from the root through this node
    children: list[int] = field(default_factory=list)
    leaf: bool = False
    success: bool = False
    truncated: bool = False
    sel_rank: int = -1
    sel_ncand: int = 0
    selected: bool = False


def fork_starts(tree: list[Node], beam: int, branches: int, criterion: str, alpha: float,
                lam: float) -> list[tuple[int, Any, int, float, bool]]:
    """Rank the candidates of ``tree``, mark the ranking on them, and return the forks' starts
    ``(parent, snapshot, depth, path_return, fresh=True)`` (``snapshot`` None: from the reset state)."""
    from credit_plugins.estimators._tree import host_scores, select_top_k, sfc_scores

    cands = [-1] + [n.id for n in tree if not n.leaf]
    roots = [n for n in tree if n.parent == -1]
    root_h = sum(n.surprisal for n in roots) / max(len(roots), 1)
    ent = torch.tensor([root_h if c < 0 else tree[c].surprisal for c in cands], dtype=torch.float64)
    sib = torch.tensor([len(roots) - 1 if c < 0 else
                        (len(tree[tree[c].parent].children) if tree[c].parent >= 0 else len(roots)) - 1
                        for c in cands], dtype=torch.float64)
    scores = host_scores(ent, sib, alpha=alpha) if criterion == "host" else sfc_scores(ent, sib, lam=lam)
    picked, ranks = select_top_k(scores, beam)
    for c, r in zip(cands, ranks.tolist()):
        if c >= 0:
            tree[c].sel_rank, tree[c].sel_ncand, tree[c].selected = int(r), len(cands), False
    starts = []
    for k in picked.tolist():
        c = cands[k]
        if c >= 0:
            tree[c].selected = True
        for _ in range(branches):
            if c < 0:
                starts.append((-1, None, 0, 0.0, True))
            else:
                v = tree[c]
                ret = tree[v.parent].path_return if v.parent >= 0 else 0.0
                starts.append((v.parent, v.snapshot, v.depth, ret, True))
    return starts
