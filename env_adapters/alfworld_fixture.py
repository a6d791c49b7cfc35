"""Tiny hand-authored ALFWorld games for tests and offline demos (no ``alfworld-download``).

A game is what ``alfworld-generate`` writes: a trial folder with ``traj_data.json`` and ``game.tw-pddl`` (JSON holding
the PDDL domain, the text grammar with the goal text baked in, a PDDL problem, and ``solvable``). The domain and the
grammar are the ones that ship in the alfworld wheel (``alfworld/data/alfred.pddl`` and ``alfred.twl2``); only the
~30-line problem below is hand-written. :func:`write_fixture` lays the games out like the real data set,
``<root>/json_2.1.1/<split>/<task>/<trial>/``, so ``AlfredTWEnv`` and :class:`~env_adapters.alfworld.AlfWorldAdapter`
read them exactly as they read the benchmark.

The room: a countertop 1 with an apple 1 on it, a closed fridge 1, and a closed cabinet 1. One game per
target receptacle: "put some apple in fridge" (expert plan: go to countertop 1, take apple 1 from countertop 1, go to
fridge 1, open fridge 1, move apple 1 to fridge 1) and "put some apple in cabinet".
"""

from __future__ import annotations

import json
import os

__all__ = ["write_fixture", "FIXTURE_GAMES", "expert_plan", "problem_pddl"]

#: game name -> (target receptacle type, task text)
FIXTURE_GAMES = {
    "pick_and_place_simple-Apple-None-Fridge-1": ("Fridge", "put some apple in fridge"),
    "pick_and_place_simple-Apple-None-Cabinet-1": ("Cabinet", "put some apple in cabinet"),
}

_RECEPTACLES = {  # PDDL id -> (type, location, openable)
    "CounterTop_bar_1": ("CounterTop", "loc_bar_2", False),
    "Fridge_bar_1": ("Fridge", "loc_bar_3", True),
    "Cabinet_bar_1": ("Cabinet", "loc_bar_4", True),
}


def problem_pddl(target: str) -> str:
    """The PDDL problem of the fixture room whose goal is an apple in a receptacle of type ``target``."""
    locs = sorted({loc for _, loc, _ in _RECEPTACLES.values()} | {"loc_bar_1"})
    rtypes = sorted({t for t, _, _ in _RECEPTACLES.values()})
    objects = (["agent1 - agent", "Apple_bar_1 - object", "AppleType - otype"]
               + [f"{r} - receptacle" for r in _RECEPTACLES] + [f"{t}Type - rtype" for t in rtypes]
               + [f"{loc} - location" for loc in locs])
    init = ["(atLocation agent1 loc_bar_1)", "(objectType Apple_bar_1 AppleType)", "(pickupable Apple_bar_1)",
            "(moveable Apple_bar_1)", "(cleanable Apple_bar_1)", "(heatable Apple_bar_1)", "(coolable Apple_bar_1)",
            "(inReceptacle Apple_bar_1 CounterTop_bar_1)", "(objectAtLocation Apple_bar_1 loc_bar_2)"]
    for r, (t, loc, openable) in _RECEPTACLES.items():
        init += [f"(receptacleType {r} {t}Type)", f"(receptacleAtLocation {r} {loc})",
                 f"(canContain {t}Type AppleType)"]
        if openable:
            init.append(f"(openable {r})")
    goal = (f"(exists (?r - receptacle ?o - object) (and (inReceptacle ?o ?r) (objectType ?o AppleType) "
            f"(receptacleType ?r {target}Type)))")
    return ("(define (problem plan_fixture)\n(:domain alfred)\n(:objects\n  " + "\n  ".join(objects)
            + "\n)\n(:init\n  " + "\n  ".join(init) + "\n)\n(:goal " + goal + ")\n)\n")


def expert_plan(target: str = "Fridge") -> list[str]:
    """A winning command sequence of the fixture game with receptacle type ``target``."""
    r = f"{target.lower()} 1"
    return ["go to countertop 1", "take apple 1 from countertop 1", f"go to {r}", f"open {r}",
            f"move apple 1 to {r}"]


def write_fixture(root: str | os.PathLike, splits: tuple[str, ...] = ("train",),
                  games: tuple[str, ...] | None = None) -> str:
    """Write the fixture games under ``root`` in the ALFWorld data layout and return ``root`` (use it as
    ``$ALFWORLD_DATA`` or the adapter's ``data_dir``). Needs the alfworld package (for its domain and grammar)."""
    from alfworld.info import ALFRED_PDDL_PATH, ALFRED_TWL2_PATH

    with open(ALFRED_PDDL_PATH) as f:
        domain = f.read()
    with open(ALFRED_TWL2_PATH) as f:
        grammar = f.read()
    root = os.fspath(root)
    for split in splits:
        for name in games or tuple(FIXTURE_GAMES):
            target, task = FIXTURE_GAMES[name]
            trial = os.path.join(root, "json_2.1.1", split, name, "trial_T00000000_000000_000000")
            os.makedirs(trial, exist_ok=True)
            traj = {"task_type": "pick_and_place_simple", "task_id": "fixture", "scene": {"floor_plan": "FloorPlan1"},
                    "pddl_params": {"object_target": "Apple", "parent_target": target, "toggle_target": "",
                                    "mrecep_target": "", "object_sliced": False},
                    "turk_annotations": {"anns": [{"task_desc": task.capitalize() + "."}]}}
            game = {"pddl_domain": domain, "grammar": grammar.replace("UNKNOWN GOAL", task),
                    "pddl_problem": problem_pddl(target), "solvable": True, "walkthrough": expert_plan(target)}
            with open(os.path.join(trial, "traj_data.json"), "w") as f:
                json.dump(traj, f, indent=1)
            with open(os.path.join(trial, "game.tw-pddl"), "w") as f:
                json.dump(game, f)
    return root
