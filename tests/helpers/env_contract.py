"""Shared checks of the new environment adapters (ScienceWorld, TextWorld-Express, search-QA, Gymnasium text)."""

import os
import random
import shutil

import pytest
import torch

import credit_plugins as cp
from env_adapters import (
    INVALID_PENALTY,
    TrajectoryRecorder,
    format_action,
    parse_action,
)

#: responses no adapter may choke on: each is a penalised no-op
BAD = ["", "   ", "I am not sure", "<action></action>", "<action>dance the tango wildly</action>",
       "<action>" * 50, "</action><action>", "<action>\x00\x01\x02</action>", "<action>\ud800</action>",
       "<action>" + "x" * 5000 + "</action>", "<action>移动</action>", "\u202e<action>look</action\u202d>"]
# and the shared robustness set (huge, unclosed, surrogates, control characters, ...); that module imports without
# the games' packages (its game tests skip per test), so a failure to import it is an error, not a smaller BAD
from tests.envs.test_env_robustness import BAD as _SHARED  # noqa: E402

BAD += [v for v in _SHARED.values() if isinstance(v, str)]

#: set to 1 to skip (instead of fail) the tests of the games that run a JVM on a machine without Java
SKIP_JAVA_ENV = "AGENTCREDIT_SKIP_JAVA_TESTS"


def require_java(what: str) -> None:
    """Module-level guard of a JVM game's tests: without ``java`` on PATH they **fail** (a collection error naming
    the fix) unless ``AGENTCREDIT_SKIP_JAVA_TESTS=1`` asks to skip them, so a CI machine without Java cannot pass
    by silently skipping them."""
    if shutil.which("java") is not None:
        return
    if os.environ.get(SKIP_JAVA_ENV) == "1":
        pytest.skip(f"{what} needs a Java runtime ({SKIP_JAVA_ENV}=1)", allow_module_level=True)
    pytest.fail(f"{what} needs a Java runtime and `java` is not on PATH: install one (e.g. apt-get install "
                f"default-jre-headless) or set {SKIP_JAVA_ENV}=1 to skip these tests", pytrace=False)


def check_bad_responses(env, seed):
    """Every BAD response, parsed and raw, is a penalised no-op; a valid action still works afterwards."""
    obs = env.reset(seed)
    key, legal = env.state_key(), env.legal_actions()
    for bad in BAD + [None, 17, b"bytes"]:
        for text in ((parse_action(bad), bad) if isinstance(bad, str) else (bad,)):
            if isinstance(text, str) and text in legal:
                continue
            r = env.step(text)
            assert r.reward == INVALID_PENALTY and not r.done and not r.success, (bad, r)
            assert r.info["valid"] is False and r.info["action_key"] is None
            assert isinstance(r.observation, str) and r.observation == obs
            assert env.state_key() == key and env.legal_actions() == legal
    r = env.step(legal[0])
    assert r.info["valid"] and r.info["action_key"] is not None


def check_credit_contract(env, seed, max_steps=6, rollouts=4, bad_rate=0.2, rng_seed=0):
    """Recorder -> StepTable -> gigpo: finite advantages, anchors recur, non-zero step credit on recurring ones."""
    rng = random.Random(rng_seed)

    def policy(prompt):
        if rng.random() < bad_rate:
            return rng.choice(BAD[:5])
        return format_action(rng.choice(env.legal_actions()), think="random")

    rec = TrajectoryRecorder(max_steps=max_steps, history_length=1)
    for _ in range(rollouts):
        rec.rollout(env, policy, seed=seed, group=0)
    steps = rec.to_step_table()
    assert steps.n_traj == rollouts
    assert len({tr.steps[0].state_key for tr in rec.trajectories}) == 1  # one shared start state
    gigpo = cp.get("gigpo")
    adv = gigpo(steps)
    assert adv.shape == (len(steps),) and bool(torch.isfinite(adv).all())
    step_credit = adv - gigpo(steps, step_weight=0.0)
    anchor, n_anchor = steps.anchor
    assert n_anchor < len(steps)
    anchor = steps.to_input_order(anchor)
    repeated = torch.bincount(anchor, minlength=n_anchor)[anchor] > 1
    assert bool(repeated.any())
    assert float(step_credit[repeated].abs().max()) > 0
    return rec


def check_goal_rankings(env, seed, k=3, steps=3, rng_seed=0):
    """``env.goal_rankings`` (optional capability, EVOKE): at the start and after a few random moves, at most ``k``
    rankings over exactly the legal actions with values in [0, 1] and a strict order, drawn reproducibly from the
    rng; asking does not move the env; each rewrite changes the prompt (task text + observation)."""
    from env_adapters.prompting import build_prompt

    rng = random.Random(rng_seed)
    env.reset(seed)
    for _ in range(steps + 1):
        key, legal, obs = env.state_key(), env.legal_actions(), env.render()
        rankings = env.goal_rankings(k, random.Random(rng_seed))
        again = env.goal_rankings(k, random.Random(rng_seed))
        assert [r.goal for r in rankings] == [r.goal for r in again]
        assert 1 <= len(rankings) <= k and len({r.goal for r in rankings}) == len(rankings)
        assert env.state_key() == key and env.legal_actions() == legal
        prompt = build_prompt(env.task, [], obs, legal)
        for r in rankings:
            assert list(r.actions) == legal and len(r.values) == len(legal)
            assert all(0.0 <= v <= 1.0 for v in r.values) and max(r.values) > min(r.values)
            assert r.rewrite(prompt) != prompt
        if env.step(rng.choice(legal)).done:
            break
    return rankings
