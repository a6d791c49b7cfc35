"""mix: a weighted sum of registered estimators, A = sum_k w_k A_k (TRL #7291's A = lam*A_GRPO + (1-lam)*A_SDPO).

The formulas are :data:`FORMULA` (what ``agentcredit describe`` and the docs show).

``parts`` maps each estimator name to its weight w_k (e.g. ``{"grpo": 0.5, "gigpo": 0.5}``), ``params`` maps a part's
name to its own parameters (e.g. ``{"gigpo": {"gamma": 0.9}}``); every part's parameters are validated when the mix
is built. Weights are used as given (not renormalised) and may be negative; a part of weight 0 is not run. Each part reads the StepTable fields and
extras it needs (a missing one is the part's own error). Stateful parts (mvpo, sipo, uniopsd) keep their state
inside the mix: ``state_dict()`` is ``{"parts": {name: part_state}}`` and ``load_state_dict`` restores every part.
A mix of one part with weight 1 returns that part's advantages exactly.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..estimator import Estimator, Extra, StatefulEstimator, make_params, param, params_dataclass
from ..steptable import StepTable

#: The formula the estimator computes, as ``agentcredit describe``, the docs page and the registry record
#: (``Estimator.formula``) show it.
FORMULA = """\
A_{i,t}        = sum_k w_k * A^(k)_{i,t}                      parts whose output is per step ([S])
A_{i,t,l}      = sum_k w_k * A^(k)_{i,t,l}  with [S] parts broadcast over the tokens l   (any part is [S, L])
(times ``scale``, 1 by default)
"""


class FrozenDict(dict):
    """A read-only dict: a hashable dataclass default (``parts``, ``params``) that still prints and copies as a dict."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(repr(sorted(self.items(), key=lambda kv: str(kv[0]))))

    def _readonly(self, *args: Any, **kwargs: Any):
        raise TypeError("this default is read-only; pass a new dict instead")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _readonly  # type: ignore[assignment]


def _plain(value: Any) -> Any:
    """Nested mappings/sequences (e.g. OmegaConf containers) as plain dicts and lists."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or (hasattr(value, "__iter__") and hasattr(value, "__len__")
                                             and not isinstance(value, (str, bytes, dict))):
        return [_plain(v) for v in value]
    return value


@params_dataclass
class MixParams:
    """Parts and their weights, and each part's parameters."""

    parts: dict = param(FrozenDict(grpo=0.5, gigpo=0.5),  # noqa: RUF009 - a read-only, hashable default
                         "{estimator name: weight w_k}; A = sum_k w_k A_k.")
    params: dict = param(FrozenDict(),  # noqa: RUF009 - a read-only, hashable default
                          "{estimator name: {parameter: value}} for the parts (defaults otherwise).")
    scale: float = param(1.0, "A factor on the whole sum (1: the weighted sum as given).")

    def __post_init__(self):
        from .. import registry

        if not isinstance(self.parts, Mapping) or not self.parts:
            raise ValueError(f"mix: parts={self.parts!r}; give a non-empty mapping {{estimator name: weight}}, e.g. "
                             f"{{'grpo': 0.5, 'gigpo': 0.5}}")
        if not isinstance(self.params, Mapping):
            raise ValueError(  # noqa: TRY004 - parameter errors are ValueErrors naming the field
                f"mix: params={self.params!r}; give a mapping {{part name: {{parameter: value}}}}")
        known = registry.available("estimators")
        parts, params = {}, {}
        for name, w in _plain(self.parts).items():
            if name == "mix":
                raise ValueError("mix: a mix cannot contain 'mix'; list its parts directly")
            if name not in known:
                raise ValueError(f"mix: part {name!r} is not a registered estimator; available: {', '.join(known)}")
            parts[name] = make_params(_Weight, {"w": w}, owner=f"mix: weight of part {name!r}").w
        for name, values in _plain(self.params).items():
            if name not in parts:
                raise ValueError(f"mix: params given for {name!r}, which is not one of the parts {list(parts)}")
            if not isinstance(values, Mapping):
                raise ValueError(  # noqa: TRY004 - parameter errors are ValueErrors naming the field
f"mix: params[{name!r}]={values!r}; give a mapping of that estimator's parameters")
            registry.get(name).make_params(**values)  # each part's own validation, now
            params[name] = dict(values)
        if not any(parts.values()):
            raise ValueError(f"mix: every part has weight 0 ({parts}); give at least one part a non-zero weight")
        self.parts, self.params = FrozenDict(parts), FrozenDict(params)


@params_dataclass
class _Weight:
    w: float = param(1.0, "part weight")


class Mix(StatefulEstimator):
    """The composed estimator: ``est = get("mix").create(parts={...}, params={...})``, ``adv = est(steps)``."""

    STATE_DOC = "the state of each stateful part (e.g. MVPO's kappa schedule), under its name"
    STATE_SCHEMA: ClassVar[dict[str, tuple[Any, dict[str, Any]]]] = {"parts": (dict, {})}

    def __init__(self, params: MixParams | None = None, **values: Any):
        from .. import registry

        if params is not None and values:
            raise ValueError("Mix: pass either a MixParams or keyword parameters, not both")
        self.params = params if params is not None else make_params(MixParams, values, owner="estimator 'mix'")

        # a part of weight 0 is not run (so a config that merges dicts, like Hydra's, can switch a default off)
        self.estimators = {name: registry.get(name) for name, w in self.params.parts.items() if w != 0}
        self.parts = {name: est.create(**self.params.params.get(name, {})) for name, est in self.estimators.items()}
        self.stats: dict[str, float] = {}

    def __call__(self, steps: StepTable) -> torch.Tensor:
        """Advantages ``[S]`` (or ``[S, L]`` when a part is per token) float32 in the rows' input order."""
        outs = []
        for name, part in self.parts.items():
            try:
                outs.append((self.params.parts[name], part(steps)))
            except ValueError as e:
                raise ValueError(f"mix part {name!r}: {e}") from e
        lengths = {o.shape[1] for _, o in outs if o.dim() == 2}
        if len(lengths) > 1:
            raise ValueError(f"mix: the per-token parts return different token lengths {sorted(lengths)}; they must "
                             f"share one response layout")
        total = None
        for w, o in outs:
            o = o.to(torch.float64)
            if lengths and o.dim() == 1:
                o = o[:, None]
            term = o if w == 1.0 else w * o
            total = term if total is None else total + term
        if self.params.scale != 1.0:
            total = self.params.scale * total
        if lengths and total.dim() == 1:
            total = total[:, None].expand(-1, next(iter(lengths)))
        self.stats = {f"{name}/{k}": v for name, part in self.parts.items()
                      for k, v in (getattr(part, "stats", None) or {}).items()}
        return total.to(torch.float32)

    def state_dict(self) -> dict[str, Any]:
        return {"parts": {name: part.state_dict() for name, part in self.parts.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = self.check_state(state)
        saved = state["parts"]
        if not isinstance(saved, Mapping) or set(saved) != set(self.parts):
            raise ValueError(f"Mix.load_state_dict: the saved parts {sorted(saved) if isinstance(saved, Mapping) else saved!r} "
                             f"differ from this mix's parts {sorted(self.parts)}; build the mix with the same parts")
        for name, part in self.parts.items():
            try:
                part.load_state_dict(saved[name])
            except ValueError as e:
                raise ValueError(f"Mix.load_state_dict: part {name!r}: {e}") from e

    def reset(self) -> None:
        for part in self.parts.values():
            if hasattr(part, "reset"):
                part.reset()

    def composition(self) -> str:
        return " + ".join(f"{w:g} * {name}" for name, w in self.params.parts.items())

    def __repr__(self) -> str:
        return f"Mix({self.composition()})"


def mix(steps: StepTable, p: MixParams) -> torch.Tensor:
    """One batch from the parts' initial states, in the table's sorted row order."""
    return Mix(p)(steps)[steps.order]


@dataclass(frozen=True)
class MixEstimator(Estimator):
    """The mix record: :meth:`describe` also prints the default composition and each part's record."""

    def describe(self) -> str:
        from .. import registry

        p = self.params()
        lines = [super().describe(), "", "default composition: " +
                 " + ".join(f"{w:g} * {n}" for n, w in p.parts.items())]
        for name in p.parts:
            est = registry.get(name)
            lines += [f"  part {name} ({'[S]' if est.output == 'step' else '[S, L]'}): {est.paper}"]
            lines += ["      " + ln for ln in textwrap.dedent(est.formula).strip().splitlines()[:3]]
        return "\n".join(lines)

    def reads_state_text(self, **params: Any) -> bool:
        """Whether a part of non-zero weight compares state texts (its own ``similarity_thresh``)."""
        from .. import registry

        p = self.make_params(**params)
        return any(registry.get(n).reads_state_text(**p.params.get(n, {})) for n, w in p.parts.items() if w != 0)

    def describe_composition(self, **params: Any) -> str:
        """The composition a given set of parameters builds (``agentcredit describe mix`` with a recipe's params)."""
        p = self.make_params(**params)
        return " + ".join(f"{w:g} * {n}" + (f"({p.params[n]})" if n in p.params else "")
                          for n, w in p.parts.items())


def reads_extra(name: str, params: Mapping[str, Any] | None, extra: str) -> bool:
    """Whether estimator ``name`` with ``params`` reads the extra ``extra``: for ``mix``, whether one of its parts
    of non-zero weight does (what a rollout must produce, e.g. TJPO's ``descriptor``)."""
    from .. import registry

    est = registry.get(name)
    if name != "mix":
        return est.reads(extra)
    p = est.make_params(**dict(params or {}))
    return any(registry.get(part).reads(extra) for part, w in p.parts.items() if w != 0)


def build(parts_of: tuple[Estimator, ...]) -> MixEstimator:
    """The mix record; its extras are every extra the given estimators read, all optional (a part that needs one
    raises its own error when it is missing), so the bridges pass on whatever the rollout produced."""
    seen: dict[str, Extra] = {}
    for est in parts_of:
        for e in est.extras:
            seen.setdefault(e.name, Extra(e.name, e.source, required=False))
    return MixEstimator(
        name="mix",
        fn=mix,
        params=MixParams,
        paper="composition of registered estimators (TRL #7291: A = lam*A_GRPO + (1-lam)*A_SDPO)",
        formula=FORMULA,
        extras=tuple(seen.values()),
        stateful=Mix,
    )


__all__ = ["FrozenDict", "Mix", "MixEstimator", "MixParams", "build", "mix", "reads_extra"]
