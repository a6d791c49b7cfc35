"""The ``AgentEnv`` protocol every adapter implements, its ``StepResult``, and the ``EnvSpec`` registration record."""

from __future__ import annotations

import contextlib
import inspect
import io
import random
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["AgentEnv", "StepResult", "EnvSpec", "DrawnState", "GoalRanking", "GOAL_GAMMA", "missing_package",
           "quiet", "episode_seed", "check_snapshot", "reset_seed", "begin_step", "invalid_step"]


@dataclass
class StepResult:
    """What one ``AgentEnv.step`` returns.

    Attributes:
        observation: the observation text after the step (unchanged after an invalid action).
        reward: r_t: 10 on success at the final step, 0 otherwise, plus the invalid-action penalty (and an adapter's
            optional shaping term).
        done: the episode ended by the game (success or a terminal failure); step limits are the caller's.
        success: the task was solved at this step.
        info: ``valid`` (the action was parsed and admissible), ``action_key`` and adapter-specific entries.
    """

    observation: str
    reward: float
    done: bool
    success: bool
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class AgentEnv(Protocol):
    """A text game an LLM agent plays one action at a time.

    Required: ``task`` (the rules and goal for the prompt), ``reset(seed) -> str`` (the first observation; the same
    seed gives the same initial state), ``step(action_text) -> StepResult`` (invalid text is a penalised no-op, never
    an exception), ``state_key() -> str`` (the canonical game state, without history or formatting: the same game
    state in two rollouts gives the same key; it becomes the StepTable's ``state`` anchor) and
    ``action_key(action_text) -> str | None`` (the canonical command, None when invalid).
    Optional: ``legal_actions() -> list[str]``, ``snapshot()`` / ``restore(snap)`` (search-based estimators),
    ``goal_rankings(k, rng) -> list[GoalRanking]`` (up to ``k`` alternative goals at the current state, each with the
    legal actions' values under it from the env's own solver; EVOKE's term, :class:`GoalRanking`).
    """

    task: str

    def reset(self, seed: int | None = None) -> str: ...

    def step(self, action_text: str | None) -> StepResult: ...

    def state_key(self) -> str: ...

    def action_key(self, action_text: str | None) -> str | None: ...


#: discount of :attr:`GoalRanking.values`: an action whose successor state is d steps from the goal is worth GOAL_GAMMA**d
GOAL_GAMMA = 0.9


@dataclass(frozen=True)
class GoalRanking:
    """The legal actions at the current state ranked under one alternative goal (``AgentEnv.goal_rankings``).

    Attributes:
        goal: the alternative goal in words (``"Go to the attic."``).
        edits: ``(text, replacement)`` pairs that turn the current prompt into the prompt under this goal: the task
            sentence and/or the current observation (where the observation shows the goal); the history is left as
            it is. :meth:`rewrite` applies them.
        actions: the legal actions at the state, in ``legal_actions()`` order.
        values: ``Q*(s, a)`` under the alternative goal from the env's solver, one per action:
            ``GOAL_GAMMA ** d(s')``, d the fewest steps from the action's successor s' to the goal (0 when
            unreachable or after a step that ends the episode); higher is better, equal values tie.
    """

    goal: str
    edits: tuple[tuple[str, str], ...]
    actions: tuple[str, ...]
    values: tuple[float, ...]

    def __post_init__(self):
        if len(self.actions) != len(self.values):
            raise ValueError(f"GoalRanking: {len(self.actions)} actions but {len(self.values)} values")

    def rewrite(self, prompt: str) -> str:
        """``prompt`` under this goal (:func:`env_adapters.prompting.rewrite_goal`)."""
        from .prompting import rewrite_goal

        return rewrite_goal(prompt, self.edits)


class DrawnState:
    """Mixin for adapters whose observation is a drawing of the game state: :meth:`render` draws it once per state
    (the adapter's ``_draw()``) and returns that text until the adapter calls :meth:`_state_changed` (after reset, a
    valid step and restore). The observation and ``state_key()`` of one step then cost one drawing."""

    _view: str | None = None

    def render(self) -> str:
        if self._view is None:
            self._view = self._draw()
        return self._view

    def _state_changed(self) -> None:
        self._view = None

    def _draw(self) -> str:  # pragma: no cover - each adapter draws its own game
        raise NotImplementedError


def episode_seed(seed: Any, env: str, limit: int = 2**63) -> int | None:
    """``seed`` as an int in ``[0, limit)`` (None stays None: an unseeded episode; an integral float is accepted);
    anything else is a ``ValueError`` naming the env (``numpy.random.seed`` takes ``[0, 2**32)``)."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        if isinstance(seed, (float, np.floating)) and float(seed).is_integer():
            seed = int(seed)
        else:
            raise ValueError(f"{env}.reset(seed={seed!r}): the seed must be a non-negative integer")
    if not 0 <= int(seed) < limit:
        raise ValueError(f"{env}.reset(seed={int(seed)}): the seed must be an integer in [0, {limit})")
    return int(seed)


def reset_seed(seed: Any, default: Any, env: str) -> int:
    """The seed a ``reset(seed)`` plays: ``seed``, else the adapter's own ``default`` seed, else a fresh random one
    (an unseeded episode); validated by :func:`episode_seed`, so a bad seed is a ``ValueError`` naming ``env``."""
    seed = episode_seed(default if seed is None else seed, env)
    return random.SystemRandom().randrange(2**31) if seed is None else seed


def invalid_step(observation: str, penalty: float, **info: Any) -> StepResult:
    """The penalised no-op an unreadable or inadmissible action gets: the observation unchanged, ``penalty`` as the
    reward, not done, ``info`` = ``valid: False``, ``action_key: None`` and the adapter's own entries."""
    return StepResult(observation, penalty, False, False, {"valid": False, "action_key": None, **info})


def begin_step(env: Any, action_text: str | None, observation: Callable[[], str] | None = None,
               info: Callable[[], dict[str, Any]] | None = None) -> tuple[str | None, StepResult | None]:
    """The opening every ``step`` of an adapter with ``_done``, ``action_key`` and ``invalid_penalty`` shares.

    Stepping a finished episode is a ``RuntimeError``; an action ``env.action_key`` cannot read gives
    ``(None, no-op)`` (:func:`invalid_step` with ``observation()``, default ``env.render()``, and ``info()``'s
    entries), a readable one ``(key, None)``::

        key, refused = begin_step(self, action_text)
        if refused is not None:
            return refused
    """
    if env._done:
        raise RuntimeError("the episode is over; call reset() before step()")
    key = env.action_key(action_text)
    if key is not None:
        return key, None
    return None, invalid_step(env.render() if observation is None else observation(), env.invalid_penalty,
                              **(info() if info is not None else {}))


def check_snapshot(snap: Any, keys: tuple[str, ...], env: str) -> None:
    """A ``ValueError`` naming what is missing when ``snap`` is not a snapshot of ``env`` (from its ``snapshot()``)."""
    if not isinstance(snap, dict):
        raise ValueError(f"{env}.restore(...) takes the dict that {env}.snapshot() returned, got {type(snap).__name__}")
    missing = [k for k in keys if k not in snap]
    if missing:
        raise ValueError(f"{env}.restore(...): the snapshot lacks {missing}; pass what {env}.snapshot() returned")


#: held while a :func:`quiet` block has the process's ``sys.stdout`` / ``sys.stderr`` swapped (re-entrant)
_STREAMS = threading.RLock()


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Drop what the block prints (a game package's import banner or build chatter).

    ``contextlib.redirect_stdout`` swaps the process-wide ``sys.stdout``; two threads that enter and leave it out of
    order (the verl agent loop's thread backend builds many envs at once) leave it pointing at a dead buffer for the
    rest of the process, and every later ``print`` / warning of the worker is lost. Every such swap here holds one
    lock, so the swaps nest properly; what other threads print during the block is dropped too, so keep it to
    one-off work (imports, env construction), never to a per-step call."""
    with _STREAMS, contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def missing_package(package: str, env: str) -> ImportError:
    """The error an adapter raises when its game package is not installed."""
    return ImportError(f"the {env!r} environment needs the {package!r} package, which is not installed; install the "
                       f"environment extra: pip install agentcredit[envs]  (or: pip install {package})")


@dataclass(frozen=True)
class EnvSpec:
    """A registered environment: ``spec(**options)`` builds it. ``agentcredit list envs`` prints ``summary``.

    Options are checked against the factory's keyword arguments: an unknown one is a ``ValueError`` naming it and
    listing the valid ones.
    """

    name: str
    factory: Callable[..., Any]
    summary: str

    def __post_init__(self):
        object.__setattr__(self, "__doc__", self.summary)  # what the CLI prints for items without a `paper`

    def options(self) -> dict[str, Any]:
        """``{option: default}`` of the factory's keyword arguments."""
        params = inspect.signature(self.factory).parameters
        return {n: p.default for n, p in params.items()
                if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and n != "self"}

    def check(self, options: Mapping[str, Any]) -> None:
        """A ``ValueError`` naming the unknown options (and the valid ones), before anything is built."""
        params = inspect.signature(self.factory).parameters.values()
        if any(p.kind is p.VAR_KEYWORD for p in params):  # a factory that takes **options checks them itself
            return
        valid = self.options()
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(f"unknown option(s) {unknown} for environment {self.name!r}; valid options: "
                             f"{sorted(valid)}")

    def __call__(self, **options: Any):
        self.check(options)
        return self.factory(**options)

    def describe(self) -> str:
        opts = "\n".join(f"  {n} = {d!r}" for n, d in self.options().items())
        doc = inspect.getdoc(self.factory) or ""
        return f"{self.name}: {self.summary}\n\noptions:\n{opts}\n\n{doc}".rstrip()
