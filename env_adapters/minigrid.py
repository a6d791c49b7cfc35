"""MiniGrid (the ``minigrid`` package) as text: small seeded grid worlds with a heading agent.

Two tasks:

* ``"goal"``: a ``size x size`` room (walls included) with the goal and the agent's start (cell and heading) drawn
  from the seed, and optionally ``n_walls`` interior wall cells (the goal always stays reachable). Actions:
  ``turn left``, ``turn right``, ``move forward``.
* ``"doorkey"``: minigrid's ``DoorKeyEnv`` of that size (pick up the key, open the door, reach the goal); adds
  ``pick up`` and ``open door``.

Two action sets (option ``moves``):

* ``"relative"`` (default): the heading agent above (turn left / turn right / move forward).
* ``"absolute"`` (task ``"goal"`` only): ``up``, ``down``, ``left``, ``right``. Each sets the minigrid agent's
  heading (north, south, west, east) and steps ``forward`` on the real env; a move into a wall is a valid action that
  leaves the state unchanged (as in minigrid). The heading is then irrelevant, so the drawing shows the agent as ``A``
  and the status line gives the agent's and the goal's cell.

Three observations (option ``view``): ``"grid"`` (default) draws the room; ``"coords"`` and ``"offset"`` (absolute
moves, no interior walls: where a few numbers are the whole state) give only ``You are at row 2, column 1. The goal
is at row 3, column 4.`` or the goal's offset from the agent, ``Goal offset: row +1, column +3.``. They cost ~15-20
tokens instead of the drawing's ~100, which is what makes a CPU run of a 135M model affordable. Within one room (one
seed, so one goal) the offset determines the agent's cell, so it is an exact state key there.

Rendering, one character per cell, one row per line: ``#`` wall, ``.`` floor, ``G`` goal, ``K`` key, ``D`` closed
door, ``L`` locked door, ``/`` open door, ``V`` lava, and the agent as ``>`` ``v`` ``<`` ``^`` (facing east, south,
west, north; ``A`` with absolute moves), followed by the agent's position, heading and what it carries (absolute
moves: ``You are at row 2, column 1. The goal G is at row 3, column 4.``). Rewards: 10 on the step that reaches
the goal, 0 otherwise, plus the invalid-action penalty and, if ``shaping`` > 0, ``shaping * (d_before - d_after)``
with d the Manhattan distance to the goal (off by default).

``goal_rankings(k, rng)`` (task ``"goal"``): alternative goal cells of the same room (any other free cell the agent
can reach), each with the legal actions' values ``GOAL_GAMMA ** d`` under it, d the BFS walk length from the
state after the action to that cell (over (cell, heading) states with relative moves); the prompt's observation is
redrawn with ``G`` (or the goal's coordinates) at the alternative cell.
"""

from __future__ import annotations

import copy
import importlib
from collections import deque
from typing import Any

from .base import (GOAL_GAMMA, DrawnState, GoalRanking, StepResult, begin_step, check_snapshot, episode_seed,
                   missing_package)
from .prompting import INVALID_PENALTY

__all__ = ["MiniGridAdapter", "TASKS", "MOVES", "ACTION_NAMES", "VIEWS", "ABSOLUTE"]

HEADINGS = ("east", "south", "west", "north")
_AGENT = (">", "v", "<", "^")
_CELL = {"wall": "#", "goal": "G", "key": "K", "lava": "V", "ball": "A", "box": "B", "floor": "."}
ACTION_NAMES = {"turn left": "left", "turn right": "right", "move forward": "forward", "pick up": "pickup",
                "open door": "toggle"}
_ALIASES = {"left": "turn left", "right": "turn right", "forward": "move forward", "pickup": "pick up",
            "toggle": "open door"}

#: absolute moves -> minigrid heading (east=0, south=1, west=2, north=3)
_HEADING_OF = {"right": 0, "down": 1, "left": 2, "up": 3}
_ABS_ALIASES = {"east": "right", "south": "down", "west": "left", "north": "up"}
ABSOLUTE = ("up", "down", "left", "right")
MOVES = ("relative", "absolute")
VIEWS = ("grid", "coords", "offset")

TASKS = {
    "goal": ("turn left", "turn right", "move forward"),
    "doorkey": ("turn left", "turn right", "move forward", "pick up", "open door"),
}

_TASK_TEXT = {
    "goal": "get to the green goal square",
    "doorkey": "use the key to open the door and then get to the goal",
}


def _import_minigrid():
    try:
        importlib.import_module("minigrid")
        minigrid_env = importlib.import_module("minigrid.minigrid_env")
        grid = importlib.import_module("minigrid.core.grid")
        objects = importlib.import_module("minigrid.core.world_object")
        mission = importlib.import_module("minigrid.core.mission")
    except ImportError as e:
        raise missing_package("minigrid", "minigrid") from e
    return minigrid_env, grid, objects, mission


def _goal_room_class():
    """A ``MiniGridEnv`` subclass whose layout (goal, start, interior walls) comes from the reset seed."""
    minigrid_env, grid_mod, objects, mission = _import_minigrid()

    class SeededGoalRoom(minigrid_env.MiniGridEnv):
        def __init__(self, size: int, n_walls: int, **kwargs):
            self.n_walls = n_walls
            super().__init__(mission_space=mission.MissionSpace(mission_func=lambda: _TASK_TEXT["goal"]),
                             grid_size=size, see_through_walls=True, **kwargs)

        def _gen_grid(self, width, height):
            for _ in range(1000):
                self.grid = grid_mod.Grid(width, height)
                self.grid.wall_rect(0, 0, width, height)
                goal = self.place_obj(objects.Goal())
                for _ in range(self.n_walls):
                    self.place_obj(objects.Wall())
                self.place_agent()
                if _distance(self.grid, tuple(self.agent_pos), tuple(goal)) is not None:
                    break
            else:
                raise RuntimeError(f"no layout with the goal reachable among 1000 draws (n_walls={self.n_walls} "
                                   f"in a {width}x{height} room); use fewer walls")
            self.mission = _TASK_TEXT["goal"]

    return SeededGoalRoom


def _distance(grid, start: tuple[int, int], goal: tuple[int, int]) -> int | None:
    """Shortest walk length between two cells through cells the agent can enter (None: unreachable)."""
    seen, queue = {start}, deque([(start, 0)])
    while queue:
        (x, y), d = queue.popleft()
        if (x, y) == goal:
            return d
        for nx, ny in ((x + 1, y), (x - 1, y), (x, y + 1), (x, y - 1)):
            if 0 <= nx < grid.width and 0 <= ny < grid.height and (nx, ny) not in seen:
                cell = grid.get(nx, ny)
                if cell is None or cell.can_overlap() or cell.type == "door":
                    seen.add((nx, ny))
                    queue.append(((nx, ny), d + 1))
    return None


def _free(grid, x: int, y: int) -> bool:
    """The agent can enter cell (x, y) (floor, goal, an open-able door; not a wall)."""
    if not (0 <= x < grid.width and 0 <= y < grid.height):
        return False
    cell = grid.get(x, y)
    return cell is None or cell.can_overlap() or cell.type == "door"


class MiniGridAdapter(DrawnState):
    """MiniGrid worlds as an ``AgentEnv``.

    Args:
        size: grid side length, walls included (the agent moves in ``size - 2`` squared cells).
        task: ``"goal"`` (seeded goal and start, optional interior walls) or ``"doorkey"`` (minigrid DoorKey).
        n_walls: interior wall cells of the ``"goal"`` task (ignored by ``"doorkey"``).
        seed: default seed of :meth:`reset` when it is called without one (None: an unseeded layout).
        shaping: coefficient of the progress reward ``shaping * (d_before - d_after)``; 0 (default) turns it off.
        success_reward: reward of the step that reaches the goal.
        invalid_penalty: reward of a step without a parseable, admissible action (the state does not change).
        moves: ``"relative"`` (turn left / turn right / move forward) or ``"absolute"`` (up / down / left / right,
            task ``"goal"`` only).
        view: ``"grid"`` (the drawing plus a status line), ``"coords"`` (the status line only) or ``"offset"`` (the
            goal's row and column offset); the last two need absolute moves and no interior walls.
    """

    def __init__(self, size: int = 5, task: str = "goal", n_walls: int = 0, seed: int | None = None,
                 shaping: float = 0.0, success_reward: float = 10.0, invalid_penalty: float = INVALID_PENALTY,
                 moves: str = "relative", view: str = "grid"):
        if task not in TASKS:
            raise ValueError(f"task={task!r}; choose one of {sorted(TASKS)}")
        if moves not in MOVES:
            raise ValueError(f"moves={moves!r}; choose one of {list(MOVES)}")
        if moves == "absolute" and task != "goal":
            raise ValueError(f"moves='absolute' is only available for task 'goal' (got task={task!r}); "
                             f"use moves='relative'")
        if view not in VIEWS:
            raise ValueError(f"view={view!r}; choose one of {list(VIEWS)}")
        if view != "grid" and (moves != "absolute" or n_walls):
            raise ValueError(f"view={view!r} needs moves='absolute' and n_walls=0 (got moves={moves!r}, "
                             f"n_walls={n_walls}): only then do the coordinates describe the whole state")
        if size < (5 if task == "doorkey" else 3):
            raise ValueError(f"size={size} is too small for task {task!r} (walls included)")
        if n_walls < 0 or n_walls > (size - 2) ** 2 - 2:
            raise ValueError(f"n_walls={n_walls}; it must lie in [0, {(size - 2) ** 2 - 2}] for size {size}")
        self.size, self.task_name, self.n_walls, self.seed = int(size), task, int(n_walls), seed
        self.shaping, self.success_reward = float(shaping), float(success_reward)
        self.invalid_penalty = float(invalid_penalty)
        self.moves = moves
        self.absolute = moves == "absolute"
        self.legal = ABSOLUTE if self.absolute else TASKS[task]
        self.view = view
        if view != "grid":  # "coords" and "offset": a few numbers, one short instruction for both
            self.task = "Reach the goal. up: row-1, down: row+1, left: column-1, right: column+1."
        elif self.absolute:
            self.task = ("You are an expert agent in a grid world. Your task is to get to the goal G.\n"
                         "Map: # wall, . floor, G goal, A you. Row 0 is the top, column 0 the left. up: row - 1, "
                         "down: row + 1, left: column - 1, right: column + 1. Walls block moves.")
        else:
            self.task = ("You are an expert agent in a grid world. Your task is to " + _TASK_TEXT[task] + ".\n"
                         "Map symbols: # wall, . floor, G goal, K key, D closed door, L locked door, / open door; "
                         "you are shown as >, v, < or ^ (facing east, south, west or north). Row 0 is the top, "
                         "column 0 the left. 'move forward' moves one cell in the direction you face; turning does "
                         "not move.")
        big = 10**9  # the step limit is the recorder's (max_steps), minigrid's own is pushed out of reach
        if task == "goal":
            self._env = _goal_room_class()(size=self.size, n_walls=self.n_walls, max_steps=big)
        else:
            _import_minigrid()
            doorkey = importlib.import_module("minigrid.envs.doorkey")
            self._env = doorkey.DoorKeyEnv(size=self.size, max_steps=big)
        self._actions = self._env.actions
        self._done = True
        self._solved = False

    # ---- AgentEnv -------------------------------------------------------------------------------------------
    def reset(self, seed: int | None = None) -> str:
        seed = episode_seed(self.seed if seed is None else seed, "minigrid")
        self._env.reset(seed=seed)
        self._done, self._solved = False, False
        self._state_changed()
        return self.render()

    def step(self, action_text: str | None) -> StepResult:
        key, refused = begin_step(self, action_text)
        if refused is not None:
            return refused
        before = self._goal_distance() if self.shaping else 0
        if self.absolute:
            self._env.agent_dir = _HEADING_OF[key]
            move = self._actions.forward
        else:
            move = getattr(self._actions, ACTION_NAMES[key])
        _, _, terminated, _, _ = self._env.step(move)
        self._state_changed()
        cell = self._env.grid.get(*self._env.agent_pos)
        self._solved = bool(terminated and cell is not None and cell.type == "goal")
        self._done = bool(terminated)
        reward = self.success_reward if self._solved else 0.0
        if self.shaping:
            reward += self.shaping * (before - self._goal_distance())
        return StepResult(self.render(), reward, self._done, self._solved, {"valid": True, "action_key": key})

    def state_key(self) -> str:
        return self.render()

    def action_key(self, action_text: str | None) -> str | None:
        if not isinstance(action_text, str):
            return None
        words = " ".join(action_text.strip().lower().split())
        if self.absolute:
            words = words[len("move "):] if words.startswith("move ") else words
            words = _ABS_ALIASES.get(words, words)
            return words if words in self.legal else None
        words = _ALIASES.get(words, words)
        return words if words in self.legal else None

    def legal_actions(self) -> list[str]:
        return list(self.legal)

    def expert_actions(self) -> list[str]:
        """The moves that start a shortest path to the goal (absolute moves, task ``"goal"``): the scripted expert
        whose turns ``agentcredit sft`` imitates. Empty when the episode is over or the goal is unreachable."""
        if not self.absolute:
            raise NotImplementedError("expert_actions is defined for moves='absolute' only")
        if self._done:
            return []
        grid, goal = self._env.grid, self._goal_position()
        ax, ay = (int(v) for v in self._env.agent_pos)
        here = _distance(grid, (ax, ay), goal)
        if here is None:
            return []
        steps = {"right": (1, 0), "down": (0, 1), "left": (-1, 0), "up": (0, -1)}
        best = []
        for move in self.legal:
            nx, ny = ax + steps[move][0], ay + steps[move][1]
            cell = grid.get(nx, ny)
            if cell is not None and not (cell.can_overlap() or cell.type == "door"):
                continue
            if _distance(grid, (nx, ny), goal) == here - 1:
                best.append(move)
        return best

    def goal_rankings(self, k: int, rng) -> list[GoalRanking]:
        """Up to ``k`` alternative goal cells (drawn without replacement by ``rng``, a ``random.Random``) with the
        legal actions' values under each (module docstring); goals under which every action is worth the same are
        left out. Task ``"goal"`` only (DoorKey's goal needs the key and the door first)."""
        if self.task_name != "goal":
            raise ValueError(f"goal_rankings needs task='goal' (got task={self.task_name!r}): DoorKey's alternative "
                             f"goals would also need the key and the door")
        if k < 1:
            raise ValueError(f"goal_rankings(k={k}): ask for at least one alternative goal")
        if self._done:
            return []
        grid, goal = self._env.grid, self._goal_position()
        here = (int(self._env.agent_pos[0]), int(self._env.agent_pos[1]))
        heading = int(self._env.agent_dir)
        cells = [(x, y) for y in range(1, grid.height - 1) for x in range(1, grid.width - 1)
                 if (x, y) not in (here, goal) and _free(grid, x, y) and _distance(grid, here, (x, y)) is not None]
        out = []
        for cell in rng.sample(cells, len(cells)):
            values = tuple(GOAL_GAMMA ** d for d in self._walks_after(here, heading, cell))
            if max(values) == min(values):
                continue
            out.append(GoalRanking(f"Get to row {cell[1]}, column {cell[0]}.", ((self.render(), self._draw(cell)),),
                                   tuple(self.legal), values))
            if len(out) == k:
                break
        return out

    def _walks_after(self, here: tuple[int, int], heading: int, goal: tuple[int, int]) -> list[int]:
        """Each legal action's fewest steps from the state after it to ``goal`` (BFS)."""
        grid = self._env.grid
        moves = {"right": (1, 0), "down": (0, 1), "left": (-1, 0), "up": (0, -1)}

        def ahead(cell, d):
            dx, dy = moves[("right", "down", "left", "up")[d]]
            nxt = (cell[0] + dx, cell[1] + dy)
            return nxt if _free(grid, *nxt) else cell

        if self.absolute:
            return [_distance(grid, ahead(here, _HEADING_OF[a]), goal) for a in self.legal]
        # relative moves: BFS over (cell, heading), backwards from the goal cell (any heading)
        def successors(state):
            cell, d = state
            return ((cell, (d - 1) % 4), (cell, (d + 1) % 4), (ahead(cell, d), d))

        after = {"turn left": (here, (heading - 1) % 4), "turn right": (here, (heading + 1) % 4),
                 "move forward": (ahead(here, heading), heading)}
        dist = {}
        for a, start in after.items():
            seen, queue, found = {start}, deque([(start, 0)]), None
            while queue:
                state, n = queue.popleft()
                if state[0] == goal:
                    found = n
                    break
                for nxt in successors(state):
                    if nxt not in seen:
                        seen.add(nxt)
                        queue.append((nxt, n + 1))
            dist[a] = found
        return [dist[a] for a in self.legal]

    def snapshot(self) -> dict[str, Any]:
        return {"env": copy.deepcopy(self._env), "done": self._done, "solved": self._solved}

    def restore(self, snap: dict[str, Any]) -> None:
        check_snapshot(snap, ("env", "done", "solved"), "minigrid")
        self._env = copy.deepcopy(snap["env"])
        self._done, self._solved = snap["done"], snap["solved"]
        self._state_changed()

    # ---- rendering ------------------------------------------------------------------------------------------
    def _draw(self, goal: tuple[int, int] | None = None) -> str:
        """The full grid, one character per cell, then the agent's position, heading and load; ``goal``: drawn with
        the goal at that cell instead (an alternative goal, :meth:`goal_rankings`)."""
        env = self._env
        ax, ay = (int(v) for v in env.agent_pos)
        true_goal = self._goal_position() if goal is not None else None
        if self.view == "coords":
            gx, gy = goal or self._goal_position()
            return f"You are at row {ay}, column {ax}. The goal is at row {gy}, column {gx}."
        if self.view == "offset":
            gx, gy = goal or self._goal_position()
            return f"Goal offset: row {gy - ay:+d}, column {gx - ax:+d}."
        rows = []
        for y in range(env.grid.height):
            row = []
            for x in range(env.grid.width):
                if (x, y) == (ax, ay):
                    row.append("A" if self.absolute else _AGENT[env.agent_dir])
                    continue
                cell = env.grid.get(x, y)
                if goal is not None and (x, y) in (goal, true_goal):
                    row.append("G" if (x, y) == goal else ".")
                elif cell is None:
                    row.append(".")
                elif cell.type == "door":
                    row.append("/" if cell.is_open else "L" if cell.is_locked else "D")
                else:
                    row.append(_CELL.get(cell.type, "?"))
            rows.append("".join(row))
        if self.absolute:
            gx, gy = goal or self._goal_position()
            rows.append(f"You are at row {ay}, column {ax}. The goal G is at row {gy}, column {gx}.")
            return "\n".join(rows)
        carry = f"a {env.carrying.color} {env.carrying.type}" if env.carrying is not None else "nothing"
        rows.append(f"You are at row {ay}, column {ax}, facing {HEADINGS[env.agent_dir]}; you carry {carry}.")
        return "\n".join(rows)

    def _goal_position(self) -> tuple[int, int]:
        grid = self._env.grid
        for x in range(grid.width):
            for y in range(grid.height):
                cell = grid.get(x, y)
                if cell is not None and cell.type == "goal":
                    return x, y
        raise RuntimeError("the grid has no goal")

    def _goal_distance(self) -> int:
        gx, gy = self._goal_position()
        ax, ay = (int(v) for v in self._env.agent_pos)
        return abs(gx - ax) + abs(gy - ay)

    @property
    def solved(self) -> bool:
        return self._solved
