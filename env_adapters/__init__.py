"""Environment adapters: one ``AgentEnv`` protocol, environments that emit the step metadata estimators need.

Environments register through the ``agentcredit_envs`` hook of :mod:`credit_plugins.hookspecs`; :func:`make` builds
one by name with keyword options, :func:`available` lists them. Built in: ``minigrid`` and ``sokoban``
(``pip install agentcredit[envs]``); :class:`TrajectoryRecorder` plays one with a policy and gives a ``StepTable``.

    >>> import env_adapters
    >>> env = env_adapters.make("minigrid", size=5, seed=0)      # doctest: +SKIP
    >>> print(env.reset())                                       # doctest: +SKIP
"""

from credit_plugins import registry

from .base import AgentEnv, EnvSpec, StepResult
from .prompting import INVALID_PENALTY, build_prompt, format_action, parse_action
from .recorder import StepRecord, Trajectory, TrajectoryRecorder, step_table

__all__ = ["available", "make", "AgentEnv", "StepResult", "EnvSpec", "TrajectoryRecorder", "Trajectory",
           "StepRecord", "step_table", "parse_action", "build_prompt", "format_action", "INVALID_PENALTY"]


def available() -> list[str]:
    return registry.available("envs")


def make(name: str, **options):
    """Build the environment ``name`` with ``options`` (the registered item is called as a factory)."""
    return registry.get(name, kind="envs")(**options)
