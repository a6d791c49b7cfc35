"""The environment-factory bridge: an env of :mod:`env_adapters` as a class for TRL's own tool loop,
``GRPOTrainer(environment_factory=...)`` (one training row per episode; :func:`environment_factory`).

One tool per action of a fixed action set (minigrid, sokoban: ``up``, ``move_forward``, ...), or ``act(command)``
for free-text games; each instance records the turns the credit mixin reads (``agentcredit_turns``). The other bridge,
one row per turn, is :class:`agentcredit.trl.rollouts.TurnRollout`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from credit_plugins.hashing import stable_hash

from .prompts import legal_actions

__all__ = ["environment_factory"]

#: the user message of every dataset row (TRL appends ``reset``'s text to it)
_FACTORY_PROMPT = "Play the game. Call one tool per turn."
_TOOL_DOCS = {
    "up": "Move one cell up (row - 1).",
    "down": "Move one cell down (row + 1).",
    "left": "Move one cell left (column - 1).",
    "right": "Move one cell right (column + 1).",
    "turn left": "Turn 90 degrees to the left without moving.",
    "turn right": "Turn 90 degrees to the right without moving.",
    "move forward": "Move one cell in the direction you face.",
    "pick up": "Pick up the object in front of you.",
    "open door": "Open (toggle) the door in front of you.",
}
_RESERVED = {"reset", "get_reward", "dataset", "act"}


def _tool_name(action: str) -> str:
    name = re.sub(r"\W", "_", action.strip().lower().replace(" ", "_"))
    if not name or name[0].isdigit():
        name = "a_" + name
    return name


def environment_factory(env: str, **env_options) -> type:
    """A class for ``GRPOTrainer(environment_factory=cls)`` that plays ``env_adapters.make(env, **env_options)``.

    Tools: one method per action when the env has a fixed action set (a ``legal`` tuple, e.g. minigrid and
    sokoban: ``up``, ``move_forward``, ...; no arguments), else ``act(command: str)``. ``reset(**row)`` uses the
    row's ``seed`` and returns the task, the first observation and the actions (TRL appends it to the user message).

    Records (read by the credit mixin), on each instance: ``agentcredit_turns`` (one dict per tool call executed on
    the env: ``state`` = stable hash of ``state_key()`` before and ``state_text`` that key itself, ``action`` =
    stable hash of the action key or -1, ``reward``, ``valid``; a call after the episode ended is answered "episode
    is over" and not recorded), ``agentcredit_final_state`` (and ``agentcredit_final_state_text``),
    ``agentcredit_success``, ``agentcredit_done``. ``get_reward()`` is the episode return.
    """
    import env_adapters

    probe = env_adapters.make(env, **env_options)
    legal = getattr(probe, "legal", None)
    fixed = (isinstance(legal, (tuple, list)) and len(legal) > 0 and all(isinstance(a, str) for a in legal))
    cls_name = "".join(p.capitalize() for p in re.split(r"\W+", env) if p) + "ToolEnv"

    def __init__(self):
        self._env = env_adapters.make(env, **env_options)
        self.agentcredit_turns = []
        self.agentcredit_final_state = 0
        self.agentcredit_final_state_text = None
        self.agentcredit_success = False
        self.agentcredit_done = True
        self._return = 0.0

    def _describe(self, observation: str, first: bool = False) -> str:
        parts = [getattr(self._env, "task", "").strip()] if first else []
        parts.append(observation)
        acts = legal_actions(self._env)
        if acts:
            parts.append(("Tools: " + ", ".join(_tool_name(a) for a in acts)) if fixed
                         else ("Admissible commands: " + ", ".join(acts)))
        return "\n".join(p for p in parts if p)

    def reset(self, **row) -> str:
        seed = row.get("seed")
        obs = self._env.reset(None if seed is None else int(seed))
        self.agentcredit_turns = []
        self.agentcredit_final_state_text = self._env.state_key()
        self.agentcredit_final_state = stable_hash(self.agentcredit_final_state_text)
        self.agentcredit_success = False
        self.agentcredit_done = False
        self._return = 0.0
        return "\n\n" + self._describe(obs, first=True)

    def _act(self, action: str | None) -> str:
        if self.agentcredit_done:
            return "The episode is over. Reward 0."
        text = self._env.state_key()
        key = self._env.action_key(action)
        res = self._env.step(action)
        self.agentcredit_turns.append({"state": int(stable_hash(text)), "state_text": text,
                                       "action": -1 if key is None else int(stable_hash(key)),
                                       "reward": float(res.reward), "valid": key is not None})
        self._return += float(res.reward)
        self.agentcredit_final_state_text = self._env.state_key()
        self.agentcredit_final_state = stable_hash(self.agentcredit_final_state_text)
        self.agentcredit_done = bool(res.done)
        self.agentcredit_success = bool(res.success)
        if key is None:
            return "Invalid action.\n" + self._describe(res.observation)
        if res.done:
            return res.observation + ("\nYou solved the task. The episode is over." if res.success
                                      else "\nThe episode is over.")
        return self._describe(res.observation)

    def get_reward(self, **kwargs) -> float:
        return float(self._return)

    @classmethod
    def dataset(cls, seeds: Iterable[int]):
        from datasets import Dataset

        seeds = [int(s) for s in seeds]
        return Dataset.from_dict({"prompt": [[{"role": "user", "content": _FACTORY_PROMPT}] for _ in seeds],
                                  "seed": seeds})

    attrs: dict[str, Any] = {"__init__": __init__, "reset": reset, "get_reward": get_reward, "_act": _act,
                             "_describe": _describe, "dataset": dataset, "env_name": env,
                             "env_options": dict(env_options), "fixed_actions": tuple(legal) if fixed else None,
                             "__doc__": f"TRL environment for {env!r} ({env_options}); built by "
                                        f"agentcredit.trl.env_factory.environment_factory."}
    if fixed:
        for action in legal:
            name = _tool_name(action)
            if name in _RESERVED or name in attrs:
                raise ValueError(f"action {action!r} of env {env!r} gives the tool name {name!r}, which is taken")

            fn = _bind_action(action)  # f(self) -> str: TRL builds the schema from the signature
            fn.__name__ = name
            fn.__qualname__ = f"{cls_name}.{name}"
            fn.__doc__ = (f"{_TOOL_DOCS.get(action, f'Take the action {action!r} in the game.')}\n\n"
                          f"Returns:\n    The observation after the action.\n")
            attrs[name] = fn
    else:
        def act(self, command: str) -> str:
            """Send one text command to the game.

            Args:
                command: one of the admissible commands listed in the observation.

            Returns:
                The game's response.
            """
            return self._act(command)

        act.__qualname__ = f"{cls_name}.act"
        attrs["act"] = act
    for name in ("__init__", "reset", "get_reward", "_act", "_describe"):
        attrs[name].__qualname__ = f"{cls_name}.{name}"
    cls = type(cls_name, (), attrs)
    cls.__module__ = __name__
    return cls


def _bind_action(action: str):
    """A fresh function ``f(self) -> str`` that calls ``self._act(action)`` (no extra parameters in its signature)."""
    def f(self) -> str:
        return self._act(action)
    return f
