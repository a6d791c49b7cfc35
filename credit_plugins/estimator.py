"""The registered form of a credit estimator: a pure function plus its documented parameters."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import textwrap
import threading
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .steptable import StepTable

__all__ = ["Estimator", "BoundEstimator", "Extra", "SOURCES", "StatefulEstimator", "param", "make_params",
           "check_value", "check_fields", "params_dataclass", "interval"]

#: The rollout pieces that produce StepTable extras: what a bridge or a recipe must run for an estimator to get them.
SOURCES = {
    "env": "the environment adapter, on every step of every rollout (e.g. MVPO's progress signature)",
    "turns": "the turn rollout's own bookkeeping (e.g. whether the turn's action parsed)",
    "hindsight": "hindsight scoring: the policy re-scores a failed rollout under a successful sibling's actions "
                 "(TRL: agentcredit.trl.privileged; verl v1 trainer: agentcredit.verl.hindsight, log-probs only, no "
                 "hidden-state embeddings)",
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


def param(default: Any, help: str, *, low: float | None = None, high: float | None = None,  # noqa: A002
          choices: tuple[Any, ...] | None = None, allow_inf: bool = False, low_open: bool = False,
          high_open: bool = False, why: str | None = None, **kwargs: Any) -> Any:
    """A dataclass field with a default and a one-line help string (shown by ``agentcredit describe``).

    Every value :func:`make_params` takes for it is checked against the field's annotation (``bool`` only bools,
    ``int`` only integers, ``float`` only finite real numbers unless ``allow_inf``, NaN never; ``| None`` admits None;
    tuples/lists of numbers element-wise) and against ``low <= value <= high`` (``low < value`` with ``low_open``,
    ``value < high`` with ``high_open``; each element of a tuple/list, which has at least ``min_len`` elements when
    that is given) and ``choices`` when given. The ``ValueError`` names the owner, the field,
    the value, the allowed interval or choices, ``why`` (the reason for the rule, when given) and the default. This
    is the one place single-field rules live; the params class's own ``__post_init__`` checks only what depends on
    several fields."""
    meta = {"help": help, "low": low, "high": high, "choices": choices, "allow_inf": allow_inf,
            "low_open": low_open, "high_open": high_open, "why": why, "default": default, **kwargs}
    return dataclasses.field(default=default, metadata=meta)


def interval(meta: Mapping[str, Any]) -> str | None:
    """The interval ``low``/``high`` of :func:`param` metadata declare, e.g. ``(0, 1]`` or ``[0, inf)``; None when
    neither bound is declared."""
    low, high = meta.get("low"), meta.get("high")
    if low is None and high is None:
        return None
    left = "(" if low is None or meta.get("low_open") else "["
    right = ")" if high is None or meta.get("high_open") else "]"
    return f"{left}{'-inf' if low is None else low}, {'inf' if high is None else high}{right}"


def _rule(meta: Mapping[str, Any]) -> str:
    """The range rule in words: ``must lie in [0, 1]``, ``must be > 0``, ``must be <= 10``."""
    low, high = meta.get("low"), meta.get("high")
    if low is not None and high is not None:
        return f"must lie in {interval(meta)}"
    if low is not None:
        return f"must be {'>' if meta.get('low_open') else '>='} {low}"
    return f"must be {'<' if meta.get('high_open') else '<='} {high}"


def _fix(meta: Mapping[str, Any], why: bool = True) -> str:
    """The tail of a rule's message: why the rule exists and the default to fall back to."""
    why = f" ({meta['why']})" if why and meta.get("why") else ""
    default = f"; the default is {meta['default']!r}" if "default" in meta else ""
    return why + default


def describe_params(params: type) -> list[str]:
    """One ``name = default`` line per field of a params dataclass, each followed by its wrapped help text."""
    lines = []
    for f in dataclasses.fields(params):
        lines.append(f"  {f.name} = {f.default!r}")
        lines += ["      " + ln for ln in textwrap.wrap(f.metadata.get("help", ""), 96)]
    return lines


def _kinds(annotation: Any) -> tuple[set[type], bool]:
    """The plain types an annotation admits (bool, int, float, str, tuple, list, ...) and whether it admits None."""
    if annotation is None or annotation is type(None):
        return set(), True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        kinds, nullable = set(), False
        for arg in typing.get_args(annotation):
            k, n = _kinds(arg)
            kinds |= k
            nullable |= n
        return kinds, nullable
    if origin is typing.Literal:
        return {type(a) for a in typing.get_args(annotation)}, None in typing.get_args(annotation)
    if origin is not None:
        return {origin}, False
    return ({annotation} if isinstance(annotation, type) else set()), False


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, str)) and type(value).__name__ != "bool_"


def check_value(name: str, value: Any, annotation: Any, meta: Mapping[str, Any] | None = None,
                owner: str = "parameter") -> Any:
    """``value`` checked against ``annotation`` and the :func:`param` metadata ``meta``, returned as the plain
    Python value (numpy scalars become int/float); a ``ValueError`` names ``owner``, the field and the rule. Used
    for every estimator and scheduler parameter, and for the fields of their saved state."""
    meta = meta or {}
    kinds, nullable = _kinds(annotation)
    where = f"{owner}: {name}={value!r}"
    if value is None:
        if nullable or not kinds:
            return value
        raise ValueError(f"{where}: None is not allowed; give a {'/'.join(sorted(k.__name__ for k in kinds))}")
    if kinds & {tuple, list}:
        if isinstance(value, Sequence) and not isinstance(value, (str, bytes, tuple, list)):
            value = list(value)  # e.g. an OmegaConf ListConfig from a verl/Hydra config
        if not isinstance(value, (tuple, list)):
            if kinds <= {tuple, list}:
                raise ValueError(f"{where}: must be a list, not a {type(value).__name__}")
        else:
            for i, v in enumerate(value):
                if isinstance(v, str) or (_is_real(v) and not (math.isfinite(float(v)) or meta.get("allow_inf"))):
                    raise ValueError(f"{where}: element {i} is {v!r}; every element must be a finite number")
                low, high = meta.get("low"), meta.get("high")
                if _is_real(v) and ((low is not None and (v <= low if meta.get("low_open") else v < low)) or
                                    (high is not None and (v >= high if meta.get("high_open") else v > high))):
                    raise ValueError(f"{where}: element {i} is {v!r}; every element {_rule(meta)}{_fix(meta)}")
            if len(value) < meta.get("min_len", 0):
                raise ValueError(f"{where}: give at least {meta['min_len']} element(s){_fix(meta, why=False)}")
            return value
    if bool in kinds and not (kinds & {int, float}):
        if isinstance(value, bool) or type(value).__name__ == "bool_":
            return bool(value)
        raise ValueError(f"{where}: must be true or false (a bool), not a {type(value).__name__}")
    if kinds & {int, float} and not kinds & {str}:
        if not _is_real(value):
            want = "a number" if float in kinds else "an integer"
            raise ValueError(f"{where}: must be {want}, not a {type(value).__name__}")
        if float not in kinds:
            if not isinstance(value, numbers.Integral):
                raise ValueError(f"{where}: must be an integer")
            value = int(value)
        else:
            value = float(value) if not isinstance(value, numbers.Integral) else value
            if math.isnan(value) or (math.isinf(value) and not meta.get("allow_inf")):
                raise ValueError(f"{where}: must be a finite number" + (" (NaN is never valid)" if math.isnan(value)
                                                                      else ""))
        low, high = meta.get("low"), meta.get("high")
        if ((low is not None and (value <= low if meta.get("low_open") else value < low))
                or (high is not None and (value >= high if meta.get("high_open") else value > high))):
            raise ValueError(f"{where}: {_rule(meta)}{_fix(meta)}")
        return value
    if str in kinds and not isinstance(value, str) and not kinds - {str}:
        raise ValueError(f"{where}: must be a string, not a {type(value).__name__}")
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ValueError(f"{where}: must be one of {list(choices)}{_fix(meta)}")
    return value


def check_fields(obj: Any, owner: str | None = None) -> None:
    """Every :func:`param` field of the params instance ``obj`` checked by :func:`check_value` (and replaced by its
    plain Python form: numpy scalars, OmegaConf lists). Run on construction by :func:`params_dataclass`."""
    owner = owner or type(obj).__name__
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        if "help" not in f.metadata:  # not declared with param()
            continue
        value = getattr(obj, f.name)
        checked = check_value(f.name, value, hints.get(f.name), f.metadata, owner)
        if checked is not value:
            object.__setattr__(obj, f.name, checked)


def params_dataclass(cls: type | None = None, /, **kwargs: Any) -> Any:
    """``@dataclass`` (same keyword arguments) for a params class whose fields are declared with :func:`param`:
    constructing it checks every field against its declaration (:func:`check_fields`), then runs the class's own
    ``__post_init__``, which holds only the rules across fields (inherited from a params base class when the class
    defines none). So ``GiGPOParams(gamma=2.0)`` and ``get("gigpo").make_params(gamma=2.0)`` fail alike."""

    def wrap(c: type) -> type:
        inherited = getattr(c, "__post_init__", None)
        own = c.__dict__.get("__post_init__") or getattr(inherited, "cross_field_rules", inherited)

        def __post_init__(self) -> None:
            check_fields(self)
            if own is not None:
                own(self)

        __post_init__.cross_field_rules = own  # type: ignore[attr-defined]
        c.__post_init__ = __post_init__  # type: ignore[attr-defined]
        return dataclasses.dataclass(c, **kwargs)

    return wrap if cls is None else wrap(cls)


def make_params(cls: type, values: Mapping[str, Any] | None, owner: str):
    """Instantiate the params dataclass ``cls`` from ``values``; unknown keys are a ``ValueError`` listing valid ones,
    and every given value is checked by :func:`check_value` against its field (type, finiteness, range, choices)."""
    values = dict(values or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"{owner}: unknown parameter(s) {unknown}; valid parameters are {list(fields)}")
    hints = typing.get_type_hints(cls)
    checked = {k: check_value(k, v, hints.get(k), fields[k].metadata, owner) for k, v in values.items()}
    return cls(**checked)


_LOCK_GUARD = threading.Lock()


LARGE_INPUT = 1e30  #: inputs of at least this magnitude are named when an output cannot be represented


def _large_inputs(steps: StepTable, params: Any) -> list[str]:
    """The inputs of magnitude >= LARGE_INPUT: the reward column, float extras and numeric parameters."""
    found = []
    if steps.n_steps:
        r = float(steps.reward.to(torch.float64).abs().max())
        if r >= LARGE_INPUT:
            found.append(f"reward (max |r| = {r:.3g})")
    for name, x in sorted(getattr(steps, "_extras", {}).items()):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel():
            fin = x.to(torch.float64)
            big = float(torch.where(torch.isfinite(fin), fin.abs(), 0.0).max())
            if big >= LARGE_INPUT:
                found.append(f"extras[{name!r}] (max |x| = {big:.3g})")
    if params is not None and dataclasses.is_dataclass(params):
        for f in dataclasses.fields(params):
            v = getattr(params, f.name)
            if isinstance(v, numbers.Real) and not isinstance(v, bool) and abs(v) >= LARGE_INPUT:
                found.append(f"parameter {f.name}={v!r}")
    return found


def check_output(owner: str, out: torch.Tensor, steps: StepTable, params: Any = None,
                 order: torch.Tensor | None = None) -> torch.Tensor:
    """``out`` (computed in float64 by the estimators) as float32 when every advantage is representable there;
    otherwise a ``ValueError`` naming the first input row whose advantage is not (its float64 value, or that an
    intermediate overflowed float64) and the inputs of magnitude >= :data:`LARGE_INPUT` that make it so (the
    reward column, float extras, numeric parameters). The inputs were finite (the StepTable and the parameter
    validation check them), so only their size can cause this. ``order`` maps ``out``'s rows to input rows when
    ``out`` is in the table's sorted order (``steps.order``)."""
    y = out.to(torch.float32)
    if y.numel() == 0 or bool(torch.isfinite(y.sum())):
        return y  # a finite sum has no NaN/inf term (one vectorised read; a sum that overflows takes the full check)
    bad = ~torch.isfinite(y)
    if not bool(bad.any()):
        return y
    flat = int(bad.reshape(-1).nonzero()[0])
    row = flat // (out[0].numel() if out.ndim > 1 and out.shape[0] else 1)
    row = row if order is None else int(order[row])
    v = float(out.reshape(-1)[flat])
    what = (f"is {v:.6g}, beyond float32's range (|x| <= {torch.finfo(torch.float32).max:.6g})" if math.isfinite(v)
            else "overflowed float64 in an intermediate step")
    culprits = _large_inputs(steps, params)
    cause = ("; the inputs that large: " + ", ".join(culprits)) if culprits else (
        "; no single input is >= 1e30, so their combination is too large")
    raise ValueError(f"{owner}: the advantage of input row {row} {what} ({int(bad.sum())} output value(s) cannot be "
                     f"represented in float32){cause}. Rescale the rewards (or the named values/parameters) to a "
                     f"few orders of magnitude")


def _locked(method):
    def run(self, *args, **kwargs):
        with self._agentcredit_lock():
            return method(self, *args, **kwargs)

    return functools.wraps(method)(run)


def _locked_call(method):
    def run(self, steps, *args, **kwargs):
        with self._agentcredit_lock():
            return check_output(f"estimator {type(self).__name__}", method(self, steps, *args, **kwargs), steps,
                                getattr(self, "params", None))

    return functools.wraps(method)(run)


class StatefulEstimator:
    """Base of the estimators that carry state from batch to batch (MVPO, SIPO, UniOPSD; ``Estimator.stateful``).

    * One re-entrant lock per instance around ``__call__``, ``state_dict``, ``load_state_dict`` and ``reset`` (the
      subclass's own methods are wrapped when the class is defined): two threads calling one instance take turns,
      so every batch's state update is applied once, in some order. (One instance per trainer process is still the
      intended use: the order of two concurrent batches is not defined.) ``__call__``'s result is checked by
      :func:`check_output`.
    * ``STATE_SCHEMA``: ``{key: (annotation, param-style rules)}`` of the saved state; :meth:`check_state` validates a
      ``state_dict`` against it (exact keys, each value by :func:`check_value`: type, finiteness, range), so a
      corrupt checkpoint is a ``ValueError`` naming the field, not NaN advantages later.
    """

    STATE_SCHEMA: ClassVar[dict[str, tuple[Any, dict[str, Any]]]] = {}

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        for name in ("__call__", "state_dict", "load_state_dict", "reset"):
            if name in cls.__dict__:
                setattr(cls, name, (_locked_call if name == "__call__" else _locked)(cls.__dict__[name]))

    def _agentcredit_lock(self) -> threading.RLock:
        lock = self.__dict__.get("_agentcredit_rlock")
        if lock is None:
            with _LOCK_GUARD:
                lock = self.__dict__.setdefault("_agentcredit_rlock", threading.RLock())
        return lock

    def check_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """``state`` validated against :attr:`STATE_SCHEMA`, as plain Python values."""
        owner = f"{type(self).__name__}.load_state_dict"
        if not isinstance(state, Mapping):
            raise ValueError(f"{owner}: expected a dict from {type(self).__name__}.state_dict(), got "
                             f"{type(state).__name__}")
        missing = [k for k in self.STATE_SCHEMA if k not in state]
        extra = sorted(set(state) - set(self.STATE_SCHEMA))
        if missing or extra:
            raise ValueError(f"{owner}: missing keys {missing}, unexpected keys {extra}; expected "
                             f"{list(self.STATE_SCHEMA)} (a dict from {type(self).__name__}.state_dict())")
        return {k: check_value(k, state[k], ann, meta, owner) for k, (ann, meta) in self.STATE_SCHEMA.items()}


@dataclass(frozen=True)
class Estimator:
    """A named credit estimator.

    Attributes:
        name: what a user types (``algorithm.adv_estimator=<name>`` in verl, ``credit=<name>`` in TRL).
        fn: ``fn(steps: StepTable, params) -> Tensor`` of shape ``[S]`` (per step, in the table's sorted order)
            or ``[S, L]`` (per token). It must be pure and vectorised.
        params: a dataclass of hyperparameters, each declared with :func:`param` (type, range and choices, checked by
            :func:`make_params`); its ``__post_init__`` checks only the rules across fields.
        paper: citation of the method's paper.
        formula: the formula the code computes, in plain text (the estimator module's ``FORMULA`` constant;
            ``describe()``, the docs pages and ``agentcredit describe`` show it).
        requires: StepTable columns the estimator reads beyond ``group, traj, t, reward`` (``state``, ``action``,
            ``success``, ``truncated``).
        extras: the data contract for everything else: each :class:`Extra` the estimator reads, required or
            optional, with the rollout piece that produces it. Bridges and the recipe loader read this record
            (:meth:`sources`, :meth:`reads`, :meth:`extra_names`) instead of knowing estimators by name.
        output: ``"step"`` ([S]) or ``"token"`` ([S, L]).
        similarity: the params field holding an anchor-similarity threshold (GiGPO's ``"similarity_thresh"``), or
            None. When its value is below 1 the estimator compares state *texts* (:meth:`StepTable.anchor_at`), so
            a bridge builds the ``state`` column from the texts, not their hashes (:meth:`reads_state_text`).
        stateful: ``None`` for a pure estimator. For a method that carries state from batch to batch (MVPO's
            kappa schedule and milestone weights, SIPO's a2), the class holding that state: built as
            ``stateful(params)``, called as ``instance(steps) -> Tensor`` (input order, float32), with
            ``state_dict()`` / ``load_state_dict()`` of plain Python values and a ``STATE_DOC`` string naming the
            state. ``fn`` then computes one batch from the initial state (what a fresh instance returns first).

    Use :meth:`create` in a training loop: it works for every estimator. Calling a *stateful* estimator as a
    function (``get("mvpo")(steps)``) raises ``ValueError``: a hidden per-process instance would make the same call
    return different values batch after batch and lose its state on resume, so the state must be held, and
    checkpointed, by whoever runs the loop.

    The record carries no test oracle: the loop reference of a built-in estimator is
    ``credit_plugins.oracles.ORACLES[name]`` (``oracle_values(name, steps, **params)``), which imports the estimator's
    params class, never the other way round.
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
    similarity: str | None = None

    def __post_init__(self):
        unknown = sorted(set(self.requires) - set(StepTable.FIELDS))
        if unknown:
            raise ValueError(f"estimator {self.name!r}: requires={unknown} are not StepTable columns "
                             f"{StepTable.FIELDS}; declare extras with extras=(Extra(name, source), ...)")
        if self.output not in ("step", "token"):
            raise ValueError(f"estimator {self.name!r}: output must be 'step' or 'token', got {self.output!r}")
        if self.similarity is not None and self.similarity not in {f.name for f in dataclasses.fields(self.params)}:
            raise ValueError(f"estimator {self.name!r}: similarity={self.similarity!r} is not a field of "
                             f"{self.params.__name__}; name the parameter that holds the similarity threshold")

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

    def reads_state_text(self, **params: Any) -> bool:
        """Whether the estimator with ``params`` compares state texts (a :attr:`similarity` threshold below 1): the
        bridges then give the StepTable the state texts, not only their hashes."""
        if self.similarity is None:
            return False
        threshold = getattr(self.make_params(**params), self.similarity)
        return threshold is not None and threshold < 1

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
        # float32 first, then back to input order (half the bytes to move; none when the rows came sorted)
        y = check_output(f"estimator {self.name!r}", out, steps, p, order=steps.order)
        return y if steps.in_input_order else steps.to_input_order(y)

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
