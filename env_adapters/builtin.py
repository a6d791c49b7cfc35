"""The built-in environments, registered through the same ``agentcredit_envs`` hook as any plugin.

Importing this module imports no game package: each adapter imports its package when it is built, and a missing one
is an ``ImportError`` that says ``pip install agentcredit[envs]``.
"""

from credit_plugins.hookspecs import hookimpl

from .base import EnvSpec
from .minigrid import MiniGridAdapter
from .sokoban import SokobanAdapter

BUILTIN = (
    EnvSpec("minigrid", MiniGridAdapter, "MiniGrid grid worlds as text: seeded goal rooms of any size, DoorKey "
                                         "(package minigrid)"),
    EnvSpec("sokoban", SokobanAdapter, "Sokoban rooms from gym-sokoban as text, verl-agent's glyphs and "
                                       "up/down/left/right (package gym-sokoban)"),
)


@hookimpl
def agentcredit_envs():
    return list(BUILTIN)
