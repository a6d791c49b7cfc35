"""``goal_rankings`` (EVOKE's env capability): hand-computed values on the synthetic families and MiniGrid rooms,
the prompt rewrite, the shared contract and refusals."""

import random

import pytest

import env_adapters
from env_adapters.base import GOAL_GAMMA, GoalRanking
from env_adapters.prompting import rewrite_goal
from env_adapters.synthetic_solver import alt_goals, goal_values, make_task
from tests.helpers.env_contract import check_goal_rankings

g = GOAL_GAMMA


def _by_goal(env, goal):
    found = [r for r in env.goal_rankings(1000, random.Random(0)) if r.goal == goal]
    assert len(found) == 1, [r.goal for r in env.goal_rankings(1000, random.Random(0))]
    return dict(zip(found[0].actions, found[0].values))


def test_allfail_hand_computed():
    env = env_adapters.make("synthetic", family="allfail", seed=0)
    env.reset(0)
    v = _by_goal(env, "Stand on stone 2 of the bridge without falling into the pit.")
    # stone 0: forward -> stone 1 (1 step from 2); wait / look down / step back stay on stone 0 (2 steps)
    assert v == pytest.approx({"step forward": g, "wait": g**2, "look down": g**2, "step back": g**2})
    for _ in range(6):
        env.step("step forward")
    v = _by_goal(env, "Stand on stone 4 of the bridge without falling into the pit.")
    # stone 6: back -> 5 (1 step), wait (2), forward -> 7 (3), jump -> the pit (never)
    assert v == pytest.approx({"step back": g, "wait": g**2, "step forward": g**3, "jump": 0.0})


def test_lock_codes_keep_the_entered_prefix():
    task = make_task("lock", 0)
    code = [next(k for k in range(3) if task.next_state[j, k] == (j + 1 if j < 3 else task.goal)) for j in range(4)]
    env = env_adapters.make("synthetic", family="lock", seed=0)
    env.reset(0)
    buttons = [a for a in env.legal_actions() if a.startswith("press")]
    env.step(buttons[code[0]])
    env.step(buttons[code[1]])
    goals = alt_goals(task, 2)
    assert len(goals) == 3**2 - 1  # the last two digits change, the entered two stay
    prefix = ", ".join(buttons[k][6:] for k in code[:2])
    assert all(goal.text.startswith(f"Open the combination lock with the code {prefix}, ") for goal in goals)
    for r in env.goal_rankings(8, random.Random(1)):
        third = r.goal.split("code ")[1].split(", ")[2]
        v = dict(zip(r.actions, r.values))
        # the alternative code's third button: 2 digits left (one more press, then the last); a wrong one resets
        # to 0 (4 presses), looking stays at 2 entered (2 presses)
        assert v[f"press {third}"] == pytest.approx(g**1)
        assert v["look at the lock"] == pytest.approx(g**2)
        assert all(v[b] == pytest.approx(g**4) for b in buttons if b != f"press {third}")


def test_keydoor_same_state_other_goal_other_best_action():
    env = env_adapters.make("synthetic", family="keydoor", seed=0)
    env.reset(0)
    key_room = next(a for a in env.legal_actions() if a.startswith("go to")
                    and "A key lies" in _peek(env, a))
    env.step(key_room)
    here = key_room[len("go to "):]
    with_key = _by_goal(env, f"Take the key, then go to {here}.")
    assert with_key["take the key"] == 1.0 and max(with_key, key=with_key.get) == "take the key"
    elsewhere = [r for r in env.goal_rankings(1000, random.Random(0)) if r.goal.startswith("Go to")]
    assert elsewhere
    for r in elsewhere:  # going somewhere without the key: taking it is a wasted step, a door is best
        v = dict(zip(r.actions, r.values))
        assert v["take the key"] == pytest.approx(v["look around"]) and max(v.values()) > v["take the key"]


def _peek(env, action):
    snap = env.snapshot()
    obs = env.step(action).observation
    env.restore(snap)
    return obs


def test_rooms_values_are_discounted_bfs_distances():
    task = make_task("rooms", 3)
    for s in range(task.n_states):
        if s in (task.goal, task.trap):
            continue
        for goal in alt_goals(task, s):
            assert s not in goal.targets
            q = goal_values(task, goal)
            target = goal.targets[0]
            for a in range(int(task.n_actions[s])):
                nxt = int(task.next_state[s, a])
                if nxt == target:
                    assert q[s, a] == 1.0
                elif nxt in (task.goal, task.trap):
                    assert q[s, a] == 0.0
                elif nxt == s:  # a self-loop is one step wasted
                    assert q[s, a] == pytest.approx(g * q[s].max())


@pytest.mark.parametrize("family", ["rooms", "keydoor", "lock", "allfail"])
def test_synthetic_contract(family):
    env = env_adapters.make("synthetic", family=family, seed=1)
    for r in check_goal_rankings(env, 1):
        assert r.edits[0][0] in env.task  # the task sentence is what changes


def test_minigrid_absolute_hand_computed():
    env = env_adapters.make("minigrid", size=5, seed=0, moves="absolute", view="coords")
    assert env.reset(0) == "You are at row 3, column 2. The goal is at row 1, column 2."
    v = _by_goal(env, "Get to row 3, column 3.")
    # right enters it; down is a wall (stay, 1 step); up / left move away (2 steps)
    assert v == pytest.approx({"right": 1.0, "down": g, "up": g**2, "left": g**2})
    r = [r for r in env.goal_rankings(100, random.Random(0)) if r.goal == "Get to row 3, column 3."][0]
    assert r.rewrite(env.render()) == "You are at row 3, column 2. The goal is at row 3, column 3."


def test_minigrid_relative_hand_computed_and_drawing():
    env = env_adapters.make("minigrid", size=5, seed=0)
    env.reset(0)
    assert "facing north" in env.render()
    v = _by_goal(env, "Get to row 3, column 3.")
    # facing north at (row 3, col 2), goal to the east: right then forward (1 after the turn); left: 2 turns + 1;
    # forward to row 2: turn, forward, turn, forward
    assert v == pytest.approx({"turn right": g, "turn left": g**3, "move forward": g**4})
    r = [r for r in env.goal_rankings(100, random.Random(0)) if r.goal == "Get to row 3, column 3."][0]
    drawn = r.rewrite(env.render()).splitlines()
    assert drawn[1] == "#...#" and drawn[3] == "#.^G#"  # the goal moved; the agent and walls did not


@pytest.mark.parametrize("opts", [dict(moves="absolute", view="coords"), dict(moves="absolute", view="offset"),
                                  dict(moves="absolute"), dict(), dict(size=6, n_walls=3)])
def test_minigrid_contract(opts):
    env = env_adapters.make("minigrid", seed=0, **{"size": 5, **opts})
    check_goal_rankings(env, 0)


def test_refusals():
    env = env_adapters.make("minigrid", size=5, task="doorkey")
    env.reset(0)
    with pytest.raises(ValueError, match="task='goal'"):
        env.goal_rankings(2, random.Random(0))
    env = env_adapters.make("synthetic", family="rooms")
    env.reset(0)
    with pytest.raises(ValueError, match="k=0"):
        env.goal_rankings(0, random.Random(0))
    with pytest.raises(ValueError, match="does not contain"):
        rewrite_goal("a prompt", (("the chest", "the attic"),))
    with pytest.raises(ValueError, match="2 actions but 1 values"):
        GoalRanking("x", (), ("a", "b"), (1.0,))


def test_finished_episode_has_no_rankings():
    env = env_adapters.make("synthetic", family="allfail", seed=0)
    env.reset(0)
    for _ in range(10):
        r = env.step("step forward")
    assert r.success and env.goal_rankings(3, random.Random(0)) == []
