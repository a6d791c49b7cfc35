"""Auxiliary training terms: methods that add a loss or a trainer hook next to the RL objective instead of replacing
its advantages (a credit estimator) or weighting a teacher (a loss scheduler).

Each is registered as a :class:`TermSpec` through the ``agentcredit_terms`` hook (``agentcredit list terms``,
``agentcredit describe NAME``); the bridges (:mod:`agentcredit.trl`, :mod:`agentcredit.verl`) run it.
"""

from __future__ import annotations

import dataclasses
import textwrap
from dataclasses import dataclass
from typing import Any

from credit_plugins.estimator import describe_params, make_params

__all__ = ["TermSpec", "BUILTIN"]


@dataclass(frozen=True)
class TermSpec:
    """The registry record of an auxiliary term. ``formula`` is what it computes in plain text (the module's
    ``FORMULA``); ``reads`` says what it needs beyond the policy's rollouts (an env capability, a second model, ...);
    ``bridges`` the integrations that run it."""

    name: str
    params: type
    paper: str
    summary: str
    formula: str = ""
    reads: str = ""
    bridges: tuple[str, ...] = ("trl",)

    def make_params(self, **values: Any):
        """The params dataclass from ``values``; an unknown or out-of-range value is a ``ValueError`` naming it."""
        return make_params(self.params, values, owner=f"term {self.name!r}")

    def defaults(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self.params()).items()}

    def describe(self) -> str:
        lines = [f"{self.name}: {self.paper}", "", *textwrap.wrap(self.summary, 100), "", "formula:"]
        lines += ["  " + ln for ln in textwrap.dedent(self.formula).strip().splitlines()]
        if self.reads:
            lines += ["", f"reads: {self.reads}"]
        lines += [f"bridges: {', '.join(self.bridges)}"]
        return "\n".join(lines + ["", "parameters:"] + describe_params(self.params))


#: The built-in terms, in the order ``agentcredit list terms`` shows them (each method module appends its SPEC here).
from . import advisd, evoke, sprpo  # noqa: E402  (the method records import TermSpec from this module)

BUILTIN: tuple[TermSpec, ...] = (sprpo.SPEC, evoke.SPEC, advisd.SPEC)
