"""Straightforward per-row Python GRPO and GiGPO: the baseline of ``credit_speed.py`` and a test oracle.

Written the way verl-agent's ``core_gigpo.py`` reads (dicts keyed by uid / anchor, loops over rows), with no
vectorisation. ``rows`` is a list of dicts with keys ``group, traj, t, state, reward`` (any hashable keys).
Results are in row order.
"""

from __future__ import annotations

import math
from collections import defaultdict


def _mean_std(xs):
    m = sum(xs) / len(xs)
    if len(xs) == 1:
        return m, 0.0
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def naive_grpo(rows, norm_std=True, eps=1e-6, episode_stats="trajectories"):
    ret = defaultdict(float)
    group_of = {}
    for r in rows:
        ret[r["traj"]] += r["reward"]
        group_of[r["traj"]] = r["group"]
    samples = defaultdict(list)
    if episode_stats == "trajectories":
        for traj, g in group_of.items():
            samples[g].append(ret[traj])
    else:
        for r in rows:
            samples[r["group"]].append(ret[r["traj"]])
    stats = {}
    for g, xs in samples.items():
        stats[g] = (0.0, 1.0) if len(xs) == 1 else _mean_std(xs)
    out = []
    for r in rows:
        m, s = stats[r["group"]]
        x = ret[r["traj"]] - m
        out.append(x / (s + eps) if norm_std else x)
    return out


def naive_gigpo(rows, gamma=0.95, step_weight=1.0, norm_std=True, eps=1e-6, episode_stats="steps"):
    episode = naive_grpo(rows, norm_std=norm_std, eps=eps, episode_stats=episode_stats)
    by_traj = defaultdict(list)
    for i, r in enumerate(rows):
        by_traj[r["traj"]].append((r["t"], i))
    togo = [0.0] * len(rows)
    for steps in by_traj.values():
        running = 0.0
        for _, i in sorted(steps, reverse=True):
            running = rows[i]["reward"] + gamma * running
            togo[i] = running
    anchors = defaultdict(list)
    for i, r in enumerate(rows):
        anchors[(r["group"], r["state"])].append(i)
    step = [0.0] * len(rows)
    for members in anchors.values():
        if len(members) == 1:
            continue
        m, s = _mean_std([togo[i] for i in members])
        for i in members:
            x = togo[i] - m
            step[i] = x / (s + eps) if norm_std else x
    return [e + step_weight * a for e, a in zip(episode, step)]
