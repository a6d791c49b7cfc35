"""Synthetic agent tasks with exact ground truth, as an ``AgentEnv`` and as batches for the credit estimators.

The tasks, their exact solver and the vectorised rollouts live in :mod:`env_adapters.synthetic_solver` (pure numpy;
families ``rooms``, ``keydoor``, ``lock``, ``allfail``). This module adds

* :class:`SyntheticAdapter`: a task as a text game (the registered env ``synthetic``): text observations with the
  admissible commands, ``legal_actions()``, ``snapshot()`` / ``restore()`` (so the counterfactual and tree rollouts
  branch from it), ``goal_rankings()`` (the legal actions' exact values under alternative goals of the same layout,
  :func:`~env_adapters.synthetic_solver.alt_goals`), the 10/0 reward convention plus the invalid-action penalty. The reset seed draws the task of the
  family (as MiniGrid's seed draws the room); :attr:`SyntheticAdapter.mdp` is the task being played, whose exact
  values :func:`~env_adapters.synthetic_solver.solve` gives.
* the batch builders the credit-quality benchmark feeds the estimators with, all from one tabular policy:
  :func:`flat_batch` (one StepTable row per step, groups of rollouts from the start, MVPO's env extras),
  :func:`counterfactual_extras` (ASCT's decision table: frozen-actor probabilities and the counterfactual values of
  every legal action from ``budget`` trials per decision) and :func:`tree_batch` (AT²PO / SIPO / TreeRL trees: chains
  from the start, then forks ranked by the host or SIPO criterion).

Every row carries its ``(t, s, a)``, so ``A*_t(s, a)`` of each row is one lookup in the solver's values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .base import GOAL_GAMMA, GoalRanking, StepResult, begin_step, check_snapshot, episode_seed
from .prompting import INVALID_PENALTY
from .synthetic_solver import FAMILIES, Rollouts, Task, alt_goals, goal_values, make_task, rollout

__all__ = ["SyntheticAdapter", "Batch", "flat_batch", "counterfactual_extras", "tree_batch", "MILESTONES",
           "FAMILIES"]

#: progress thresholds of MVPO's milestones (the best progress so far reaches each): 5 milestones, as App. A.3's M
MILESTONES = (0.15, 0.3, 0.45, 0.6, 0.75)

_TASK_TEXT = {
    "rooms": "Find the chest in the house and open it. Some rooms are dead ends; avoid trapdoors.",
    "keydoor": "Take the key and unlock the door that leads out of the house.",
    "lock": "Open the combination lock. A wrong button resets every digit entered so far.",
    "allfail": "Cross the bridge to the far side without falling into the pit.",
}


class SyntheticAdapter:
    """A synthetic task of one family as an ``AgentEnv`` (see the module docstring).

    Args:
        family: ``"rooms"``, ``"keydoor"``, ``"lock"`` or ``"allfail"``.
        seed: default seed of :meth:`reset` (the task drawn from the family); None: task seed 0.
        success_reward: reward of the step that enters the goal.
        invalid_penalty: reward of a step whose text is not one of the state's commands (the state does not change).
        task_seed: play this one task of the family on every reset (the reset seed then changes nothing: the tasks
            are deterministic, so episodes differ only by the policy's sampling), as the credit-quality benchmark
            trains one task; None: the reset seed draws the task.

    The step limit is the caller's (``horizon`` of the task, :attr:`horizon`, is what the solver assumes).
    """

    def __init__(self, family: str = "rooms", seed: int | None = None, success_reward: float = 10.0,
                 invalid_penalty: float = INVALID_PENALTY, task_seed: int | None = None):
        if family not in FAMILIES:
            raise ValueError(f"family={family!r}; choose one of {list(FAMILIES)}")
        if task_seed is not None and (isinstance(task_seed, bool) or not isinstance(task_seed, int) or task_seed < 0):
            raise ValueError(f"task_seed={task_seed!r}: give a whole number >= 0 (one task of the family for every "
                             f"episode) or null (the reset seed draws the task)")
        self.family, self.seed, self.task_seed = family, seed, task_seed
        self.success_reward, self.invalid_penalty = float(success_reward), float(invalid_penalty)
        first = task_seed if task_seed is not None else 0 if seed is None else int(episode_seed(seed, "synthetic"))
        self.mdp: Task = make_task(family, first)
        self.task = (f"You are an agent in a text game. {_TASK_TEXT[family]} Answer with exactly one of the "
                     f"admissible commands listed after each observation.")
        self._state = self.mdp.start
        self._done, self._solved = True, False

    @property
    def horizon(self) -> int:
        return self.mdp.horizon

    # ---- AgentEnv -------------------------------------------------------------------------------------------
    def reset(self, seed: int | None = None) -> str:
        seed = episode_seed(self.seed if seed is None else seed, "synthetic")
        if self.task_seed is not None:
            seed = self.task_seed
        self.mdp = make_task(self.family, 0 if seed is None else seed)
        self._state, self._done, self._solved = self.mdp.start, False, False
        return self.render()

    def step(self, action_text: str | None) -> StepResult:
        key, refused = begin_step(self, action_text)
        if refused is not None:
            return refused
        a = self.mdp.actions[self._state].index(key)
        self._state = int(self.mdp.next_state[self._state, a])
        self._solved = self._state == self.mdp.goal
        self._done = self._solved or self._state == self.mdp.trap
        reward = self.success_reward if self._solved else 0.0
        return StepResult(self.render(), reward, self._done, self._solved,
                          {"valid": True, "action_key": key, "state_id": self._state})

    def state_key(self) -> str:
        return self.mdp.observations[self._state]

    def action_key(self, action_text: str | None) -> str | None:
        if not isinstance(action_text, str):
            return None
        words = " ".join(action_text.strip().lower().split()).rstrip(".")
        return words if words in self.mdp.actions[self._state] else None

    def legal_actions(self) -> list[str]:
        return [] if self._done else list(self.mdp.actions[self._state])

    def snapshot(self) -> dict[str, Any]:
        return {"family": self.family, "task_seed": self.mdp.seed, "state": self._state, "done": self._done,
                "solved": self._solved}

    def restore(self, snap: dict[str, Any]) -> None:
        check_snapshot(snap, ("family", "task_seed", "state", "done", "solved"), "synthetic")
        if snap["family"] != self.family:
            raise ValueError(f"synthetic.restore(...): the snapshot is of family {snap['family']!r}, this env plays "
                             f"{self.family!r}")
        self.mdp = make_task(self.family, int(snap["task_seed"]))
        self._state, self._done, self._solved = int(snap["state"]), bool(snap["done"]), bool(snap["solved"])

    def goal_rankings(self, k: int, rng) -> list[GoalRanking]:
        """Up to ``k`` alternative goals at the current state (drawn without replacement by ``rng``, a
        ``random.Random``; :func:`~env_adapters.synthetic_solver.alt_goals`), each with the legal actions' exact
        ``Q*`` under it (:func:`~env_adapters.synthetic_solver.goal_values`, ``GOAL_GAMMA``); goals under which every
        action is worth the same are left out. The prompt changes in its task sentence only."""
        if k < 1:
            raise ValueError(f"goal_rankings(k={k}): ask for at least one alternative goal")
        if self._done:
            return []
        s, legal = self._state, self.legal_actions()
        out = []
        for goal in (goals := alt_goals(self.mdp, s)) and rng.sample(goals, len(goals)):
            q = goal_values(self.mdp, goal, GOAL_GAMMA)[s, :len(legal)]
            if q.max() == q.min():
                continue
            out.append(GoalRanking(goal.text, ((_TASK_TEXT[self.family], goal.text),), tuple(legal),
                                   tuple(float(v) for v in q)))
            if len(out) == k:
                break
        return out

    # ---- text -----------------------------------------------------------------------------------------------
    def render(self) -> str:
        obs = self.mdp.observations[self._state]
        if self._done:
            return obs
        return obs + "\nAdmissible commands: " + ", ".join(self.mdp.actions[self._state]) + "."

    @property
    def state_id(self) -> int:
        """The solver's id of the current state (the row index of the task's arrays)."""
        return self._state

    @property
    def solved(self) -> bool:
        return self._solved


# ---- batches for the estimators ------------------------------------------------------------------------------------
@dataclass
class Batch:
    """Rows an estimator scores, with what the ground truth needs.

    Attributes:
        columns: keyword arguments of ``StepTable(...)`` (rows in this order).
        t, s, a: [R] step index, state and action of each row (``A*_t(s, a)`` is the row's true advantage).
        env_steps: env steps the batch cost (actor steps, plus trials or forks where the layout needs them).
        rollouts: the actor's rollouts (flat batches) or None.
        success_rate: fraction of successful episodes (trajectories, or leaves of trees).
    """

    columns: dict[str, Any]
    t: np.ndarray
    s: np.ndarray
    a: np.ndarray
    env_steps: int
    rollouts: Rollouts | None
    success_rate: float

    def table(self, extras: dict[str, Any] | None = None):
        from credit_plugins import StepTable

        cols = dict(self.columns)
        if extras:
            cols["extras"] = {**cols.get("extras", {}), **extras}
        return StepTable(**cols)


def _cummax_by_traj(x: np.ndarray, traj: np.ndarray) -> np.ndarray:
    """Running max of ``x`` within each trajectory (rows sorted by (traj, t)); vectorised via a per-traj offset."""
    offset = traj.astype(np.float64) * 4.0  # x in [0, 1]: each trajectory's values sit above every earlier one's
    return np.maximum.accumulate(x + offset) - offset


def _revisit(traj: np.ndarray, state: np.ndarray, t: np.ndarray) -> np.ndarray:
    """[R] bool: the row's state was visited earlier in the same trajectory."""
    order = np.lexsort((t, state, traj))
    same = np.zeros(order.size, bool)
    same[1:] = (traj[order][1:] == traj[order][:-1]) & (state[order][1:] == state[order][:-1])
    out = np.zeros(order.size, bool)
    out[order] = same
    return out


def flat_batch(task: Task, pi: np.ndarray, rng: np.random.Generator, groups: int, group_size: int = 8) -> Batch:
    """``groups * group_size`` rollouts from the start as a flat StepTable batch (one row per step).

    Columns: ``group`` (rollouts ``g * group_size ...``), ``traj``, ``t``, ``state`` (state id), ``action`` (column
    index of the command), ``reward`` (1 on the step that enters the goal), ``success``, ``truncated``; extras for
    MVPO's env parsers: ``signature`` (progress bucket of the state and the depth bin ``3 * (t // 3)``),
    ``milestones`` [R, 5] (the best progress so far reaches each of :data:`MILESTONES`) and ``loop_flag`` (the state
    was visited before in the rollout).
    """
    ro = rollout(task, pi, rng, groups * group_size)
    traj_i, t_i = np.nonzero(ro.step)  # row-major: sorted by (traj, t)
    s = ro.states[traj_i, t_i]
    a = ro.actions[traj_i, t_i]
    last = t_i == ro.length[traj_i] - 1
    reward = (last & ro.success[traj_i]).astype(np.float32)
    prog = task.progress[s]
    best = _cummax_by_traj(prog, traj_i)
    milestones = (best[:, None] >= np.asarray(MILESTONES)[None, :]).astype(np.float32)
    signature = np.round(prog * 4).astype(np.int64) * 1000 + 3 * (t_i // 3)
    loop = _revisit(traj_i, s, t_i).astype(np.float32)
    cols = {"group": traj_i // group_size, "traj": traj_i, "t": t_i, "state": s, "action": a, "reward": reward,
            "success": ro.success[traj_i], "truncated": ro.truncated[traj_i],
            "extras": {"signature": signature, "milestones": milestones, "loop_flag": loop}}
    return Batch(cols, t_i, s, a, ro.env_steps, ro, float(ro.success.mean()))


def counterfactual_extras(task: Task, pi: np.ndarray, batch: Batch, rng: np.random.Generator, budget: int = 12,
                          lam: float = 0.1, cost_norm: float = 4096.0) -> tuple[dict[str, np.ndarray], int]:
    """ASCT's decision table for every row of a flat ``batch`` and the env steps its trials cost.

    Per decision ``(t, s)``: ``budget`` trials; trial j's root action is ``j mod |A(s)|`` (every legal action first,
    then the least visited: the evaluator's root coverage), continued with uniformly random legal actions (the
    ``uniform`` evaluator's rollouts) until the episode ends or the step limit H. ``q[a]`` = mean utility
    ``success - lam * length / cost_norm`` of the trials rooted at a (Eqs. 1-2). This is
    :class:`env_adapters.counterfactual.CounterfactualEvaluator` with ``kind="uniform"`` vectorised, except that
    trials below the root are independent uniform rollouts instead of one growing tree. Env steps: the trials'
    lengths, less the first step of each repeated root action (the prefix cache serves it).
    """
    n_act = task.n_actions[batch.s]
    if budget < int(n_act.max()):
        raise ValueError(f"budget={budget} < |A(s)| = {int(n_act.max())}: every legal action needs a trial")
    rows = batch.s.size
    j = np.arange(budget)
    root = j[None, :] % n_act[:, None]                                      # [R, B]
    uniform = np.where(task.legal, 1.0, 0.0) / np.maximum(task.n_actions, 1)[:, None]
    trials = rollout(task, uniform, rng, states=np.repeat(batch.s, budget), t0=np.repeat(batch.t, budget),
                     first_action=root.reshape(-1), record=False)
    util = (trials.success.astype(np.float64) - lam * trials.length / cost_norm).reshape(rows, budget)
    width = task.width
    onehot = root[:, :, None] == np.arange(width)[None, None, :]           # [R, B, A]
    visits = onehot.sum(1)
    q = np.where(visits > 0, (onehot * util[:, :, None]).sum(1) / np.maximum(visits, 1), 0.0)
    legal = task.legal[batch.s]
    extras = {"legal_p": np.where(legal, pi[batch.s], 0.0), "legal_mask": legal, "q": q,
              "chosen": batch.a.astype(np.int64), "visits": visits.astype(np.int64)}
    steps = trials.env_steps - int((budget - n_act).sum())
    return extras, steps


def tree_batch(task: Task, pi: np.ndarray, rng: np.random.Generator, trees: int, initial: int = 4,
               iterations: int = 1, beam: int = 2, branches: int = 2, criterion: str = "sfc", alpha: float = 0.05,
               lam: float = 0.05) -> Batch:
    """``trees`` search trees (AT²PO Alg. 1 / SIPO) as a tree node table: one row per node (one agent step).

    Each tree: ``initial`` chains from the start, then ``iterations`` expansions; each ranks the candidates (the
    tree's non-leaf nodes and its root) by ``H - alpha * b`` (``criterion="host"``) or SIPO's scale-free criterion
    (``"sfc"``), H the node's surprisal ``-log pi(a|s)`` (the root's 0), b its existing siblings, and forks
    ``branches`` new siblings of each of the top ``beam`` from the state before the node's action (a selected root
    starts a new chain) that run to the end: ``initial + iterations * beam * branches`` leaves (8 by default, a
    group of 8). The same ranking as :func:`env_adapters.search.fork_starts`, on arrays. Leaf reward: 1 on success.
    """
    import torch

    from credit_plugins.trees import host_scores, select_top_k, sfc_scores

    if criterion not in ("host", "sfc"):
        raise ValueError(f"criterion={criterion!r}; choose 'host' (AT²PO) or 'sfc' (SIPO)")
    logpi = np.log(np.where(pi > 0, pi, 1.0))
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("tree", "parent", "t", "s", "a", "leaf", "success",
                                                         "truncated", "fresh")}
    count = [0]

    def add(ro: Rollouts, tree_of: np.ndarray, parent_of: np.ndarray, fresh: bool) -> None:
        i, t = np.nonzero(ro.step)
        ids = count[0] + np.arange(i.size)
        first = t == ro.t0[i]
        prev = np.concatenate([[-1], ids[:-1]])
        cols["parent"].append(np.where(first, parent_of[i], prev))
        cols["tree"].append(tree_of[i])
        cols["t"].append(t)
        cols["s"].append(ro.states[i, t])
        cols["a"].append(ro.actions[i, t])
        last = t == ro.t0[i] + ro.length[i] - 1
        cols["leaf"].append(last)
        cols["success"].append(last & ro.success[i])
        cols["truncated"].append(last & ro.truncated[i])
        cols["fresh"].append(first & fresh)
        count[0] += i.size

    tree_of = np.repeat(np.arange(trees), initial)
    ro = rollout(task, pi, rng, trees * initial)
    add(ro, tree_of, np.full(tree_of.size, -1), False)
    env_steps = ro.env_steps
    sel_rank = np.zeros(0, np.int64)    # the latest ranking of every node so far (-1: never ranked)
    sel_ncand = np.zeros(0, np.int64)
    sel_now = np.zeros(0, bool)
    root = {k: np.zeros(trees, np.int64) for k in ("rank", "ncand")}
    root["rank"][:] = -1
    root_selected = np.zeros(trees, bool)

    def pad(x: np.ndarray, n: int, fill) -> np.ndarray:
        return np.concatenate([x, np.full(n - x.size, fill, x.dtype)])

    for _ in range(iterations):
        c = {k: np.concatenate(v) for k, v in cols.items()}
        n = c["t"].size
        ranks, ncand, selected = pad(sel_rank, n, -1), pad(sel_ncand, n, 0), np.zeros(n, bool)
        has_parent = c["parent"] >= 0
        n_children = np.bincount(c["parent"][has_parent], minlength=n)
        root_children = np.bincount(c["tree"][~has_parent], minlength=trees)
        siblings = np.where(has_parent, n_children[np.maximum(c["parent"], 0)], root_children[c["tree"]]) - 1
        surprisal = -logpi[c["s"], c["a"]]
        starts_s, starts_t, starts_p, starts_tree = [], [], [], []
        for k in range(trees):
            cand = np.flatnonzero((c["tree"] == k) & ~c["leaf"])
            ent = torch.tensor(np.concatenate([[0.0], surprisal[cand]]), dtype=torch.float64)
            sib = torch.tensor(np.concatenate([[root_children[k] - 1], siblings[cand]]), dtype=torch.float64)
            scores = host_scores(ent, sib, alpha=alpha) if criterion == "host" else sfc_scores(ent, sib, lam=lam,
                                                                                                 alpha=alpha)
            picked, rk = select_top_k(scores, beam)
            rk = rk.numpy()
            root["rank"][k], root["ncand"][k], root_selected[k] = rk[0], cand.size + 1, False
            ranks[cand], ncand[cand] = rk[1:], cand.size + 1
            for p in picked.tolist():
                if p == 0:
                    root_selected[k] = True
                    starts_s += [task.start] * branches
                    starts_t += [0] * branches
                    starts_p += [-1] * branches
                else:
                    node = cand[p - 1]
                    selected[node] = True
                    starts_s += [int(c["s"][node])] * branches
                    starts_t += [int(c["t"][node])] * branches
                    starts_p += [int(c["parent"][node])] * branches
                starts_tree += [k] * branches
        ro = rollout(task, pi, rng, states=np.asarray(starts_s), t0=np.asarray(starts_t))
        add(ro, np.asarray(starts_tree), np.asarray(starts_p), True)
        env_steps += ro.env_steps
        sel_rank, sel_ncand, sel_now = ranks, ncand, selected
    c = {k: np.concatenate(v) for k, v in cols.items()}
    n = c["t"].size
    extras = {
        "parent": c["parent"].astype(np.int64), "surprisal": -logpi[c["s"], c["a"]],
        "fresh": c["fresh"], "sel_rank": pad(sel_rank, n, -1), "sel_ncand": pad(sel_ncand, n, 0),
        "selected": pad(sel_now, n, False), "root_sel_rank": root["rank"][c["tree"]],
        "root_sel_ncand": root["ncand"][c["tree"]], "root_selected": root_selected[c["tree"]],
    }
    columns = {"group": c["tree"], "traj": np.arange(n), "t": np.zeros(n, np.int64), "state": c["s"],
               "action": c["a"], "reward": (c["leaf"] & c["success"]).astype(np.float32),
               "success": c["success"], "truncated": c["truncated"], "extras": extras}
    leaves = c["leaf"]
    return Batch(columns, c["t"], c["s"], c["a"], env_steps, None, float(c["success"][leaves].mean()))
