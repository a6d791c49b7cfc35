"""Play an ``AgentEnv`` with a policy and record the rows a ``credit_plugins.StepTable`` needs::

    rec = TrajectoryRecorder(max_steps=8)
    for _ in range(4):                                   # G = 4 rollouts of one task: same env options, same seed
        rec.rollout(env, policy, seed=0, group=0)        # policy(prompt) -> "<think>...</think><action>...</action>"
    advantages = credit_plugins.get("gigpo")(rec.to_step_table())

One row per step: ``state`` is the stable hash of ``env.state_key()`` taken **before** the action, ``action`` the
stable hash of ``env.action_key(parsed)`` (-1 when invalid), ``reward`` the env's r_t; ``success`` and
``truncated`` (no terminal state within ``max_steps``) are broadcast to every row of the rollout.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from credit_plugins.hashing import stable_hash
from credit_plugins.steptable import StepTable

from .base import AgentEnv
from .prompting import build_prompt, parse_action

__all__ = ["StepRecord", "Trajectory", "TrajectoryRecorder", "step_table", "Policy"]

Policy = Callable[[str], str]


@dataclass
class StepRecord:
    """One agent decision: the prompt it saw, its response, and the StepTable fields of the row."""

    t: int
    state_key: str
    observation: str
    prompt: str
    response: str
    action_text: str | None   # the parsed <action> text (None: no parseable block)
    action_key: str | None    # the env's canonical command (None: invalid)
    reward: float
    valid: bool

    @property
    def state(self) -> int:
        return stable_hash(self.state_key)

    @property
    def action(self) -> int:
        return -1 if self.action_key is None else stable_hash(self.action_key)


@dataclass
class Trajectory:
    """One rollout: its rows, and how it ended."""

    group: int
    traj: int
    seed: int | None
    steps: list[StepRecord] = field(default_factory=list)
    success: bool = False
    truncated: bool = False

    @property
    def total_reward(self) -> float:
        return float(sum(s.reward for s in self.steps))


def step_table(trajectories: Iterable[Trajectory]) -> StepTable:
    """The ``StepTable`` of ``trajectories`` (one row per recorded step)."""
    cols: dict[str, list] = {k: [] for k in StepTable.FIELDS}
    for tr in trajectories:
        for s in tr.steps:
            cols["group"].append(int(tr.group))
            cols["traj"].append(int(tr.traj))
            cols["t"].append(s.t)
            cols["state"].append(s.state)
            cols["action"].append(s.action)
            cols["reward"].append(s.reward)
            cols["success"].append(tr.success)
            cols["truncated"].append(tr.truncated)
    return StepTable(**cols)


class TrajectoryRecorder:
    """Runs rollouts and keeps them; :meth:`to_step_table` turns all of them into one ``StepTable``.

    Args:
        max_steps: step limit of a rollout; a rollout still running after it is ``truncated``.
        history_length: past steps shown in each prompt (:func:`env_adapters.prompting.build_prompt`).
    """

    def __init__(self, max_steps: int = 20, history_length: int = 2):
        if max_steps < 1:
            raise ValueError(f"max_steps={max_steps}; a rollout needs at least one step")
        self.max_steps = int(max_steps)
        self.history_length = int(history_length)
        self.trajectories: list[Trajectory] = []
        self._ids = itertools.count()

    def rollout(self, env: AgentEnv, policy: Policy, seed: int | None = None, group: int = 0,
                traj: int | None = None) -> Trajectory:
        """Play one episode of ``env`` from ``reset(seed)`` with ``policy(prompt) -> response``; record and return it.

        Rollouts of one ``group`` should start from the same state (same env options and seed).
        """
        traj = next(self._ids) if traj is None else int(traj)
        record = Trajectory(group=int(group), traj=traj, seed=seed)
        observation = env.reset(seed)
        history: list[tuple[str, str | None]] = []
        legal = getattr(env, "legal_actions", None)
        done = False
        for t in range(self.max_steps):
            key_before = env.state_key()
            prompt = build_prompt(getattr(env, "task", ""), history, observation,
                                  legal() if legal is not None else None, self.history_length)
            response = policy(prompt)
            action_text = parse_action(response)
            action_key = env.action_key(action_text) if action_text is not None else None
            result = env.step(action_text)
            record.steps.append(StepRecord(t=t, state_key=key_before, observation=observation, prompt=prompt,
                                           response=response if isinstance(response, str) else repr(response),
                                           action_text=action_text, action_key=action_key,
                                           reward=float(result.reward), valid=action_key is not None))
            history.append((observation, action_key))
            observation = result.observation
            if result.done:
                record.success = bool(result.success)
                done = True
                break
        record.truncated = not done
        self.trajectories.append(record)
        return record

    def to_step_table(self) -> StepTable:
        return step_table(self.trajectories)

    def clear(self) -> None:
        self.trajectories.clear()
