"""The built-in environments, registered through the same ``agentcredit_envs`` hook as any plugin.

Importing this module imports no game package: each adapter imports its package when it is built, and a missing one
is an ``ImportError`` that says ``pip install agentcredit[envs]``.
"""

from credit_plugins.hookspecs import hookimpl

from .alfworld import AlfWorldAdapter
from .base import EnvSpec
from .minigrid import MiniGridAdapter
from .sokoban import SokobanAdapter
from .textworld import TextWorldAdapter

BUILTIN = (
    EnvSpec("minigrid", MiniGridAdapter, "MiniGrid grid worlds as text: seeded goal rooms of any size, DoorKey "
                                         "(package minigrid)"),
    EnvSpec("sokoban", SokobanAdapter, "Sokoban rooms from gym-sokoban as text, verl-agent's glyphs and "
                                       "up/down/left/right (package gym-sokoban)"),
    EnvSpec("alfworld", AlfWorldAdapter, "ALFWorld text games (TextWorld-PDDL) from the ALFWorld data folder, "
                                         "seeded game choice, admissible commands (package alfworld; data: "
                                         "alfworld-download)"),
    EnvSpec("textworld", TextWorldAdapter, "TextWorld games generated offline from world_size/nb_objects/"
                                           "quest_length/seed and cached on disk, admissible commands "
                                           "(package textworld)"),
)


@hookimpl
def agentcredit_envs():
    return list(BUILTIN)
