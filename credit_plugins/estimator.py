"""The registered form of a credit estimator: a pure function plus its documented parameters."""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .steptable import StepTable

__all__ = ["Estimator", "BoundEstimator", "Extra", "SOURCES", "param", "make_params"]

#: The rollout pieces that produce StepTable extras: what a bridge or a recipe must run for an estimator to get them.
SOURCES = {
    "env": "the environment adapter, on every step of every rollout (e.g. MVPO's progress signature)",
    "turns": "the turn rollout's own bookkeeping (e.g. whether the turn's action parsed)",
    "hindsight": "hindsight scoring: the policy re-scores a failed rollout under a successful sibling's actions "
                 "(TRL: agentcredit.trl.privileged; not possible on verl 0.9.1)",
    "counterfactual": "counterfactual decisions from env snapshots (TRL CounterfactualRollout, verl "
                      "agentcredit_counterfactual loop; recipes: agentcredit.rollout: counterfactual)",
    "tree": "tree rollouts forked from env snapshots (TRL TreeRollout, verl agentcredit_tree loop; recipes: "
            "agentcredit.rollout: tree)",
}


@dataclass(frozen=True)
class Extra:
    """One StepTable extra an estimator reads: its name, the rollout piece that produces it (a key of
    :data:`SOURCES`) and whether the estimator needs it (``required``) or uses it when present."""

    name: str
    source: str
    required: bool = True

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"Extra({self.name!r}): unknown source {self.source!r}; one of {sorted(SOURCES)}")


def param(default: Any, help: str, **kwargs: Any) -> Any:  # noqa: A002 - mirrors TRL's field(metadata={"help"})
    """A dataclass field with a default and a one-line help string (shown by ``agentcredit describe``)."""
    return dataclasses.field(default=default, metadata={"help": help, **kwargs})


def describe_params(params: type) -> list[str]:
    """One ``name = default`` line per field of a params dataclass, each followed by its wrapped help text."""
    lines = []
    for f in dataclasses.fields(params):
        lines.append(f"  {f.name} = {f.default!r}")
        lines += ["      " + ln for ln in textwrap.wrap(f.metadata.get("help", ""), 96)]
    return lines


def make_params(cls: type, values: Mapping[str, Any] | None, owner: str):
    """Instantiate the params dataclass ``cls`` from ``values``; unknown keys are a ``ValueError`` listing valid ones."""
    values = dict(values or {})
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(f"{owner}: unknown parameter(s) {unknown}; valid parameters are {names}")
    return cls(**values)


@dataclass(frozen=True)
class Estimator:
    """A named credit estimator.

    Attributes:
        name: what a user types (``algorithm.adv_estimator=<name>`` in verl, ``credit=<name>`` in TRL).
        fn: ``fn(steps: StepTable, params) -> Tensor`` of shape ``[S]`` (per step, in the table's sorted order)
            or ``[S, L]`` (per token). It must be pure and vectorised.
        params: a dataclass of hyperparameters, each declared with :func:`param`; it validates in ``__post_init__``.
        paper: citation of the method's paper.
        formula: the formula the code computes, in plain text.
        requires: StepTable columns the estimator reads beyond ``group, traj, t, reward`` (``state``, ``action``,
            ``success``, ``truncated``).
        extras: the data contract for everything else: each :class:`Extra` the estimator reads, required or
            optional, with the rollout piece that produces it. Bridges and the recipe loader read this record
            (:meth:`sources`, :meth:`reads`, :meth:`extra_names`) instead of knowing estimators by name.
        output: ``"step"`` ([S]) or ``"token"`` ([S, L]).
        reference: the loop reference of ``fn``: ``reference(steps, params)`` computes the same values as ``fn``
            with plain per-row / per-group Python that reads like the paper (``credit_plugins.reference``), the
            oracle of the tests and the baseline of ``benchmarks/credit_speed.py``; never used for training.
        stateful: ``None`` for a pure estimator. For a method that carries state from batch to batch (MVPO's
            kappa schedule and milestone weights, SIPO's a2), the class holding that state: built as
            ``stateful(params)``, called as ``instance(steps) -> Tensor`` (input order, float32), with
            ``state_dict()`` / ``load_state_dict()`` of plain Python values and a ``STATE_DOC`` string naming the
            state. ``fn`` then computes one batch from the initial state (what a fresh instance returns first).

    Use :meth:`create` in a training loop: it works for every estimator. Calling a *stateful* estimator as a
    function (``get("mvpo")(steps)``) raises ``ValueError``: a hidden per-process instance would make the same call
    return different values batch after batch and lose its state on resume, so the state must be held, and
    checkpointed, by whoever runs the loop.
    """

    name: str
    fn: Callable[[StepTable, Any], torch.Tensor]
    params: type
    paper: str
    formula: str
    requires: tuple[str, ...] = ()
    output: str = "step"
    stateful: type | None = None
    extras: tuple[Extra, ...] = ()
    reference: Callable[[StepTable, Any], torch.Tensor] | None = None

    def __post_init__(self):
        unknown = sorted(set(self.requires) - set(StepTable.FIELDS))
        if unknown:
            raise ValueError(f"estimator {self.name!r}: requires={unknown} are not StepTable columns "
                             f"{StepTable.FIELDS}; declare extras with extras=(Extra(name, source), ...)")
        if self.output not in ("step", "token"):
            raise ValueError(f"estimator {self.name!r}: output must be 'step' or 'token', got {self.output!r}")

    @property
    def required_fields(self) -> tuple[str, ...]:
        """Columns and extras a StepTable must carry for this estimator."""
        return self.requires + self.extra_names(required=True)

    def extra_names(self, required: bool | None = None) -> tuple[str, ...]:
        """Names of the declared extras: all (``None``), the required ones (``True``) or the optional ones."""
        return tuple(e.name for e in self.extras if required is None or e.required == required)

    def reads(self, name: str) -> bool:
        """Whether the estimator reads the extra ``name`` (required or optional)."""
        return any(e.name == name for e in self.extras)

    def sources(self, required: bool | None = True) -> frozenset[str]:
        """The rollout pieces (keys of :data:`SOURCES`) that produce the extras the estimator needs (default) or
        reads (``required=None``)."""
        return frozenset(e.source for e in self.extras if required is None or e.required == required)

    def make_params(self, **values: Any):
        return make_params(self.params, values, owner=f"estimator {self.name!r}")

    def create(self, **params: Any):
        """A callable ``est(steps) -> Tensor`` bound to ``params``, with ``state_dict()`` / ``load_state_dict()``.

        For a stateful estimator this is a fresh instance of :attr:`stateful` (its initial state); for a pure one,
        a :class:`BoundEstimator` whose state is empty. Parameters are validated here, before any batch.
        """
        p = self.make_params(**params)
        if self.stateful is not None:
            return self.stateful(p)
        return BoundEstimator(self, p)

    def __call__(self, steps: StepTable, **params: Any) -> torch.Tensor:
        """Advantages for ``steps`` in the rows' **input order**: ``[S]`` float32 (or ``[S, L]`` for token methods)."""
        if self.stateful is not None:
            raise ValueError(
                f"estimator {self.name!r} keeps state across batches ({self.stateful.STATE_DOC}), so it cannot be "
                f"called as a function; create one instance per training run, call it on every batch and save "
                f"its state_dict() with your checkpoint: est = credit_plugins.get({self.name!r}).create(**params); "
                f"adv = est(steps)")
        p = self.make_params(**params)
        steps.require(*self.required_fields, by=f"estimator {self.name!r}")
        with torch.no_grad():
            out = self.fn(steps, p)
        return steps.to_input_order(out).to(torch.float32)

    def reference_values(self, steps: StepTable, **params: Any) -> torch.Tensor:
        """:attr:`reference` on ``steps`` with ``params``, in the rows' input order (as :meth:`__call__` returns)."""
        if self.reference is None:
            raise ValueError(f"estimator {self.name!r} has no loop reference")
        p = self.make_params(**params)
        steps.require(*self.required_fields, by=f"estimator {self.name!r} (reference)")
        return steps.to_input_order(self.reference(steps, p)).to(torch.float32)

    def defaults(self) -> dict[str, Any]:
        """The default parameters as plain config values (tuples as lists, as YAML/OmegaConf hold them)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self.params()).items()}

    def describe(self) -> str:
        lines = [f"{self.name}: {self.paper}", "", "formula:"]
        lines += ["  " + ln for ln in textwrap.dedent(self.formula).strip().splitlines()]
        lines += ["", f"output: [{'S' if self.output == 'step' else 'S, L'}] float32",
                  f"required StepTable fields: {', '.join(('group', 'traj', 't', 'reward') + self.requires)}"]
        for e in self.extras:
            lines.append(f"extra {e.name} ({'required' if e.required else 'optional'}): from {SOURCES[e.source]}")
        if self.stateful is not None:
            lines.append(f"stateful: keeps {self.stateful.STATE_DOC} across batches; est = .create(**params), "
                         f"call est(steps) per batch, checkpoint est.state_dict()")
        return "\n".join(lines + ["", "parameters:"] + describe_params(self.params))


@dataclass(frozen=True)
class BoundEstimator:
    """A pure estimator bound to its parameters: the stateless counterpart of a stateful estimator's instance."""

    estimator: Estimator
    params: Any

    def __call__(self, steps: StepTable) -> torch.Tensor:
        return self.estimator(steps, **{f.name: getattr(self.params, f.name) for f in dataclasses.fields(self.params)})

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state:
            raise ValueError(f"estimator {self.estimator.name!r} is stateless; its state_dict is empty, got keys "
                             f"{sorted(state)}")
