"""Straightforward per-row / per-group reference implementations of GraphHCA and CRBC.

Plain Python dicts and loops, numpy only for one small dense linear solve per task group (and to read rewards as
float32, the StepTable's dtype, so that equal returns are equal in both). They follow the spec
(``CREDIT.md`` §4, §5) and the conventions documented in ``credit_plugins/estimators/graphhca.py`` and ``crbc.py``
line by line, without sharing any code with them: the benchmark uses them as the per-row baseline, and the tests
use them as an independent cross-check of the vectorised estimators on random batches.

Row format: a list of dicts, one per environment step, in any order, with keys

    group      hashable   task group (verl ``uid``)
    traj       hashable   rollout id, unique in the batch
    t          int        0-based step index; every trajectory has t = 0, 1, ..., T_i - 1
    state      hashable   anchor key of the state the action was taken in (compared only within a group)
    action     hashable   semantic action key (CRBC only; -1 / None = invalid or unknown, pooled as one action)
    reward     float      step reward r_t, read as float32 like StepTable (A^T / A^G use R_i = sum_t r_t)
    success    bool       terminal success of the rollout (same on all its rows); default: R_i > 0
    truncated  bool       the rollout hit the step limit (a failure for the graph); default False

Both functions return a list of floats, one per row, in the order of ``rows``.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["naive_graphhca", "naive_crbc"]

Z_PLUS = ("<z+>",)     # boundary sentinels; real states are never these tuples
Z_MINUS = ("<z->",)
FLAT_TOL = 1e-9        # GraphHCA: a population std of the raw credit over B_s below this counts as zero
EPS = 1e-6             # verl's epsilon in the GRPO term


# ---- shared helpers --------------------------------------------------------------------------------------------
def _episodes(rows):
    """{group: [trajectory, ...]}; a trajectory is a list of row indices sorted by t, with its return and flags."""
    trajs = {}
    for i, r in enumerate(rows):
        trajs.setdefault(r["traj"], []).append(i)
    groups = {}
    for key, idx in trajs.items():
        idx.sort(key=lambda i: rows[i]["t"])
        ret = sum(float(np.float32(rows[i]["reward"])) for i in idx)   # rewards are float32, as in StepTable
        first = rows[idx[0]]
        success = bool(first["success"]) if "success" in first else ret > 0
        truncated = bool(first.get("truncated", False))
        groups.setdefault(first["group"], []).append({"rows": idx, "return": ret, "won": success and not truncated})
    return groups


def _transitions(rows, traj):
    """[(row index, state, successor)] of one trajectory; the last successor is z+ or z-."""
    out = []
    idx = traj["rows"]
    for k, i in enumerate(idx):
        if k + 1 < len(idx):
            x = rows[idx[k + 1]]["state"]
        else:
            x = Z_PLUS if traj["won"] else Z_MINUS
        out.append((i, rows[i]["state"], x))
    return out


def _mean(xs):
    return sum(xs) / len(xs)


def _std(xs, ddof):
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - ddof))


def _discounted_values(succ_counts, discount):
    """Solve V(s) = discount * sum_x n(s->x)/n(s) V(x), V(z+) = 1, V(z-) = 0 with one dense solve."""
    states = list(succ_counts)
    pos = {s: k for k, s in enumerate(states)}
    n = len(states)
    a = np.eye(n)
    b = np.zeros(n)
    for s, succ in succ_counts.items():
        total = sum(succ.values())
        for x, c in succ.items():
            w = discount * c / total
            if x is Z_PLUS:
                b[pos[s]] += w
            elif x is not Z_MINUS:
                a[pos[s], pos[x]] -= w
    v = np.linalg.solve(a, b) if n else np.zeros(0)
    out = {s: float(v[pos[s]]) for s in states}
    out[Z_PLUS], out[Z_MINUS] = 1.0, 0.0
    return out


# ---- GraphHCA ----------------------------------------------------------------------------------------------------
def _power_mean_values(succ_counts, gamma, omega, tol=1e-15, max_iter=200_000):
    """Phi(s) = gamma * (sum_x w(s->x) Phi(x)^omega)^(1/omega) by plain iteration from 0 (omega = inf: max)."""
    phi = {s: 0.0 for s in succ_counts}
    phi[Z_PLUS], phi[Z_MINUS] = 1.0, 0.0
    for _ in range(max_iter):
        new = dict(phi)
        for s, succ in succ_counts.items():
            if math.isinf(omega):
                new[s] = gamma * max(phi[x] for x in succ)
            else:
                total = sum(succ.values())
                new[s] = gamma * sum(c / total * phi[x] ** omega for x, c in succ.items()) ** (1.0 / omega)
        change = max((abs(new[s] - phi[s]) for s in succ_counts), default=0.0)
        phi = new
        if change < tol:
            return phi
    raise RuntimeError("power-mean iteration did not converge")


def _graphhca_trajectory_term(trajs):
    rets = [tr["return"] for tr in trajs]
    if len(rets) < 2 or max(rets) == min(rets):
        return [0.0] * len(rets)
    m, sd = _mean(rets), _std(rets, 1)
    return [(r - m) / (sd + EPS) for r in rets]


def naive_graphhca(rows, gamma=0.95, floor=0.01, step_weight=1.0, omega=1.0, step_std="population"):
    """GraphHCA advantages (spec §4) per row, in row order. See the module docstring for ``rows``."""
    ddof = 0 if step_std == "population" else 1
    out = [0.0] * len(rows)
    for trajs in _episodes(rows).values():
        # pooled graph: transition occurrence counts n(s -> x)
        trans = [tr for traj in trajs for tr in _transitions(rows, traj)]
        succ_counts = {}
        for _, s, x in trans:
            succ_counts.setdefault(s, {})
            succ_counts[s][x] = succ_counts[s].get(x, 0) + 1
        if omega == 1.0:
            phi = _discounted_values(succ_counts, gamma)
        else:
            phi = _power_mean_values(succ_counts, gamma, omega)
        psi = {s: math.log(max(v, floor)) for s, v in phi.items()}
        # raw credit, then standardise over B_s
        credit = {i: psi[x] - psi[s] for i, s, x in trans}
        by_state = {}
        for i, s, _ in trans:
            by_state.setdefault(s, []).append(i)
        step = {}
        for s, idx in by_state.items():
            vals = [credit[i] for i in idx]
            if len(vals) < 2 or _std(vals, 0) < FLAT_TOL:
                for i in idx:
                    step[i] = 0.0
                continue
            m, sd = _mean(vals), _std(vals, ddof)
            for i in idx:
                step[i] = (credit[i] - m) / sd
        a_traj = _graphhca_trajectory_term(trajs)
        for traj, at in zip(trajs, a_traj):
            for i in traj["rows"]:
                out[i] = at + step_weight * step[i]
    return out


# ---- CRBC --------------------------------------------------------------------------------------------------------
def _grpo_verl(trajs):
    rets = [tr["return"] for tr in trajs]
    if len(rets) == 1:
        return [rets[0] / (1.0 + EPS)]
    m, sd = _mean(rets), _std(rets, 1)
    return [(r - m) / (sd + EPS) for r in rets]


def _action(row):
    a = row.get("action", -1)
    return -1 if a is None else a


def naive_crbc(rows, beta=0.98, traj_weight=1.0, step_weight=5.0, sigma_min=0.1, depth=None):
    """CRBC advantages (spec §5) per row, in row order. See the module docstring for ``rows``."""
    out = [0.0] * len(rows)
    for trajs in _episodes(rows).values():
        # occurrences (row, s, a, x) and counts
        occ = []
        for traj in trajs:
            T = len(traj["rows"])
            for k, (i, s, x) in enumerate(_transitions(rows, traj)):
                g = beta ** (T - k) * (1.0 if traj["won"] else 0.0)   # G_{i,t} = beta^(T_i - t) R_i
                occ.append((i, s, _action(rows[i]), x, g))
        succ_counts, sa_succ, visits_s, visits_sa = {}, {}, {}, {}
        for i, s, a, x, g in occ:
            succ_counts.setdefault(s, {})
            succ_counts[s][x] = succ_counts[s].get(x, 0) + 1
            sa_succ.setdefault((s, a), {})
            sa_succ[(s, a)][x] = sa_succ[(s, a)].get(x, 0) + 1
            visits_s.setdefault(s, []).append(g)
            visits_sa.setdefault((s, a), []).append(g)

        def bellman_q(v):
            q = {}
            for sa, succ in sa_succ.items():
                total = sum(succ.values())
                q[sa] = beta * sum(c / total * v[x] for x, c in succ.items())
            return q

        actions = {}                                   # s -> {a: N(s, a)}
        for (s, a), succ in sa_succ.items():
            actions.setdefault(s, {})[a] = sum(succ.values())

        def bellman_v(v):
            q = bellman_q(v)
            new = {}
            for s, acts in actions.items():
                n_s = sum(acts.values())
                new[s] = sum(c / n_s * q[(s, a)] for a, c in acts.items())   # sum_a mu(a|s) (B v)(s, a)
            new[Z_PLUS], new[Z_MINUS] = 1.0, 0.0
            return new

        if depth is None:
            v = _discounted_values(succ_counts, beta)
            q = bellman_q(v)
        elif depth == 0:
            v = {s: _mean(gs) for s, gs in visits_s.items()}
            q = {sa: _mean(gs) for sa, gs in visits_sa.items()}
        else:
            v = {s: _mean(gs) for s, gs in visits_s.items()}
            v[Z_PLUS], v[Z_MINUS] = 1.0, 0.0
            for _ in range(depth - 1):
                v = bellman_v(v)
            q = bellman_q(v)            # Q^(K) = B V^(K-1)
            v = bellman_v(v)            # V^(K) = T V^(K-1)

        # advantage per (s, a), mu-weighted std per s, gate on distinct actions
        step = {}
        for s, acts in actions.items():
            n_s = sum(acts.values())
            adv = {a: q[(s, a)] - v[s] for a in acts}
            sigma = math.sqrt(sum(c / n_s * adv[a] ** 2 for a, c in acts.items()))
            for a in acts:
                step[(s, a)] = adv[a] / max(sigma, sigma_min) if len(acts) >= 2 else 0.0
        a_traj = _grpo_verl(trajs)
        for traj, ag in zip(trajs, a_traj):
            for i in traj["rows"]:
                out[i] = traj_weight * ag + step_weight * step[(rows[i]["state"], _action(rows[i]))]
    return out
