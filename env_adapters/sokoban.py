"""Sokoban on ``gym-sokoban`` (procedurally generated rooms, reverse-play solvable), as text.

Rendering uses verl-agent's glyphs: ``#`` wall, ``_`` floor, ``O`` target, ``X`` box, ``√`` box on target, ``P``
player, ``S`` player on target; one row per line. Rooms are seeded by seeding NumPy's and Python's global generators
right before ``SokobanEnv.reset`` (which takes no seed); both generators are restored afterwards, so a reset does not
disturb the caller's random state. Those generators are process-wide, so resets hold one lock: envs reset at once on
threads (the verl agent loop's thread backend) each get their seed's room (code outside agentcredit that draws from
the global generators on another thread during a reset can still shift it). gym-sokoban prints two lines on each
internal retry of its generator; its module gets a ``print`` that drops them (not a swap of the process's stdout).
Actions ``up/down/left/right`` are gym-sokoban's push actions 1-4 (push when a box is ahead, else move). Rewards
follow the ALFWorld/verl-agent convention: 10 when the last box lands on a target, 0 otherwise, plus the
invalid-action penalty.
"""

from __future__ import annotations

import importlib
import os
import random
import sys
import threading
import types
from typing import Any

import numpy as np

from .base import DrawnState, StepResult, begin_step, check_snapshot, episode_seed, missing_package, quiet
from .prompting import INVALID_PENALTY

__all__ = ["SokobanAdapter", "GLYPHS", "ACTIONS"]

#: gym-sokoban room_state codes -> verl-agent glyphs (6 is player on target, made from room_fixed)
GLYPHS = {0: "#", 1: "_", 2: "O", 3: "√", 4: "X", 5: "P", 6: "S"}
#: action word -> gym-sokoban action id (push actions: push if a box is ahead, else move)
ACTIONS = {"up": 1, "down": 2, "left": 3, "right": 4}
_DIGIT_TO_GLYPH = str.maketrans({str(code): glyph for code, glyph in GLYPHS.items()})

TASK = ("You are an expert agent playing Sokoban. Your goal is to push every box onto a target.\n"
        "Symbols: # wall, _ floor, O target, X box, √ box on target, P you, S you on a target.\n"
        "You can push a box by walking into it when the cell behind it is free; you cannot pull boxes.\n"
        "Your admissible actions are up, down, left and right.")


def _resource_filename(package: str, resource: str) -> str:
    return os.path.join(os.path.dirname(sys.modules[package].__file__), *resource.split("/"))


def _import_sokoban_env() -> type:
    """``gym_sokoban``'s ``SokobanEnv``, imported on first use.

    gym-sokoban 0.0.6 imports ``pkg_resources`` (gone from setuptools >= 81) for one call, ``resource_filename``;
    when the real module is absent a stand-in providing that function is visible during the import only.
    gym 0.26's NumPy-2 banner on import is silenced.
    """
    shim = None
    try:
        importlib.import_module("pkg_resources")
    except ImportError:
        shim = types.ModuleType("pkg_resources")
        shim.resource_filename = _resource_filename
        sys.modules["pkg_resources"] = shim
    try:
        with quiet():
            importlib.import_module("gym")
            importlib.import_module("gym_sokoban")
            module = importlib.import_module("gym_sokoban.envs.sokoban_env")
    except ImportError as e:
        raise missing_package("gym-sokoban", "sokoban") from e
    finally:
        if shim is not None and sys.modules.get("pkg_resources") is shim:
            del sys.modules["pkg_resources"]
    module.print = _drop  # its reset's retry messages (a module global shadows the builtin there only)
    return module.SokobanEnv


def _drop(*args, **kwargs) -> None:
    """``print`` for gym-sokoban's env module: drops the line."""


#: held while a reset has NumPy's and Python's global generators seeded for its room
_GENERATOR = threading.Lock()


class SokobanAdapter(DrawnState):
    """Sokoban rooms from gym-sokoban as an ``AgentEnv``.

    Args:
        size: room side length (rooms are ``size x size``, walls included); 6 is verl-agent's setting.
        num_boxes: number of boxes (and targets).
        seed: default seed of :meth:`reset` when it is called without one (None: an unseeded room).
        num_gen_steps: reverse-play steps of the room generator (None: gym-sokoban's 1.7 * (h + w)).
        success_reward: reward of the step that solves the room.
        invalid_penalty: reward of a step without a parseable, admissible action (the state does not change).
    """

    legal = tuple(ACTIONS)

    def __init__(self, size: int = 6, num_boxes: int = 1, seed: int | None = None, num_gen_steps: int | None = None,
                 success_reward: float = 10.0, invalid_penalty: float = INVALID_PENALTY):
        if size < 5:
            raise ValueError(f"size={size}; gym-sokoban needs rooms of at least 5x5 (walls included)")
        if num_boxes < 1:
            raise ValueError(f"num_boxes={num_boxes}; a room needs at least one box")
        self.size, self.num_boxes, self.seed = int(size), int(num_boxes), seed
        self.success_reward, self.invalid_penalty = float(success_reward), float(invalid_penalty)
        self.task = TASK
        cls = _import_sokoban_env()
        # the step limit is the recorder's (max_steps); gym-sokoban's own limit is pushed out of reach
        self._env = cls(dim_room=(self.size, self.size), num_boxes=self.num_boxes, num_gen_steps=num_gen_steps,
                        max_steps=2**62, reset=False)
        self._done = True
        self._solved = False

    # ---- AgentEnv -------------------------------------------------------------------------------------------
    def reset(self, seed: int | None = None) -> str:
        seed = episode_seed(self.seed if seed is None else seed, "sokoban", limit=2**32)  # numpy.random.seed
        with _GENERATOR:
            np_state, py_state = np.random.get_state(), random.getstate()
            try:
                if seed is not None:
                    np.random.seed(seed)
                    random.seed(seed)
                self._env.reset(render_mode="tiny_rgb_array")
            finally:
                if seed is not None:
                    np.random.set_state(np_state)
                    random.setstate(py_state)
        self._done, self._solved = False, False
        self._state_changed()
        return self.render()

    def step(self, action_text: str | None) -> StepResult:
        key, refused = begin_step(self, action_text)
        if refused is not None:
            return refused
        _, _, done, info = self._env.step(ACTIONS[key], observation_mode="tiny_rgb_array")
        self._state_changed()
        # gym-sokoban's done is "all boxes on targets or its step limit", and its limit is out of reach
        self._solved = bool(done)
        self._done = self._solved
        reward = self.success_reward if self._solved else 0.0
        return StepResult(self.render(), reward, self._done, self._solved,
                          {"valid": True, "action_key": key, "moved_player": bool(info["action.moved_player"]),
                           "moved_box": bool(info["action.moved_box"])})

    def state_key(self) -> str:
        return self.render()

    def action_key(self, action_text: str | None) -> str | None:
        if not isinstance(action_text, str):
            return None
        word = action_text.strip().lower()
        return word if word in ACTIONS else None

    def legal_actions(self) -> list[str]:
        return list(self.legal)

    def snapshot(self) -> dict[str, Any]:
        e = self._env
        return {"room_state": e.room_state.copy(), "room_fixed": e.room_fixed.copy(),
                "player_position": e.player_position.copy(), "box_mapping": dict(e.box_mapping),
                "num_env_steps": e.num_env_steps, "boxes_on_target": e.boxes_on_target,
                "done": self._done, "solved": self._solved}

    def restore(self, snap: dict[str, Any]) -> None:
        check_snapshot(snap, ("room_state", "room_fixed", "player_position", "box_mapping", "num_env_steps",
                              "boxes_on_target", "done", "solved"), "sokoban")
        e = self._env
        e.room_state, e.room_fixed = snap["room_state"].copy(), snap["room_fixed"].copy()
        e.player_position = snap["player_position"].copy()
        e.box_mapping = dict(snap["box_mapping"])
        e.num_env_steps, e.boxes_on_target = snap["num_env_steps"], snap["boxes_on_target"]
        self._done, self._solved = snap["done"], snap["solved"]
        self._state_changed()

    # ---- rendering ------------------------------------------------------------------------------------------
    def _draw(self) -> str:
        """The room in verl-agent's glyphs, one row per line."""
        room = self._env.room_state.copy()
        room[(self._env.room_fixed == 2) & (room == 5)] = 6
        # cell codes as the digits "0".."6" in one string, mapped to glyphs by str.translate (no per-cell Python)
        cells = (room.astype(np.uint8) + ord("0")).tobytes().decode("ascii").translate(_DIGIT_TO_GLYPH)
        width = room.shape[1]
        return "\n".join(cells[i:i + width] for i in range(0, len(cells), width))

    @property
    def solved(self) -> bool:
        return self._solved
