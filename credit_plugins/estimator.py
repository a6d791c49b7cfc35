"""The registered form of a credit estimator: a pure function plus its documented parameters."""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .steptable import StepTable

__all__ = ["Estimator", "param", "make_params"]


def param(default: Any, help: str, **kwargs: Any) -> Any:  # noqa: A002 - mirrors TRL's field(metadata={"help"})
    """A dataclass field with a default and a one-line help string (shown by ``agentcredit describe``)."""
    return dataclasses.field(default=default, metadata={"help": help, **kwargs})


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
        requires: StepTable fields the estimator reads beyond ``group, traj, t, reward``.
        output: ``"step"`` ([S]) or ``"token"`` ([S, L]).
    """

    name: str
    fn: Callable[[StepTable, Any], torch.Tensor]
    params: type
    paper: str
    formula: str
    requires: tuple[str, ...] = ()
    output: str = "step"

    def make_params(self, **values: Any):
        return make_params(self.params, values, owner=f"estimator {self.name!r}")

    def __call__(self, steps: StepTable, **params: Any) -> torch.Tensor:
        """Advantages for ``steps`` in the rows' **input order**: ``[S]`` float32 (or ``[S, L]`` for token methods)."""
        p = self.make_params(**params)
        steps.require(*self.requires, by=f"estimator {self.name!r}")
        with torch.no_grad():
            out = self.fn(steps, p)
        return steps.to_input_order(out).to(torch.float32)

    def defaults(self) -> dict[str, Any]:
        return dataclasses.asdict(self.params())

    def describe(self) -> str:
        lines = [f"{self.name}: {self.paper}", "", "formula:"]
        lines += ["  " + ln for ln in textwrap.dedent(self.formula).strip().splitlines()]
        lines += ["", f"output: [{'S' if self.output == 'step' else 'S, L'}] float32",
                  f"required StepTable fields: {', '.join(('group', 'traj', 't', 'reward') + self.requires)}",
                  "", "parameters:"]
        for f in dataclasses.fields(self.params):
            lines.append(f"  {f.name} = {f.default!r}")
            lines += ["      " + ln for ln in textwrap.wrap(f.metadata.get("help", ""), 96)]
        return "\n".join(lines)
