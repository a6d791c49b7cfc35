"""Straightforward per-row Python MVPO: the baseline of ``credit_speed.py`` and a test oracle for ``mvpo.py``.

Dicts, loops and a small union-find class, no tensors and no vectorisation; the same decisions as
``credit_plugins/estimators/mvpo.py`` (see its docstring), written independently from the spec (CREDIT.md §6).

``rows`` is a list of dicts, one per step, in any order:

    group       hashable   task group (verl uid)
    traj        hashable   rollout id
    t           int        0-based step index
    state       hashable   anchor key
    signature   hashable   progress signature z_t
    reward      float      step reward r_t
    milestones  list[int]  optional, 0/1 per milestone (length M = len(milestone_weights)); absent or None on
                           every row = no milestones
    loop_flag   int        optional, 0/1 (default 0)
    success     bool       optional; default: the trajectory's return > 0

``naive_mvpo(rows, state=None, **params) -> (advantages in row order, new_state)``; ``state`` is the dict of
``MVPO.state_dict()`` (None = the initial state). Parameters and defaults are those of ``MVPOParams``.
"""

from __future__ import annotations

import math
from collections import defaultdict

from benchmarks.naive_gigpo import naive_grpo

DEFAULTS = dict(step_weight=0.5, gamma=0.95, norm_std=True, eps=1e-6, episode_stats="steps", eps_route=1e-6,
                kappa=None, kappa_min=0.05, alpha_kappa=0.05, milestone_weights=(0.2, 0.3, 0.5, 10.0, 0.0),
                beta_amp=0.1, potential_form="eq15", alpha_s=1.0, alpha_l=1.0, delta=0.2, lambda_cnt=2.0,
                terminal_potential="hold")


class UnionFind:
    def __init__(self):
        self.parent = {}

    def add(self, x):
        self.parent.setdefault(x, x)

    def find(self, x):
        root = x
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[x] != root:
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, a, b):
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return False
        self.parent[rb] = ra
        return True


def _mean_std(xs):
    m = sum(xs) / len(xs)
    if len(xs) == 1:
        return m, 0.0
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _zscores(xs, eps):
    """z-scores of a list (unbiased std); all 0 for one element or a spread within rounding."""
    hi, lo = max(xs), min(xs)
    if hi - lo <= 1e-9 * (1.0 + max(abs(hi), abs(lo))):
        return [0.0] * len(xs)
    m, s = _mean_std(xs)
    return [(x - m) / (s + eps) for x in xs]


def naive_mvpo(rows, state=None, **params):
    p = dict(DEFAULTS)
    unknown = set(params) - set(p)
    if unknown:
        raise ValueError(f"unknown parameters {sorted(unknown)}")
    p.update(params)
    gamma, eps = p["gamma"], p["eps"]
    if state is None:
        state = {"batches": 0, "success_ema": None, "success_init": None,
                 "milestone_weights": list(p["milestone_weights"]), "kappa": 1.0}
    n = len(rows)
    if n == 0:
        return [], dict(state)

    # trajectories in t order, returns, success
    by_traj = defaultdict(list)
    for i, r in enumerate(rows):
        by_traj[r["traj"]].append(i)
    for members in by_traj.values():
        members.sort(key=lambda i: rows[i]["t"])
    ret = {tr: sum(rows[i]["reward"] for i in members) for tr, members in by_traj.items()}
    succ = {}
    for tr, members in by_traj.items():
        first = rows[members[0]]
        succ[tr] = bool(first["success"]) if "success" in first and first["success"] is not None else ret[tr] > 0
    has_ms = rows[0].get("milestones") is not None
    ms = [list(r["milestones"]) if has_ms else [] for r in rows]
    loop = [float(r.get("loop_flag", 0) or 0) for r in rows]
    y = [1.0 if succ[r["traj"]] else 0.0 for r in rows]

    # kappa schedule (Eq. 20)
    rate = sum(1 for tr in by_traj if succ[tr]) / len(by_traj)
    if state["success_ema"] is None:
        ema = init = rate
    else:
        ema = (1 - p["alpha_kappa"]) * state["success_ema"] + p["alpha_kappa"] * rate
        init = state["success_init"]
    if p["kappa"] is None:
        g = min(max((ema - init) / (1 - init + eps), 0.0), 1.0)
        kappa = min(max(1 - g, p["kappa_min"]), 1.0)
    else:
        kappa = float(p["kappa"])

    # AMP utilities and weights (Eqs. 12-13)
    w = list(state["milestone_weights"])
    if has_ms:
        util = []
        for m in range(len(w)):
            on = [y[i] for i in range(n) if ms[i][m] == 1]
            off = [y[i] for i in range(n) if ms[i][m] != 1]
            util.append(max(sum(on) / len(on) - sum(off) / len(off), 0.0) if on and off else 0.0)
        total = 0.0
        for u in util:
            total += u
        if total > 0:
            w = [(1 - p["beta_amp"]) * wm + p["beta_amp"] * u / (total + eps) for wm, u in zip(w, util)]

    # episode term and anchor term (GiGPO w/std)
    a_epi = naive_grpo(rows, norm_std=p["norm_std"], eps=eps, episode_stats=p["episode_stats"])
    togo = [0.0] * n
    for members in by_traj.values():
        running = 0.0
        for i in reversed(members):
            running = rows[i]["reward"] + gamma * running
            togo[i] = running
    anchors = defaultdict(list)
    for i, r in enumerate(rows):
        anchors[(r["group"], r["state"])].append(i)
    a_anchor, anchor_n, anchor_sd = [0.0] * n, [1] * n, [0.0] * n
    for members in anchors.values():
        m, s = _mean_std([togo[i] for i in members])
        for i in members:
            anchor_n[i], anchor_sd[i] = len(members), s
            if len(members) > 1:
                a_anchor[i] = (togo[i] - m) / (s + eps) if p["norm_std"] else togo[i] - m

    # viability regions: union-find over (group, signature) with the cycle rule, to its closure
    uf = UnionFind()
    for r in rows:
        uf.add((r["group"], r["signature"]))
    changed = True
    while changed:  # until no trajectory re-enters a region it left
        changed = False
        for members in by_traj.values():
            last_seen = {}
            for pos, i in enumerate(members):
                node = (rows[i]["group"], rows[i]["signature"])
                root = uf.find(node)
                if root in last_seen:
                    for j in members[last_seen[root]:pos + 1]:
                        changed |= uf.union(node, (rows[j]["group"], rows[j]["signature"]))
                last_seen[uf.find(node)] = pos
    region = [uf.find((r["group"], r["signature"])) for r in rows]
    visits = defaultdict(list)
    for i in range(n):
        visits[region[i]].append(i)
    regions = list(visits)

    # potential
    phi = {}
    if p["potential_form"] == "eq15":
        raw = {}
        for c in regions:
            rows_c = visits[c]
            value = 0.0
            if has_ms:
                for m, wm in enumerate(w):
                    value = value + wm * (sum(ms[i][m] for i in rows_c) / len(rows_c))
            trajs = {rows[i]["traj"] for i in rows_c}
            s_bar = sum(1 for tr in trajs if succ[tr]) / len(trajs)
            l_bar = sum(loop[i] for i in rows_c) / len(rows_c)
            raw[c] = value + p["alpha_s"] * s_bar - p["alpha_l"] * l_bar
        by_group = defaultdict(list)
        for c in regions:
            by_group[rows[visits[c][0]]["group"]].append(c)
        for cs in by_group.values():
            for c, z in zip(cs, _zscores([raw[c] for c in cs], eps)):
                phi[c] = z
    else:
        score = [0.0] * n
        if has_ms:
            for i in range(n):
                s = 0.0
                for m, wm in enumerate(w):
                    s = s + wm * ms[i][m]
                score[i] = s
        mtogo = [0.0] * n
        improves = [0.0] * n
        for members in by_traj.values():
            running = 0.0
            for i in reversed(members):
                running = score[i] + gamma * running
                mtogo[i] = running
            best_after = {}  # max score over the steps after i
            after = -math.inf
            for i in reversed(members):
                best_after[i] = after
                after = max(after, score[i])
            best = -math.inf
            for i in members:
                best = max(best, score[i])
                improves[i] = 1.0 if best_after[i] > best else 0.0
        lo, hi = min(mtogo), max(mtogo)
        norm = [(x - lo) / (hi - lo) if hi > lo else 0.0 for x in mtogo]
        for c in regions:
            rows_c = visits[c]
            k = len(rows_c)
            phi[c] = (sum(norm[i] for i in rows_c) / k
                      + p["delta"] * (sum(improves[i] for i in rows_c) / k - sum(loop[i] for i in rows_c) / k))
    phi_bar = sum(phi.values()) / len(phi)
    phi_s = {}
    for c in regions:
        eta = len(visits[c]) / (len(visits[c]) + p["lambda_cnt"])
        phi_s[c] = eta * phi[c] + (1 - eta) * phi_bar

    # potential advantage, z-scored per task group
    a_pot_raw = [0.0] * n
    for tr, members in by_traj.items():
        for pos, i in enumerate(members):
            if pos + 1 < len(members):
                nxt = phi_s[region[members[pos + 1]]]
            else:
                nxt = phi_s[region[i]] if p["terminal_potential"] == "hold" else (1.0 if succ[tr] else 0.0)
            a_pot_raw[i] = gamma * nxt - phi_s[region[i]]
    group_rows = defaultdict(list)
    for i, r in enumerate(rows):
        group_rows[r["group"]].append(i)
    a_pot = [0.0] * n
    for members in group_rows.values():
        for i, z in zip(members, _zscores([a_pot_raw[i] for i in members], eps)):
            a_pot[i] = z

    out = []
    for i in range(n):
        if anchor_n[i] == 1:
            route = 0.0
        elif anchor_sd[i] > p["eps_route"]:
            route = a_anchor[i]
        else:
            route = kappa * a_pot[i]
        out.append(a_epi[i] + p["step_weight"] * route)
    new_state = {"batches": state["batches"] + 1, "success_ema": ema, "success_init": init,
                 "milestone_weights": w, "kappa": kappa}
    return out, new_state
