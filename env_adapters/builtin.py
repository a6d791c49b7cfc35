"""The built-in environments, registered through the same ``agentcredit_envs`` hook as any plugin.

Importing this module imports no game package: each adapter imports its package when it is built, and a missing one
is an ``ImportError`` that says ``pip install agentcredit[envs]``.
"""

from credit_plugins.hookspecs import hookimpl

from .alfworld import AlfWorldAdapter
from .base import EnvSpec
from .faulty import FaultyEnv
from .gymnasium_text import GymnasiumTextAdapter
from .minigrid import MiniGridAdapter
from .scienceworld import ScienceWorldAdapter
from .search_qa import SearchQAAdapter
from .sokoban import SokobanAdapter
from .synthetic import SyntheticAdapter
from .textworld import TextWorldAdapter
from .textworld_express import TextWorldExpressAdapter

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
    EnvSpec("synthetic", SyntheticAdapter, "Synthetic text tasks with exact ground truth (families rooms, keydoor, "
                                           "lock, allfail; solver in env_adapters.synthetic_solver; no package)"),
    EnvSpec("scienceworld", ScienceWorldAdapter, "ScienceWorld's 30 science tasks by name and variation, valid "
                                                 "actions, score deltas as rewards (package scienceworld; Java 11+)"),
    EnvSpec("textworld_express", TextWorldExpressAdapter, "TextWorld-Express CookingWorld, TWC and Coin games, "
                                                          "seeded folds, valid actions (package textworld-express; "
                                                          "Java 11+)"),
    EnvSpec("search_qa", SearchQAAdapter, "multi-turn search-then-answer QA over a local BM25 index of a JSONL "
                                          "corpus (default: a generated multi-hop corpus), F1/EM reward "
                                          "(package bm25s)"),
    EnvSpec("gymnasium_text", GymnasiumTextAdapter, "any Gymnasium env as text with an action parser (default: "
                                                    "FrozenLake as a text grid) (package gymnasium)"),
    EnvSpec("faulty", FaultyEnv, "any registered env with injected step latency and faults (raise, hang or exit "
                                 "at a turn), to test and measure fault containment (no package)"),
)


@hookimpl
def agentcredit_envs():
    return list(BUILTIN)
