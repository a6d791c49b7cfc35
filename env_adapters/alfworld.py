"""ALFWorld (text) on the real ``alfworld`` package: the benchmark's TextWorld-PDDL games, one at a time.

Games are collected by alfworld's own ``AlfredTWEnv`` (its filters: task types, ``solvable``, no movable/sliced
trials) from the standard data folder, ``$ALFWORLD_DATA/json_2.1.1/<split>/`` (``train``, ``valid_seen`` = the
benchmark's in-distribution eval, ``valid_unseen`` = out-of-distribution). Each game is played through
``textworld.start`` with the wrappers the benchmark registers (``AlfredDemangler(shuffle=False)``, ``AlfredInfos``),
in-process (the benchmark's gym layer would add a subprocess per env and its own game cycling).

``reset(seed)`` plays game ``seed % num_games`` of the sorted game list, so the same seed is the same game and seeds
0..n-1 enumerate the split. The task text is the game's "Your task is to: ..." line; the welcome banner is stripped
and the observation is the room text. Commands are compared lower-cased with whitespace collapsed (verl-agent's
``alfworld_projection`` lower-cases too) against the admissible commands (without ``help``, as in verl-agent); an
inadmissible command costs ``invalid_penalty`` and is not sent to the game. Reward 10 on the winning step.

**Data.** The real games come from ``alfworld-download`` (GitHub release zips). Missing data is checked for before
any env is built (alfworld's own env would build a 0-game env whose ``reset()`` spins forever) and raises a
``FileNotFoundError`` naming ``alfworld-download``, ``$ALFWORLD_DATA`` and the ``data_dir`` option. Offline tests use
:mod:`env_adapters.alfworld_fixture`.
"""

from __future__ import annotations

import os
import random
from typing import Any

from .base import StepResult, begin_step, episode_seed, missing_package, quiet
from .prompting import INVALID_PENALTY

__all__ = ["AlfWorldAdapter", "SPLITS", "TASK_TYPES", "find_game_files", "MissingAlfWorldData"]

#: split option -> (folder under json_2.1.1, AlfredTWEnv's train_eval)
SPLITS = {"train": ("train", "train"), "valid_seen": ("valid_seen", "eval_in_distribution"),
          "valid_unseen": ("valid_unseen", "eval_out_of_distribution")}
SPLITS["eval_in_distribution"] = SPLITS["valid_seen"]
SPLITS["eval_out_of_distribution"] = SPLITS["valid_unseen"]

#: ALFWorld's task-type ids (config ``env.task_types``), as in alfworld's alfred_tw_env.TASK_TYPES
TASK_TYPES = {1: "pick_and_place_simple", 2: "look_at_obj_in_light", 3: "pick_clean_then_place_in_recep",
              4: "pick_heat_then_place_in_recep", 5: "pick_cool_then_place_in_recep", 6: "pick_two_obj_and_place"}

PREAMBLE = "You are an expert agent operating in the ALFRED Embodied Environment."
STATE_KEYS = ("crbc", "observation", "facts")
#: PDDL predicates that record what the agent looked at, not the world (left out of the ``facts`` key)
_BOOKKEEPING = frozenset({"checked", "examined"})


class MissingAlfWorldData(FileNotFoundError):
    """The ALFWorld data folder has no games for the requested split."""


def _data_root(data_dir: str | os.PathLike | None) -> str:
    if data_dir is not None:
        return os.path.abspath(os.path.expanduser(os.fspath(data_dir)))
    return os.path.abspath(os.path.expanduser(os.environ.get("ALFWORLD_DATA") or "~/.cache/alfworld"))


def _split_dir(root: str, split: str) -> str:
    return os.path.join(root, "json_2.1.1", SPLITS[split][0])


def find_game_files(root: str, split: str) -> bool:
    """True when the split folder holds at least one trial (``traj_data.json`` next to ``game.tw-pddl``); stops at the
    first one, so it is fast even on the full data set."""
    path = _split_dir(root, split)
    if not os.path.isdir(path):
        return False
    for _dir, _subdirs, files in os.walk(path):
        if "traj_data.json" in files and "game.tw-pddl" in files:
            return True
    return False


def _missing_data(root: str, split: str, detail: str) -> MissingAlfWorldData:
    return MissingAlfWorldData(
        f"no ALFWorld games for split {split!r} in {_split_dir(root, split)} ({detail}). Download the data with "
        f"`alfworld-download` (it writes to $ALFWORLD_DATA, default ~/.cache/alfworld; needs github.com), or point "
        f"the 'data_dir' option (or $ALFWORLD_DATA) at a folder holding json_2.1.1/<split>/.../game.tw-pddl "
        f"(env_adapters.alfworld_fixture.write_fixture makes a tiny offline one)")


def _import_alfworld():
    try:
        import textworld
        with quiet():
            from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos, AlfredTWEnv
    except ImportError as e:
        raise missing_package("alfworld", "alfworld") from e
    return textworld, AlfredTWEnv, AlfredDemangler, AlfredInfos


def _config(split_dirs: dict[str, str], task_types: list[int], num_games: int) -> dict[str, Any]:
    """The parts of alfworld's ``base_config.yaml`` that ``AlfredTWEnv`` reads."""
    return {"env": {"type": "AlfredTWEnv", "goal_desc_human_anns_prob": 0, "task_types": task_types,
                    "domain_randomization": False, "expert_type": "handcoded"},
            "dataset": {"data_path": split_dirs["train"], "eval_id_data_path": split_dirs["valid_seen"],
                        "eval_ood_data_path": split_dirs["valid_unseen"], "num_train_games": num_games,
                        "num_eval_games": num_games},
            "general": {"training_method": "dagger"},
            "dagger": {"training": {"max_nb_steps_per_episode": 50}}}


def _normalize(text: str) -> str:
    return " ".join(text.lower().split()).rstrip(".")


class AlfWorldAdapter:
    """ALFWorld text games as an ``AgentEnv``.

    Args:
        data_dir: the ALFWorld data folder (holding ``json_2.1.1/``); None: ``$ALFWORLD_DATA`` (alfworld's default
            ``~/.cache/alfworld`` when unset).
        split: ``train``, ``valid_seen`` (in-distribution eval) or ``valid_unseen`` (out-of-distribution eval).
        task_types: ALFWorld task-type ids (1 pick_and_place_simple, 2 look_at_obj_in_light, 3 pick_clean_then_place,
            4 pick_heat_then_place, 5 pick_cool_then_place, 6 pick_two_obj_and_place); all six by default, as in
            the benchmark config.
        num_games: keep the first ``num_games`` games of the split in path order (alfworld's own
            ``num_train_games`` cut keeps os.walk's order instead); -1 keeps all.
        seed: default seed of :meth:`reset` when called without one (None: a random game).
        state_key: ``crbc`` (default: task + observation + location + held item + sorted admissible commands),
            ``observation`` (verl-agent's GiGPO anchor: the observation text) or ``facts`` (the sorted positive
            PDDL facts without the ``checked``/``examined`` bookkeeping: the world state, however it was reached or
            described).
        success_reward: reward of the winning step.
        invalid_penalty: reward of a step whose command is missing or not admissible (the state does not change).
    """

    #: TextWorld's grammar parser is one module-level object: two threads calling it at once corrupt it
    #: (env_adapters.executor runs such envs' calls one at a time on its thread backend)
    thread_safe = False

    def __init__(self, data_dir: str | None = None, split: str = "train", task_types=(1, 2, 3, 4, 5, 6),
                 num_games: int = -1, seed: int | None = None, state_key: str = "crbc",
                 success_reward: float = 10.0, invalid_penalty: float = INVALID_PENALTY):
        if split not in SPLITS:
            raise ValueError(f"split={split!r}; valid splits: {sorted(SPLITS)}")
        task_types = [int(t) for t in ([task_types] if isinstance(task_types, int) else task_types)]
        bad = [t for t in task_types if t not in TASK_TYPES]
        if not task_types or bad:
            raise ValueError(f"task_types={task_types}; valid ids: {TASK_TYPES}")
        if state_key not in STATE_KEYS:
            raise ValueError(f"state_key={state_key!r}; valid: {list(STATE_KEYS)}")
        self.split, self.task_types, self.seed = split, task_types, seed
        self.state_key_mode = state_key
        self.success_reward, self.invalid_penalty = float(success_reward), float(invalid_penalty)
        self.data_dir = _data_root(data_dir)
        # the guard: alfworld's env with no games builds fine and then spins forever in reset()
        if not find_game_files(self.data_dir, split):
            detail = "folder missing" if not os.path.isdir(_split_dir(self.data_dir, split)) else \
                "no traj_data.json + game.tw-pddl found"
            raise _missing_data(self.data_dir, split, detail)
        self._textworld, tw_env_cls, self._demangler, self._infos_wrapper = _import_alfworld()
        dirs = {s: _split_dir(self.data_dir, s) for s in ("train", "valid_seen", "valid_unseen")}
        with quiet():
            collector = tw_env_cls(_config(dirs, task_types, -1), train_eval=SPLITS[split][1])
        # sorted, so game i is the same on every file system (alfworld keeps os.walk's order)
        self.game_files = sorted(collector.game_files)
        if int(num_games) > 0:
            self.game_files = self.game_files[:int(num_games)]
        if not self.game_files:
            raise _missing_data(self.data_dir, split, f"no solvable game of task types {task_types}")
        self._request = self._textworld.EnvInfos(won=True, admissible_commands=True, facts=True,
                                                 extras=["gamefile"])
        self._env = None
        self._gamefile: str | None = None
        self._state = None
        self._done = True
        self._solved = False
        self.goal = ""
        self.task = PREAMBLE
        self.observation = ""

    @property
    def num_games(self) -> int:
        return len(self.game_files)

    # ---- AgentEnv -------------------------------------------------------------------------------------------
    def reset(self, seed: int | None = None) -> str:
        seed = episode_seed(self.seed if seed is None else seed, "alfworld")
        index = random.randrange(self.num_games) if seed is None else int(seed) % self.num_games
        path = self.game_files[index]
        if self._env is None:
            wrappers = [self._demangler(shuffle=False), self._infos_wrapper]
            self._env = self._textworld.start(path, self._request, wrappers=wrappers)
        elif path != self._gamefile:
            self._env.load(path)
        self._gamefile = path
        self._state = self._env.reset()
        self.observation, self.goal = self._split_intro(self._state.feedback)
        self.task = f"{PREAMBLE} Your task is to: {self.goal}"
        self._done, self._solved = False, False
        return self.observation

    def step(self, action_text: str | None) -> StepResult:
        key, refused = begin_step(self, action_text, lambda: self.observation, lambda: {"gamefile": self._gamefile})
        if refused is not None:
            return refused
        self._state, _score, _done = self._env.step(key)
        self.observation = self._state.feedback.strip()
        self._solved = bool(self._state["won"])
        self._done = self._solved
        reward = self.success_reward if self._solved else 0.0
        return StepResult(self.observation, reward, self._done, self._solved,
                          {"valid": True, "action_key": key, "gamefile": self._gamefile, "won": self._solved})

    def state_key(self) -> str:
        if self._state is None:
            raise RuntimeError("call reset() first")
        if self.state_key_mode == "observation":
            return self.observation
        if self.state_key_mode == "facts":
            return "\n".join(sorted(str(f) for f in self._state["facts"] if f.name not in _BOOKKEEPING
                                     and not f.name.startswith("not_")))
        location, held = self._location_and_held()
        return "\n".join([f"task: {self.goal}", f"observation: {self.observation}", f"location: {location}",
                          f"holding: {held}", "admissible: " + " | ".join(self.legal_actions())])

    def action_key(self, action_text: str | None) -> str | None:
        if not isinstance(action_text, str) or self._state is None:
            return None
        command = _normalize(action_text)
        return command if command in self.legal_actions() else None

    def legal_actions(self) -> list[str]:
        if self._state is None:
            return []
        return [c for c in self._state["admissible_commands"] if c != "help"]

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None

    # ---- helpers --------------------------------------------------------------------------------------------
    @staticmethod
    def _split_intro(feedback: str) -> tuple[str, str]:
        """(observation, goal) of a reset text: the welcome banner dropped, the task line taken out."""
        paragraphs = [p.strip() for p in feedback.strip().split("\n\n") if p.strip()]
        paragraphs = [p for p in paragraphs if not p.startswith("-= Welcome to TextWorld")]
        goal = ""
        kept = []
        for p in paragraphs:
            if p.startswith("Your task is to:"):
                goal = p[len("Your task is to:"):].strip()
            else:
                kept.append(p)
        return "\n\n".join(kept), goal

    def _location_and_held(self) -> tuple[str, str]:
        facts = self._state["facts"]
        loc = {f.arguments[1].name for f in facts if f.name == "atlocation"}
        recs = sorted(f.arguments[0].name.strip() for f in facts
                      if f.name == "receptacleatlocation" and f.arguments[1].name in loc)
        held = sorted(f.arguments[1].name.strip() for f in facts if f.name == "holds")
        return (", ".join(recs) or "middle of the room"), (", ".join(held) or "nothing")

    @property
    def solved(self) -> bool:
        return self._solved
