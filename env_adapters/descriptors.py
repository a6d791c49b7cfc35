"""Trajectory descriptors for TJPO: per-step behaviour vectors the rollouts attach to every step row.

TJPO (``credit_plugins.estimators.tjpo``) reads ``extras['descriptor']`` [S, d] and sums it over a trajectory's
steps into the trajectory's descriptor phi(tau). A descriptor function maps ``(env, action_key)`` at the decision
state (before the env acts; ``action_key`` is the parsed semantic action, None when invalid) to a list of d floats,
the same d for every step of every episode of that env. Which one a rollout uses, first match:

1. the adapter's own ``descriptor(action_key) -> list[float]`` method, if it has one;
2. the function registered for the env's name with :func:`register_descriptor` (the built-ins below);
3. :func:`generic_descriptor`: a hashed bag of actions (8 buckets) and of visited states (16 buckets).

Built-in defaults (the trajectory sum makes them counts):

* ``minigrid`` ("path shape"): the move taken (8 hashed buckets) and the cell the agent stands on (16 hashed
  buckets of its (x, y)): which moves and which part of the room.
* ``sokoban``: the move direction (4), the push direction when the move pushes a box (4), and the cell of the box
  pushed (8 hashed buckets): push directions and which boxes in which order-insensitive mix.
* ``alfworld`` / ``textworld``: the action type (the command's verb among 12 ALFWorld verbs, or "other") and the
  receptacle or object it names (16 hashed buckets): visited receptacles and action types.

Bridges: the TRL ``TurnRollout(descriptors=True)`` and the verl ``agentcredit_env`` loop option ``descriptors: true``
attach it; ``agentcredit train`` turns it on for an estimator that reads ``descriptor`` (``tjpo``, or a ``mix`` with a
``tjpo`` part). Descriptors are hashed with :func:`credit_plugins.stable_hash`, never Python's salted ``hash``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from credit_plugins.hashing import stable_hash

__all__ = ["ALFWORLD_VERBS", "DESCRIPTOR", "descriptor_function", "generic_descriptor", "minigrid_descriptor",
           "register_descriptor", "sokoban_descriptor", "step_descriptor", "text_game_descriptor"]

#: the StepTable extra (and verl ``extra_fields`` / TRL ``agentcredit_extras`` key) that carries the descriptor
DESCRIPTOR = "descriptor"

DescriptorFn = Callable[[Any, "str | None"], Sequence[float]]
_REGISTERED: dict[str, DescriptorFn] = {}


def _bucket(key: Any, dim: int) -> list[float]:
    out = [0.0] * dim
    out[stable_hash(str(key)) % dim] = 1.0
    return out


def generic_descriptor(env: Any, action_key: str | None) -> list[float]:
    """A hashed bag of actions (8 buckets; all zero for an invalid action) and of visited states (16 buckets)."""
    return ([0.0] * 8 if action_key is None else _bucket(action_key, 8)) + _bucket(env.state_key(), 16)


def minigrid_descriptor(env: Any, action_key: str | None) -> list[float]:
    """MiniGrid path shape: the move taken (8 hashed buckets) and the agent's cell (16 hashed buckets)."""
    inner = getattr(env, "_env", None)
    pos = tuple(int(v) for v in getattr(inner, "agent_pos", ())) if inner is not None else None
    cell = _bucket(pos, 16) if pos else _bucket(env.state_key(), 16)
    return ([0.0] * 8 if action_key is None else _bucket(action_key, 8)) + cell


_SOKOBAN_DIRS = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}


def sokoban_descriptor(env: Any, action_key: str | None) -> list[float]:
    """Sokoban: move direction (4), push direction (4, when the cell moved into holds a box), pushed box cell (8)."""
    move, push, box = [0.0] * 4, [0.0] * 4, [0.0] * 8
    if action_key in _SOKOBAN_DIRS:
        k = list(_SOKOBAN_DIRS).index(action_key)
        move[k] = 1.0
        inner = getattr(env, "_env", None)
        if inner is not None and getattr(inner, "room_state", None) is not None:
            r, c = (int(v) for v in inner.player_position)
            dr, dc = _SOKOBAN_DIRS[action_key]
            room = inner.room_state
            if 0 <= r + dr < room.shape[0] and 0 <= c + dc < room.shape[1] and int(room[r + dr, c + dc]) in (3, 4):
                push[k] = 1.0
                box = _bucket((r + dr, c + dc), 8)
    return move + push + box


ALFWORLD_VERBS = ("go", "take", "put", "open", "close", "toggle", "clean", "heat", "cool", "use", "examine",
                  "look", "inventory")


def text_game_descriptor(env: Any, action_key: str | None) -> list[float]:
    """ALFWorld / TextWorld: the command's verb (13 known + other) and the receptacle or object it names (16)."""
    verb, target = [0.0] * (len(ALFWORLD_VERBS) + 1), [0.0] * 16
    if action_key:
        words = action_key.lower().split()
        head = words[0] if words else ""
        verb[ALFWORLD_VERBS.index(head) if head in ALFWORLD_VERBS else len(ALFWORLD_VERBS)] = 1.0
        rest = [w for w in words[1:] if w not in ("to", "in", "on", "from", "with", "the", "a", "in/on")]
        if rest:
            # "go to fridge 1" -> fridge 1; "put apple 1 in/on fridge 1" -> the receptacle (the last object named)
            target = _bucket(" ".join(rest[-2:]), 16)
    return verb + target


def register_descriptor(env_name: str, fn: DescriptorFn) -> None:
    """Use ``fn(env, action_key) -> list[float]`` as the default descriptor of env ``env_name``."""
    if not callable(fn):
        raise ValueError(  # noqa: TRY004 - a bad argument is a ValueError naming it, as elsewhere
            f"register_descriptor({env_name!r}, ...): the descriptor must be callable (env, action_key)")
    _REGISTERED[env_name] = fn


for _name, _fn in (("minigrid", minigrid_descriptor), ("sokoban", sokoban_descriptor),
                   ("alfworld", text_game_descriptor), ("textworld", text_game_descriptor)):
    register_descriptor(_name, _fn)


def _env_name(env: Any) -> str:
    return str(getattr(env, "name", None) or type(env).__module__.rsplit(".", 1)[-1])


def descriptor_function(env: Any, fn: DescriptorFn | None = None) -> DescriptorFn:
    """The descriptor used for ``env``: ``fn`` if given, else the adapter's method, the registered one, the generic."""
    if fn is not None:
        return fn
    own = getattr(env, "descriptor", None)
    if callable(own):
        return lambda e, key: e.descriptor(key)
    return _REGISTERED.get(_env_name(env), generic_descriptor)


def step_descriptor(env: Any, action_key: str | None, fn: DescriptorFn | None = None) -> list[float]:
    """The descriptor of one step (a list of finite floats), checked so a bad user function fails by name."""
    out = [float(x) for x in descriptor_function(env, fn)(env, action_key)]
    if not out or not all(math.isfinite(x) for x in out):
        raise ValueError(f"descriptor of env {_env_name(env)!r} returned {out[:8]}...; it must be a non-empty list of "
                         f"finite numbers")
    return out
