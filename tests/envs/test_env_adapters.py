"""The built-in environment adapters on the real games (minigrid, gym-sokoban): no mocks."""

import random
import subprocess
import sys
import threading
from collections import deque

import numpy as np
import pytest
import torch

import credit_plugins as cp
import env_adapters
from env_adapters import (INVALID_PENALTY, AgentEnv, TrajectoryRecorder, build_prompt, format_action, parse_action,
                          step_table)

try:  # the games are the [envs] extra
    import minigrid  # noqa: F401

    from env_adapters.sokoban import _import_sokoban_env
    _import_sokoban_env()
except ImportError as e:
    pytest.skip(f"needs the environment packages (pip install agentcredit[envs]): {e}", allow_module_level=True)

# small games: MiniGrid 5x5 goal room, DoorKey 5x5, Sokoban 6x6 with one box
GAMES = {
    "minigrid": dict(size=5),
    "doorkey": dict(size=5, task="doorkey"),
    "sokoban": dict(size=6, num_boxes=1),
}


def make(game, **extra):
    name = "sokoban" if game == "sokoban" else "minigrid"
    return env_adapters.make(name, **GAMES[game], **extra)


def scripted(actions):
    """A policy that answers the given action texts in order (None: an unparseable response)."""
    it = iter(actions)

    def policy(prompt):
        a = next(it)
        return "I am not sure what to do" if a is None else format_action(a, think="scripted")
    return policy


def bfs_plan(env, seed, max_nodes=20000):
    """Shortest list of legal actions from reset(seed) to success, found with snapshot/restore."""
    env.reset(seed)
    start = env.snapshot()
    seen = {env.state_key()}
    queue = deque([(start, [])])
    while queue and len(seen) < max_nodes:
        snap, plan = queue.popleft()
        for a in env.legal_actions():
            env.restore(snap)
            res = env.step(a)
            if res.success:
                return plan + [a]
            key = env.state_key()
            if not res.done and key not in seen:
                seen.add(key)
                queue.append((env.snapshot(), plan + [a]))
    raise AssertionError(f"no solution found from seed {seed}")


def two_paths_to_one_state(env, seed):
    """Two different action sequences from reset(seed) that end in the same game state (not the start)."""
    env.reset(seed)
    first = {env.state_key(): []}
    queue = deque([(env.snapshot(), [])])
    while queue:
        snap, plan = queue.popleft()
        for a in env.legal_actions():
            env.restore(snap)
            res = env.step(a)
            key = env.state_key()
            if res.done:
                continue
            if key in first:
                if first[key] and first[key] != plan + [a]:
                    return first[key], plan + [a]
                continue
            first[key] = plan + [a]
            queue.append((env.snapshot(), plan + [a]))
    raise AssertionError("every state is reached by one path only")


# ---- prompt/parse layer ------------------------------------------------------------------------------------------
def test_parse_action_takes_the_last_action_block_stripped():
    assert parse_action("<think>x</think><action>  move   forward </action>") == "move forward"
    assert parse_action("<action>up</action> then <action>left</action>") == "left"
    assert parse_action("<think>hm</think> up") is None
    assert parse_action("<action>   </action>") is None
    assert parse_action("<action>up") is None
    assert parse_action(None) is None


def test_build_prompt_shows_only_the_last_history_length_steps():
    history = [(f"obs{i}", f"act{i}") for i in range(5)] + [("obs5", None)]
    prompt = build_prompt("TASK", history, "NOW", ["up", "down"], history_length=2)
    assert prompt.startswith("TASK")
    assert "already taken 6 step(s)" in prompt
    assert "obs4" in prompt and "obs5" in prompt and "(invalid)" in prompt and "obs3" not in prompt
    assert "NOW" in prompt and '["up", "down"]' in prompt and "<action> </action>" in prompt
    assert "obs5" not in build_prompt("TASK", history, "NOW", None, history_length=0)


# ---- the AgentEnv contract ---------------------------------------------------------------------------------------
def test_registry_lists_both_builtins_and_the_cli_shows_their_provider():
    assert {"minigrid", "sokoban"} <= set(env_adapters.available())
    out = subprocess.run([sys.executable, "-m", "agentcredit.cli", "list", "envs"], capture_output=True,
                         text=True, check=True).stdout
    for name in ("minigrid", "sokoban"):
        line = next(line for line in out.splitlines() if line.strip().startswith(name))
        assert "builtin_envs" in line and "(package" in line


@pytest.mark.parametrize("game", GAMES)
def test_adapters_satisfy_the_agent_env_protocol(game):
    env = make(game)
    assert isinstance(env, AgentEnv)
    assert env.task and env.legal_actions()


@pytest.mark.parametrize("game", GAMES)
def test_same_seed_gives_same_initial_observation_and_state_key(game):
    a, b = make(game), make(game)
    obs_a, obs_b = a.reset(3), b.reset(3)
    assert obs_a == obs_b and a.state_key() == b.state_key()
    b.step(b.legal_actions()[0])
    assert b.reset(3) == obs_a  # a reset restores the seeded layout after play


@pytest.mark.parametrize("game", ["minigrid", "sokoban"])
def test_different_seeds_give_different_layouts(game):
    env = make(game)
    assert len({env.reset(s) for s in range(6)}) > 1


def test_make_seed_option_is_the_default_reset_seed():
    env = env_adapters.make("minigrid", size=5, seed=0)
    assert env.reset() == env.reset(0)
    assert env_adapters.make("minigrid", size=7).reset(0).count("\n") == 7  # 7 grid rows + the status line


def test_minigrid_coords_and_offset_views_share_the_short_instruction():
    grid, coords, offset = (env_adapters.make("minigrid", size=5, moves="absolute", view=view)
                            for view in ("grid", "coords", "offset"))
    assert coords.task == offset.task != grid.task
    assert coords.task.startswith("Reach the goal.") and "#" not in coords.task  # no map legend without a map
    assert coords.reset(0).startswith("You are at row") and offset.reset(0).startswith("Goal offset: row")


def test_sokoban_reset_leaves_the_global_random_state_alone():
    np.random.seed(123)
    random.seed(123)
    expected = (np.random.rand(), random.random())
    np.random.seed(123)
    random.seed(123)
    make("sokoban").reset(5)
    assert (np.random.rand(), random.random()) == expected


def test_sokoban_rooms_reset_at_once_on_threads_are_each_seeds_room_and_stdout_stays():
    """The verl agent loop's thread backend builds and resets many envs at once: each reset still gets its seed's room
    (the global generators it seeds are held by one lock; without it 44 of 200 rooms came out different), and the
    process's stdout / stderr are its own afterwards (the build's import silencing swaps them under one lock)."""
    seeds = list(range(24))
    expected = {s: make("sokoban").reset(s) for s in seeds}
    out, err = sys.stdout, sys.stderr
    got, errors = {}, []

    def play(part):
        try:
            for s in part:
                got[s] = make("sokoban").reset(s)
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(repr(e))

    for _ in range(3):
        threads = [threading.Thread(target=play, args=(seeds[i::4],)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and got == expected
    assert sys.stdout is out and sys.stderr is err


def test_quiet_blocks_entered_on_two_threads_nest_and_give_the_streams_back():
    """Thread A enters ``quiet``; thread B tries to enter while A is inside. Unlocked, B would enter, A would leave
    first and B would then restore A's buffer as the process's stdout for good; with the lock B waits for A."""
    from env_adapters.base import quiet

    out, err = sys.stdout, sys.stderr
    a_in, b_in, a_done = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with quiet():
            print("dropped")
            a_in.set()
            seen["b entered while a was inside"] = b_in.wait(timeout=0.5)
            a_done.set()  # the last thing inside A's block: set before A's block releases the lock

    def second():
        a_in.wait()
        with quiet():
            b_in.set()
            seen["a's block had ended"] = a_done.is_set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"b entered while a was inside": False, "a's block had ended": True}
    assert sys.stdout is out and sys.stderr is err


@pytest.mark.parametrize("game", ["minigrid", "sokoban"])
def test_same_game_state_has_the_same_key_whatever_the_history(game):
    env = make(game)
    path_a, path_b = two_paths_to_one_state(env, seed=1)
    assert path_a != path_b
    n = max(len(path_a), len(path_b)) + 1
    rec = TrajectoryRecorder(max_steps=n)
    for path in (path_a, path_b):
        # play the path, then unparseable answers: the next row records the state the path ended in
        rec.rollout(env, scripted(path + [None] * (n - len(path))), seed=1, group=0)
    end_a, end_b = (tr.steps[len(p)] for tr, p in zip(rec.trajectories, (path_a, path_b)))
    assert end_a.state_key == end_b.state_key and end_a.state == end_b.state
    assert [s.action_key for s in rec.trajectories[0].steps] != [s.action_key for s in rec.trajectories[1].steps]


@pytest.mark.parametrize("game", GAMES)
def test_solver_reaches_success_with_reward_10_at_the_last_step(game):
    env = make(game)
    plan = bfs_plan(env, seed=2)
    rec = TrajectoryRecorder(max_steps=len(plan) + 5)
    tr = rec.rollout(env, scripted(plan), seed=2)
    assert tr.success and not tr.truncated and len(tr.steps) == len(plan)
    assert [s.reward for s in tr.steps] == [0.0] * (len(plan) - 1) + [10.0]
    steps = rec.to_step_table()
    assert steps.success.all() and not steps.truncated.any() and float(steps.returns[0]) == 10.0


@pytest.mark.parametrize("game", ["minigrid", "sokoban"])
def test_unparseable_or_inadmissible_action_is_penalised_and_leaves_the_state(game):
    env = make(game)
    rec = TrajectoryRecorder(max_steps=3)
    tr = rec.rollout(env, scripted([None, "fly away", env.legal_actions()[0]]), seed=0)
    assert [s.t for s in tr.steps] == [0, 1, 2]  # invalid steps count
    assert [s.reward for s in tr.steps[:2]] == [INVALID_PENALTY, INVALID_PENALTY] == [-0.1, -0.1]
    assert tr.steps[0].action_text is None and tr.steps[1].action_text == "fly away"
    assert tr.steps[0].state_key == tr.steps[1].state_key == tr.steps[2].state_key
    table = rec.to_step_table()
    assert table.action.tolist()[:2] == [-1, -1] and table.action[2] != -1
    assert table.state[0] == table.state[1] == table.state[2]


def test_truncation_at_max_steps_sets_truncated():
    env = make("minigrid")
    rec = TrajectoryRecorder(max_steps=3)
    tr = rec.rollout(env, scripted(["turn left"] * 3), seed=0)
    assert tr.truncated and not tr.success and len(tr.steps) == 3
    table = rec.to_step_table()
    assert table.truncated.all() and not table.success.any()


@pytest.mark.parametrize("game", GAMES)
def test_snapshot_restore_round_trip(game):
    env = make(game)
    env.reset(4)
    snap, key = env.snapshot(), env.state_key()
    moves = [env.legal_actions()[i % len(env.legal_actions())] for i in (2, 0, 2, 3, 2)]
    first = [env.step(a).observation for a in moves]
    env.restore(snap)
    assert env.state_key() == key
    assert [env.step(a).observation for a in moves] == first  # the game continues identically after a restore


def test_minigrid_shaping_rewards_progress_toward_the_goal_and_is_off_by_default():
    plain, shaped = make("minigrid"), make("minigrid", shaping=0.5)
    plan = bfs_plan(plain, seed=2)
    shaped.reset(2)
    plain.reset(2)
    rewards = [shaped.step(a).reward for a in plan]
    assert [plain.step(a).reward for a in plan][-1] == 10.0
    forward = [r for a, r in zip(plan, rewards) if a == "move forward"]
    assert all(r > 0 for r in forward) and rewards[-1] == 10.5  # each move on a shortest path gains 0.5


def test_recorded_step_table_feeds_gigpo_with_anchor_revisits():
    rng = random.Random(0)
    rec = TrajectoryRecorder(max_steps=12)
    for group, (game, seed) in enumerate([("minigrid", 0), ("sokoban", 1)]):
        env = make(game)
        for _ in range(4):  # G = 4 rollouts of one task, random legal moves and some invalid answers
            choices = env.legal_actions() + [None]
            rec.rollout(env, lambda prompt: (format_action(rng.choice(choices[:-1])) if rng.random() > 0.2
                                             else "no idea"), seed=seed, group=group)
    steps = rec.to_step_table()
    assert steps.n_groups == 2 and steps.n_traj == 8
    start_rows = steps.t == 0
    for g in range(2):
        assert len(set(steps.state[start_rows & (steps.row_group == g)].tolist())) == 1  # the shared start state
    anchor, n_anchor = steps.anchor
    assert n_anchor < len(steps)  # states are revisited across the rollouts of a group
    adv = cp.get("gigpo")(steps)
    assert adv.shape == (len(steps),) and bool(torch.isfinite(adv).all())
    assert step_table(rec.trajectories).n_steps == len(steps)


# ---- errors ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, module", [("sokoban", "gym_sokoban"), ("minigrid", "minigrid")])
def test_missing_env_package_says_pip_install_agentcredit_envs(monkeypatch, name, module):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail as if it were not installed
    with pytest.raises(ImportError, match=r"pip install agentcredit\[envs\]"):
        env_adapters.make(name)


def test_unknown_option_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['sizee'\] for environment 'minigrid'.*'size'"):
        env_adapters.make("minigrid", sizee=5)
    with pytest.raises(ValueError, match=r"unknown env 'chess'; available: \[.*'minigrid'.*'sokoban'"):
        env_adapters.make("chess")


def test_step_after_the_episode_ended_is_an_error_not_a_silent_step():
    env = make("minigrid")
    plan = bfs_plan(env, seed=2)
    env.reset(2)
    for a in plan:
        env.step(a)
    with pytest.raises(RuntimeError, match="reset"):
        env.step("turn left")


def _synthetic_path(env) -> list[str]:
    """Breadth-first over the synthetic task's own transition table: the actions from the reset state to its goal."""
    mdp, start = env.mdp, env.state_id
    seen, queue = {start: []}, deque([start])
    while queue:
        s = queue.popleft()
        if s == mdp.goal:
            return seen[s]
        if s == mdp.trap:
            continue
        for a, name in enumerate(mdp.actions[s]):
            nxt = int(mdp.next_state[s, a])
            if nxt not in seen:
                seen[nxt] = seen[s] + [name]
                queue.append(nxt)
    raise AssertionError("the goal is unreachable")


@pytest.mark.parametrize("name", ["minigrid", "synthetic"])
def test_the_shared_step_guard_refuses_a_finished_episode_and_penalises_an_unreadable_action(name):
    """env_adapters.base.begin_step: an unreadable action is the penalised no-op (observation and state unchanged),
    and a step after the episode ended is a RuntimeError."""
    env = env_adapters.make(name, **({"moves": "absolute"} if name == "minigrid" else {}))
    obs = env.reset(3)
    key = env.state_key()
    r = env.step("<<not an action>>")
    assert (r.observation, r.reward, r.done, r.success) == (obs, env.invalid_penalty, False, False)
    assert r.info == {"valid": False, "action_key": None} and env.state_key() == key
    plan = [] if name == "minigrid" else _synthetic_path(env)
    while not r.done:  # minigrid: its scripted expert's next move, one at a time
        r = env.step(plan.pop(0) if name == "synthetic" else env.expert_actions()[0])
        last = r.info["action_key"]
    assert r.success
    for action in (last, "<<not an action>>", None):
        with pytest.raises(RuntimeError, match=r"the episode is over; call reset\(\) before step\(\)"):
            env.step(action)


def test_begin_step_reads_the_observation_and_info_only_for_a_refused_action():
    from env_adapters.base import begin_step

    class Env:
        _done, invalid_penalty = False, -0.5

        def action_key(self, text):
            return text if text == "go" else None

    calls = []
    obs, info = (lambda: calls.append("obs") or "here"), (lambda: calls.append("info") or {"score": 1})
    assert begin_step(Env(), "go", obs, info) == ("go", None) and calls == []
    key, refused = begin_step(Env(), "fly", obs, info)
    assert key is None and calls == ["obs", "info"]
    assert (refused.observation, refused.reward, refused.done, refused.success) == ("here", -0.5, False, False)
    assert refused.info == {"valid": False, "action_key": None, "score": 1}
