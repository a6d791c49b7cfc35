"""The env side of one agent turn, as functions of the env that an :class:`env_adapters.executor.EnvHandle` runs
wherever the env lives (one round trip each, picklable by reference for the ``process`` and ``ray`` backends).

* :func:`start` resets (and for a tree's fork restores a snapshot) and returns the first observation;
* :func:`observe` returns what a prompt needs at the decision state: ``state_key()``, ``legal_actions()`` and the
  task;
* :func:`act` parses nothing: given the model's action text it computes the decision-state extras (``extras``: a
  function of ``(env, action_text, *extras_args)``, e.g. ASCT's decision table; ``descriptors``: TJPO's descriptor),
  the canonical action, optionally a snapshot of the decision state, then steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["start", "observe", "act", "counterfactual_row", "play_random", "Turn", "View"]


def start(env, seed: int | None, snapshot: Any = None, require_search: str | None = None) -> tuple[str, str]:
    """``env.reset(seed)``; with ``snapshot``, then ``env.restore(snapshot)`` and the restored state's observation
    (``render()`` where the env has it, else its ``state_key()``). Returns ``(observation, env.task)`` (the task
    text may change with the reset: ALFWorld's game). ``require_search``: refuse an env without
    snapshot/restore/legal_actions, naming that caller."""
    if require_search is not None:
        from .search import require_search_env

        require_search_env(env, require_search)
    observation = env.reset(seed)
    if snapshot is not None:
        env.restore(snapshot)
        observation = env.render() if hasattr(env, "render") else env.state_key()
    return observation, getattr(env, "task", "")


class View(NamedTuple):
    """The decision state as a prompt reads it: what :func:`observe` returns."""

    state_key: str
    legal: list[str] | None  # None: the env has no legal_actions()
    task: str


def observe(env) -> View:
    """The decision state: ``state_key()``, ``legal_actions()`` (None without it) and the ``task`` text."""
    legal = getattr(env, "legal_actions", None)
    return View(env.state_key(), list(legal()) if callable(legal) else None, getattr(env, "task", ""))


class Turn(NamedTuple):
    """What :func:`act` returns."""

    action_key: str | None
    extras: dict[str, Any]
    result: Any           # the env's StepResult
    snapshot: Any         # the decision state's snapshot (None unless asked for)


def act(env, action_text: str | None, extras: Callable | None = None, extras_args: tuple = (),
        descriptors: bool = False, snapshot: bool = False) -> Turn:
    """At the decision state: the canonical action (``action_key``), ``extras(env, action_text, *extras_args)``,
    TJPO's descriptor when ``descriptors``, a snapshot when ``snapshot``; then ``env.step(action_text)``."""
    key = env.action_key(action_text) if action_text is not None else None
    more = dict(extras(env, action_text, *extras_args)) if extras is not None else {}
    if descriptors:
        from .descriptors import DESCRIPTOR, step_descriptor

        more[DESCRIPTOR] = step_descriptor(env, key)
    snap = env.snapshot() if snapshot else None
    return Turn(key, more, env.step(action_text), snap)


def counterfactual_row(env, action_text: str | None, evaluator, invalid_utility: float) -> dict[str, Any]:
    """ASCT's decision-table extras of one turn with the uniform baseline ``p = 1/|A(s)|`` (the evaluator's
    ``budget`` env-only trials from a snapshot of the decision state; :func:`env_adapters.search.decision_row`)."""
    from .search import decision_row, require_search_env

    require_search_env(env, "agentcredit_counterfactual (ASCT)")
    values = evaluator.evaluate(env)
    n = len(values.actions)
    return decision_row(env, values, action_text, [1.0 / n] * n, n + 1, invalid_utility)


def play_random(env, seed: int | None, steps: int, rng_seed: int) -> int:
    """Reset to ``seed``, then ``steps`` uniformly random legal actions (a ``random.Random(rng_seed)`` stream),
    resetting when an episode ends; returns the steps played (the throughput benchmark's workload)."""
    import random

    rng = random.Random(rng_seed)
    env.reset(seed)
    for _ in range(steps):
        legal = env.legal_actions()
        if env.step(legal[rng.randrange(len(legal))]).done:
            env.reset(seed)
    return steps
