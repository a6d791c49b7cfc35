"""Synthetic agent tasks with exact ground truth: four seeded task families, a tabular softmax policy, backward
induction for ``V_t(s)`` / ``Q_t(s, a)`` / ``A*_t(s, a)``, the exact policy gradient, and vectorised rollouts.

Design: ``docs/benchmarks/credit-quality.md``. Pure numpy; the env adapter (``env_adapters.synthetic``) plays the same tasks as text,
and the credit-quality benchmark (``benchmarks/credit_quality.py``) scores estimators against ``A*`` here.

A :class:`Task` is a finite deterministic MDP: states ``0 .. S-1`` (two of them absorbing: :attr:`Task.goal`, success,
and :attr:`Task.trap`, failure), ``n_actions[s]`` actions at state s (columns ``>= n_actions[s]`` of the ``[S, A]``
arrays are padding), ``next_state[s, a]``; "invalid" actions (look around, wait, a key where there is no key) are
legal self-loops that only cost a step. An episode starts at :attr:`Task.start`; it ends in success when it enters
the goal, in failure when it enters the trap or after ``horizon`` = H actions (the step limit, as ALFWorld's). The
reward is 1 on the step that enters the goal, 0 otherwise.

Ground truth under a policy ``pi(a|s)`` (backward induction, ``t = H-1 .. 0``; the step limit makes values depend
on ``t``)::

    V_H(s)      = 0
    Q_t(s, a)   = 1                       if s' = next_state[s, a] is the goal
                = 0                       if s' is the trap
                = gamma * V_{t+1}(s')     otherwise
    V_t(s)      = sum_a pi(a|s) Q_t(s, a)
    A*_t(s, a)  = Q_t(s, a) - V_t(s)

With ``gamma = 1``, ``V_0(start)`` is the success probability; ``gamma < 1`` is the discounted return that a
gamma-based estimator (GiGPO, GraphHCA, CRBC) targets. The exact gradient of ``V_0(start)`` with respect to the
softmax logits is ``sum_t d_t(s) pi(a|s) A*_t(s, a)``, ``d_t`` the probability of being at a live state s at step t.

Families (each ``make_task(family, seed)``; sizes give ALFWorld-like batches: groups of 8 rollouts, 5-50 steps,
anchor states revisited across and within rollouts):

* ``rooms``: a house of 10 rooms, a random spanning tree plus 3 extra doors (cycles), the goal chest in the room
  farthest from the start, side rooms that are dead ends, 2 trap rooms with a deadly action; "look around" and
  "check inventory" are self-loops. H = 30.
* ``keydoor``: a house of 7 rooms; the key lies in a dead-end room next to the start and the locked door is in the
  farthest room: the key is picked up within the first steps, its value shows only when the door opens many steps
  later (delayed credit). Without the key "unlock the door" is a no-op; with it "take the key" is one. H = 36.
* ``lock``: a combination lock of 4 digits with 3 buttons: the right button advances, a wrong one resets to the
  start (cycles, heavy revisits), "look at the lock" is a no-op. H = 40.
* ``allfail``: a bridge of 10 stones: "step forward" advances, "wait" stays, "step back" goes back one, and one wrong
  move on each of the last 5 stones falls into a pit; success needs a long exact path, so under the uniform start
  policy nearly every group fails (MVPO's regime). H = 40.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

__all__ = ["Task", "Values", "Rollouts", "FAMILIES", "make_task", "uniform_logits", "policy", "solve", "occupancy",
           "exact_gradient", "success_probability", "rollout", "advantage_of", "AltGoal", "alt_goals", "goal_values"]

FAMILIES = ("rooms", "keydoor", "lock", "allfail")

_ROOM_NAMES = ("kitchen", "hallway", "bedroom", "bathroom", "garage", "cellar", "attic", "study", "pantry",
               "garden", "library", "office", "laundry", "porch")
_BUTTONS = ("red", "green", "blue", "yellow", "white")


@dataclass(frozen=True)
class Task:
    """One finite deterministic task (see the module docstring).

    Attributes:
        family, seed: how it was made (:func:`make_task`).
        horizon: H, the step limit (reaching it is failure).
        next_state: [S, A] int64 successor of each (state, action); padding and absorbing rows point to themselves.
        n_actions: [S] int64 actions available at each state (0 at the two absorbing states).
        start, goal, trap: state ids of the start and of the absorbing success and failure states.
        observations: [S] text of each state (what the env adapter shows).
        actions: [S] tuple of each state's action labels, in column order.
        progress: [S] float64 in [0, 1]: 1 - d(s) / d(start), d the fewest actions to the goal (1 at the goal, 0 at
            the trap or where the goal is unreachable); what MVPO's milestone and signature parsers read.
        goals: the layout's alternative goals as ``(sentence, target states)`` (reach any target; :func:`alt_goals`).
    """

    family: str
    seed: int
    horizon: int
    next_state: np.ndarray
    n_actions: np.ndarray
    start: int
    goal: int
    trap: int
    observations: tuple[str, ...]
    actions: tuple[tuple[str, ...], ...]
    progress: np.ndarray
    goals: tuple[tuple[str, tuple[int, ...]], ...] = ()

    @property
    def n_states(self) -> int:
        return int(self.next_state.shape[0])

    @property
    def width(self) -> int:
        """A: the padded number of action columns."""
        return int(self.next_state.shape[1])

    @property
    def legal(self) -> np.ndarray:
        """[S, A] bool: the action column exists at the state."""
        return np.arange(self.width)[None, :] < self.n_actions[:, None]

    @property
    def terminal(self) -> np.ndarray:
        """[S] bool: the goal and the trap."""
        out = np.zeros(self.n_states, bool)
        out[[self.goal, self.trap]] = True
        return out


@dataclass(frozen=True)
class Values:
    """Backward induction under one policy: ``V`` [H+1, S], ``Q`` [H, S, A] (0 on padding columns and at the
    absorbing states), ``gamma``. ``V[0, start]`` is the success probability when gamma = 1."""

    V: np.ndarray
    Q: np.ndarray
    gamma: float

    @property
    def A(self) -> np.ndarray:
        """[H, S, A] A*_t(s, a) = Q_t(s, a) - V_t(s)."""
        return self.Q - self.V[:-1, :, None]


@dataclass(frozen=True)
class Rollouts:
    """A batch of N rollouts, indexed by absolute step t in ``[0, H)``; rows with ``t < t0[i]`` or after the end are
    not steps (``step[i, t]`` False).

    Attributes:
        states, actions: [N, H] int64 state before the action and the action (-1 where not a step).
        step: [N, H] bool, the rollout took an action at step t.
        t0: [N] first step of each rollout (0 for rollouts from the start, later for forks and trials).
        length: [N] number of actions taken.
        success: [N] bool the rollout entered the goal.
        truncated: [N] bool the rollout hit the step limit (failure).
        final: [N] int64 state after the last action.
    """

    states: np.ndarray
    actions: np.ndarray
    step: np.ndarray
    t0: np.ndarray
    length: np.ndarray
    success: np.ndarray
    truncated: np.ndarray
    final: np.ndarray

    @property
    def env_steps(self) -> int:
        return int(self.length.sum())


# ---- building tasks --------------------------------------------------------------------------------------------
class _Builder:
    """Collects states and labelled transitions, then packs them into a :class:`Task`."""

    def __init__(self):
        self.obs: list[str] = []
        self.moves: list[list[tuple[str, int]]] = []
        self.index: dict[object, int] = {}

    def state(self, key: object, text: str) -> int:
        if key not in self.index:
            self.index[key] = len(self.obs)
            self.obs.append(text)
            self.moves.append([])
        return self.index[key]

    def move(self, s: int, label: str, to: int) -> None:
        self.moves[s].append((label, to))

    def build(self, family: str, seed: int, horizon: int, start: int, goal: int, trap: int,
              goals: tuple[tuple[str, tuple[int, ...]], ...] = ()) -> Task:
        n = len(self.obs)
        width = max(len(m) for m in self.moves)
        nxt = np.tile(np.arange(n)[:, None], (1, width))
        n_act = np.zeros(n, np.int64)
        labels = []
        for s, moves in enumerate(self.moves):
            if s in (goal, trap):
                labels.append(())
                continue
            n_act[s] = len(moves)
            for a, (_, to) in enumerate(moves):
                nxt[s, a] = to
            labels.append(tuple(label for label, _ in moves))
        progress = _progress(nxt, n_act, start, goal, trap)
        return Task(family, seed, horizon, nxt.astype(np.int64), n_act, start, goal, trap, tuple(self.obs),
                    tuple(labels), progress, goals)


def _progress(nxt: np.ndarray, n_act: np.ndarray, start: int, goal: int, trap: int) -> np.ndarray:
    """1 - d(s)/d(start) with d the BFS distance to the goal over the reversed graph (0 where unreachable)."""
    n = nxt.shape[0]
    back: list[list[int]] = [[] for _ in range(n)]
    for s in range(n):
        for a in range(int(n_act[s])):
            back[int(nxt[s, a])].append(s)
    dist = np.full(n, -1, np.int64)
    dist[goal] = 0
    queue = deque([goal])
    while queue:
        x = queue.popleft()
        for p in back[x]:
            if dist[p] < 0 and p not in (goal, trap):
                dist[p] = dist[x] + 1
                queue.append(p)
    d0 = max(int(dist[start]), 1)
    out = np.where(dist >= 0, 1.0 - dist / d0, 0.0)
    out[trap] = 0.0
    return np.clip(out, 0.0, 1.0)


def _house(rng: np.random.Generator, n_rooms: int, extra_doors: int) -> tuple[list[set[int]], list[int]]:
    """A connected room graph (random spanning tree + extra doors) and BFS distances from room 0."""
    adj: list[set[int]] = [set() for _ in range(n_rooms)]
    for r in range(1, n_rooms):
        p = int(rng.integers(0, r))
        adj[r].add(p)
        adj[p].add(r)
    added = 0
    while added < extra_doors:
        a, b = (int(x) for x in rng.choice(n_rooms, 2, replace=False))
        if b not in adj[a]:
            adj[a].add(b)
            adj[b].add(a)
            added += 1
    dist = [-1] * n_rooms
    dist[0] = 0
    queue = deque([0])
    while queue:
        x = queue.popleft()
        for y in sorted(adj[x]):
            if dist[y] < 0:
                dist[y] = dist[x] + 1
                queue.append(y)
    return adj, dist


def _rooms(seed: int) -> Task:
    rng = np.random.default_rng([18, 1, seed])
    n = 10
    names = [str(x) for x in rng.permutation(_ROOM_NAMES)[:n]]
    adj, dist = _house(rng, n, extra_doors=3)
    far = max(dist)
    goal_room = int(rng.choice([r for r in range(n) if dist[r] == far]))
    # shortest-path rooms (from the goal back to the start) must stay trap-free
    on_path = {goal_room}
    r = goal_room
    while r != 0:
        r = min(y for y in adj[r] if dist[y] == dist[r] - 1)
        on_path.add(r)
    off = [x for x in range(1, n) if x not in on_path]
    traps = {int(x) for x in rng.choice(off, size=min(2, len(off)), replace=False)} if off else set()
    b = _Builder()
    rooms = [b.state(("room", i), f"You are in the {names[i]}. Doors lead to "
                     + ", ".join(f"the {names[j]}" for j in sorted(adj[i])) + "."
                     + (" There is a locked chest here." if i == goal_room else "")
                     + (" A rickety trapdoor is in the floor." if i in traps else "")) for i in range(n)]
    goal = b.state("goal", "You open the chest and find the treasure. Task complete.")
    trap = b.state("trap", "You fall through the trapdoor. Task failed.")
    for i in range(n):
        for j in sorted(adj[i]):
            b.move(rooms[i], f"go to the {names[j]}", rooms[j])
        b.move(rooms[i], "look around", rooms[i])
        b.move(rooms[i], "check inventory", rooms[i])
        if i == goal_room:
            b.move(rooms[i], "open the chest", goal)
        if i in traps:
            b.move(rooms[i], "open the trapdoor", trap)
    goals = tuple((f"Go to the {names[i]}. Avoid trapdoors.", (rooms[i],)) for i in range(n))
    return b.build("rooms", seed, 30, rooms[0], goal, trap, goals)


def _keydoor(seed: int) -> Task:
    rng = np.random.default_rng([18, 2, seed])
    n = 7
    names = [str(x) for x in rng.permutation(_ROOM_NAMES)[:n]]
    adj, dist = _house(rng, n - 1, extra_doors=2)
    # room n-1 is the key room: a dead end next to the start
    adj.append({0})
    adj[0].add(n - 1)
    key_room = n - 1
    far = max(dist)
    door_room = int(rng.choice([r for r in range(n - 1) if dist[r] == far]))
    b = _Builder()
    room = {}
    for k in (0, 1):
        for i in range(n):
            text = (f"You are in the {names[i]}. Doors lead to " + ", ".join(f"the {names[j]}" for j in sorted(adj[i]))
                    + "." + (" A key lies on the table." if i == key_room and not k else "")
                    + (" A locked door blocks the way out." if i == door_room else "")
                    + (" You carry a key." if k else " You carry nothing."))
            room[i, k] = b.state(("room", i, k), text)
    goal = b.state("goal", "The key turns, the door opens and you walk out. Task complete.")
    trap = b.state("trap", "unused")
    for k in (0, 1):
        for i in range(n):
            s = room[i, k]
            for j in sorted(adj[i]):
                b.move(s, f"go to the {names[j]}", room[j, k])
            b.move(s, "take the key", room[i, 1] if i == key_room else s)
            b.move(s, "unlock the door", goal if (i == door_room and k) else s)
            b.move(s, "look around", s)
    goals = tuple((f"Go to the {names[i]}.", (room[i, 0], room[i, 1])) for i in range(n)) + \
        tuple((f"Take the key, then go to the {names[i]}.", (room[i, 1],)) for i in range(n))
    return b.build("keydoor", seed, 36, room[0, 0], goal, trap, goals)


def _lock(seed: int) -> Task:
    rng = np.random.default_rng([18, 3, seed])
    digits, buttons = 4, 3
    code = rng.integers(0, buttons, size=digits)
    names = [str(x) for x in rng.permutation(_BUTTONS)[:buttons]]
    b = _Builder()
    cells = [b.state(("digit", i), f"A combination lock shows {i} of {digits} digits entered. Buttons: "
                     + ", ".join(names) + ".") for i in range(digits)]
    goal = b.state("goal", "The lock clicks open. Task complete.")
    trap = b.state("trap", "unused")
    for i in range(digits):
        for k in range(buttons):
            to = (cells[i + 1] if i + 1 < digits else goal) if k == code[i] else cells[0]
            b.move(cells[i], f"press {names[k]}", to)
        b.move(cells[i], "look at the lock", cells[i])
    return b.build("lock", seed, 40, cells[0], goal, trap)


def _allfail(seed: int) -> Task:
    rng = np.random.default_rng([18, 4, seed])
    length = 10
    b = _Builder()
    cells = [b.state(("cell", i), f"You are on stone {i} of a narrow bridge of {length} stones over a pit.")
             for i in range(length)]
    goal = b.state("goal", "You reach the far side of the bridge. Task complete.")
    trap = b.state("trap", "You fall into the pit. Task failed.")
    for i in range(length):
        moves = [("step forward", cells[i + 1] if i + 1 < length else goal),
                 ("wait", cells[i]),
                 ("step back", cells[max(i - 1, 0)])]
        if i >= length // 2:
            moves.append(("jump", trap))
        else:
            moves.append(("look down", cells[i]))
        for k in rng.permutation(len(moves)):  # the column of the right move is seeded
            b.move(cells[i], *moves[int(k)])
    goals = tuple((f"Stand on stone {i} of the bridge without falling into the pit.", (cells[i],))
                  for i in range(length))
    return b.build("allfail", seed, 40, cells[0], goal, trap, goals)


_MAKERS = {"rooms": _rooms, "keydoor": _keydoor, "lock": _lock, "allfail": _allfail}


@lru_cache(maxsize=64)
def make_task(family: str, seed: int = 0) -> Task:
    """The task of ``family`` (one of :data:`FAMILIES`) drawn from ``seed`` (same seed, same task)."""
    if family not in _MAKERS:
        raise ValueError(f"family={family!r}; choose one of {list(FAMILIES)}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed={seed!r}; the task seed must be an integer >= 0")
    return _MAKERS[family](int(seed))


# ---- policy and exact values -------------------------------------------------------------------------------------
def uniform_logits(task: Task) -> np.ndarray:
    """[S, A] zero logits: the uniform policy over each state's actions."""
    return np.zeros((task.n_states, task.width), np.float64)


def policy(task: Task, logits: np.ndarray) -> np.ndarray:
    """[S, A] tabular softmax ``pi(a|s)`` over each state's legal columns (0 on padding; uniform at the absorbing
    states, which are never acted in)."""
    legal = task.legal
    z = np.where(legal, logits, -np.inf)
    z = z - np.where(legal.any(1), z.max(1), 0.0)[:, None]
    e = np.where(legal, np.exp(z), 0.0)
    total = e.sum(1, keepdims=True)
    return np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)


def solve(task: Task, pi: np.ndarray, gamma: float = 1.0) -> Values:
    """Backward induction for ``V_t`` and ``Q_t`` under ``pi`` (module docstring)."""
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"gamma={gamma}; the discount must lie in (0, 1]")
    H, S, A = task.horizon, task.n_states, task.width
    nxt, legal = task.next_state, task.legal
    into_goal, into_trap = nxt == task.goal, nxt == task.trap
    V = np.zeros((H + 1, S))
    Q = np.zeros((H, S, A))
    for t in range(H - 1, -1, -1):
        q = np.where(into_goal, 1.0, np.where(into_trap, 0.0, gamma * V[t + 1][nxt]))
        q = np.where(legal, q, 0.0)
        Q[t] = q
        V[t] = (pi * q).sum(1)
    return Values(V, Q, float(gamma))


def success_probability(task: Task, logits: np.ndarray) -> float:
    """Exact ``V_0(start)`` with gamma = 1 under the softmax policy of ``logits``."""
    return float(solve(task, policy(task, logits)).V[0, task.start])


def occupancy(task: Task, pi: np.ndarray) -> np.ndarray:
    """[H, S] ``d_t(s)``: probability that the episode is still running at step t and is in state s."""
    H, S = task.horizon, task.n_states
    d = np.zeros((H, S))
    d[0, task.start] = 1.0
    live = ~task.terminal
    for t in range(H - 1):
        flow = d[t][:, None] * pi
        nxt = np.zeros(S)
        np.add.at(nxt, task.next_state.reshape(-1), flow.reshape(-1))
        d[t + 1] = np.where(live, nxt, 0.0)
    return d


def exact_gradient(task: Task, logits: np.ndarray) -> np.ndarray:
    """[S, A] d V_0(start) / d logits = sum_t d_t(s) pi(a|s) A*_t(s, a) (the policy gradient theorem, exact)."""
    pi = policy(task, logits)
    vals = solve(task, pi)
    d = occupancy(task, pi)
    return np.einsum("ts,tsa->sa", d, pi[None] * vals.A)


def advantage_of(values: Values, t: np.ndarray, s: np.ndarray, a: np.ndarray) -> np.ndarray:
    """A*_t(s, a) of sampled rows (arrays of equal shape)."""
    return values.Q[t, s, a] - values.V[t, s]


# ---- alternative goals at a fixed state (EVOKE) -------------------------------------------------------------------
@dataclass(frozen=True)
class AltGoal:
    """A goal other than the task's in the same layout: reach any of ``targets`` (reward on entering one), moving
    by ``next_state`` ([S, A]; None: the task's own transitions). ``text`` says it in the task's words."""

    text: str
    targets: tuple[int, ...]
    next_state: np.ndarray | None = None


def alt_goals(task: Task, s: int) -> list[AltGoal]:
    """The alternative goals of ``task`` at state ``s``, except those ``s`` already satisfies.

    ``rooms``: go to another room; ``keydoor``: go to another room, or take the key and then go to a room;
    ``allfail``: stand on another stone; ``lock``: open it with another code that agrees with the true one on the
    digits already entered (so the state means the same under it), i.e. other buttons from digit ``s`` on.
    """
    if task.family == "lock":
        return _lock_codes(task, s)
    return [AltGoal(text, targets) for text, targets in task.goals if s not in targets]


def _lock_codes(task: Task, s: int) -> list[AltGoal]:
    if not 0 <= s < task.goal:  # the lock's cells are states 0 .. digits-1, then the goal
        return []
    digits = task.goal
    buttons = [a for a in task.actions[0] if a.startswith("press ")]
    code = [next(k for k in range(len(buttons)) if task.next_state[j, k] == (j + 1 if j + 1 < digits else task.goal))
            for j in range(digits)]
    out = []
    for rest in np.ndindex(*([len(buttons)] * (digits - s))):
        alt = code[:s] + list(rest)
        if alt == code:
            continue
        nxt = task.next_state.copy()
        for j in range(digits):
            nxt[j, :len(buttons)] = 0  # a wrong button resets to the first cell (state 0)
            nxt[j, alt[j]] = j + 1 if j + 1 < digits else task.goal
        words = ", ".join(buttons[k][len("press "):] for k in alt)
        out.append(AltGoal(f"Open the combination lock with the code {words}. A wrong button resets every digit "
                           f"entered so far.", (task.goal,), nxt))
    return out


def goal_values(task: Task, goal: AltGoal, gamma: float = 0.9) -> np.ndarray:
    """[S, A] optimal values under ``goal``: ``Q*(s, a) = gamma ** d(s')`` with s' the successor and d the fewest
    actions from s' to a target (0 at a target); 0 where no target is reachable from s' (the task's goal and trap are
    absorbing dead ends unless they are targets) and on padding columns."""
    nxt = task.next_state if goal.next_state is None else goal.next_state
    targets = set(goal.targets)
    dead = {task.goal, task.trap} - targets
    back: list[list[int]] = [[] for _ in range(task.n_states)]
    for s in range(task.n_states):
        if s in dead or s in targets:
            continue
        for a in range(int(task.n_actions[s])):
            back[int(nxt[s, a])].append(s)
    dist = np.full(task.n_states, -1, np.int64)
    queue = deque(sorted(targets))
    dist[list(queue)] = 0
    while queue:
        x = queue.popleft()
        for p in back[x]:
            if dist[p] < 0:
                dist[p] = dist[x] + 1
                queue.append(p)
    d = dist[nxt]
    return np.where(task.legal & (d >= 0), float(gamma) ** np.maximum(d, 0), 0.0)


# ---- vectorised rollouts -----------------------------------------------------------------------------------------
def rollout(task: Task, pi: np.ndarray, rng: np.random.Generator, n: int | None = None, *,
            states: np.ndarray | None = None, t0: np.ndarray | None = None,
            first_action: np.ndarray | None = None, record: bool = True) -> Rollouts:
    """N rollouts under ``pi`` ([S, A]), vectorised over rollouts (one Python step per time step).

    Default: ``n`` rollouts from the start at t = 0. ``states`` / ``t0`` ([N]) start each rollout at a given state
    and step (forks of a tree, counterfactual trials); ``first_action`` ([N], -1 = sample) forces the first action.
    Each rollout runs until it enters the goal or the trap, or reaches t = H. ``record=False`` keeps only lengths,
    outcomes and final states (``states`` / ``actions`` / ``step`` are then empty [0, H] arrays).
    """
    H = task.horizon
    if states is None:
        if n is None:
            raise ValueError("rollout: give n (rollouts from the start) or states")
        states = np.full(n, task.start, np.int64)
    states = np.asarray(states, np.int64).copy()
    n = states.size
    t0 = np.zeros(n, np.int64) if t0 is None else np.asarray(t0, np.int64)
    if first_action is None:
        first_action = np.full(n, -1, np.int64)
    cdf = np.cumsum(pi, axis=1)
    cdf = cdf / np.where(cdf[:, -1:] > 0, cdf[:, -1:], 1.0)
    shape = (n, H) if record else (0, H)
    out_s = np.full(shape, -1, np.int64)
    out_a = np.full(shape, -1, np.int64)
    done = np.zeros(n, bool)
    success = np.zeros(n, bool)
    length = np.zeros(n, np.int64)
    cur = states
    order = np.argsort(t0, kind="stable")
    entry = np.searchsorted(t0[order], np.arange(H + 1), side="right")  # rollouts started by step t: order[:entry[t]]
    active = np.zeros(0, np.int64)
    for t in range(int(t0.min()) if n else H, H):
        lo, hi = entry[t - 1] if t > 0 else 0, entry[t]
        if hi > lo:
            active = np.concatenate([active, order[lo:hi]])
        if active.size == 0:
            if hi == n:
                break
            continue
        s = cur[active]
        a = (rng.random(active.size)[:, None] > cdf[s]).sum(1)
        a = np.minimum(a, task.n_actions[s] - 1)
        forced = first_action[active]
        a = np.where((forced >= 0) & (t0[active] == t), forced, a)
        if record:
            out_s[active, t] = s
            out_a[active, t] = a
        s2 = task.next_state[s, a]
        cur[active] = s2
        length[active] += 1
        hit_goal = s2 == task.goal
        success[active] = hit_goal
        end = hit_goal | (s2 == task.trap)
        done[active] = end
        active = active[~end]
    step = out_a >= 0
    truncated = ~done
    return Rollouts(out_s, out_a, step, t0, length, success, truncated, cur)
