"""``StepTable``: the one data structure every credit estimator reads.

One row per agent decision (a turn: the model's response to one observation), columnar and 1-D, length S:

=============  =======  ===========================================================================================
field          dtype    meaning
=============  =======  ===========================================================================================
``group``      int64    task group: the G rollouts of one task from one identical initial state (verl ``uid``)
``traj``       int64    rollout id, unique in the batch
``t``          int64    0-based step index inside the trajectory
``state``      int64    anchor key: stable hash of the canonical observation; only compared within a group
``action``     int64    semantic action key (the parsed command); -1 when unknown or invalid
``reward``     float32  per-step environment reward r_t
``success``    bool     terminal success of the trajectory (a per-trajectory flag, see below)
``truncated``  bool     trajectory ended by the step limit (a per-trajectory flag, see below)
=============  =======  ===========================================================================================

Any column may be given as a tensor, a numpy array or a list. Integer keys are kept; strings (or other hashable
values) are turned into stable 64-bit keys (:func:`credit_plugins.hashing.stable_hash`). Rows may come in any
order: the table sorts them by ``(traj, t)`` once, and :meth:`StepTable.to_input_order` puts an estimator's output
back in the caller's order. A ``state`` column of strings is also kept as given (by reference), so that
:meth:`StepTable.anchor_at` can merge near-identical states by their text (GiGPO's ``similarity_thresh``).

Defaults for optional columns: ``action`` -1 everywhere; ``success`` is ``return > 0`` of the trajectory (the
ALFWorld/WebShop convention: 10 on success, 0 or a penalty otherwise); ``truncated`` False. ``state`` has no
default: estimators that need it call :meth:`StepTable.require`, which names the missing field.

Per-trajectory flags (``success``, ``truncated``) are accepted in two shapes: the same value on every row of the
trajectory, or the shape a gym-style loop records, False on every row except the last (``t = max t``), which
holds the final value. The second is broadcast from the last row to the whole trajectory, so every estimator sees
one value per trajectory. Any other change inside a trajectory (True on a middle row, True on the first row and
False on the last) is ambiguous and a ``ValueError`` that names the field and the trajectory.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import numpy as np
import torch

from .hashing import RESERVED_KEYS, stable_hash_many
from .segments import dense_ids, discounted_cumsum, segment_sum
from .similarity import check_threshold, similar_anchor_keys

__all__ = ["StepTable", "list_block"]

logger = logging.getLogger("agentcredit")

_REQUIRED: Any = object()  # StepTable.extra without a default: the extra is required

ArrayLike = torch.Tensor | np.ndarray | Sequence[Any]


_INT64 = (-(2**63), 2**63 - 1)
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _plain_tensor(name: str, values: torch.Tensor) -> torch.Tensor:
    """``values`` as a dense CPU tensor; meta, sparse and nested tensors are a ``ValueError`` naming the field."""
    if values.is_nested or values.layout != torch.strided:
        raise ValueError(f"StepTable.{name} is a {'nested' if values.is_nested else str(values.layout)} tensor; pass "
                         f"a dense one (.to_dense() / .to_padded_tensor(...))")
    if values.device.type == "meta":
        raise ValueError(f"StepTable.{name} is on the meta device and holds no data; pass the materialised tensor")
    return values.detach().cpu()


def _key_list(name: str, values: list, none_key: int | None) -> torch.Tensor:
    """Keys of a Python sequence: ints as they are (within int64), ``None`` as ``none_key`` (or an error), anything
    else hashed stably."""
    ints = [isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in values]
    for i, (v, is_int) in enumerate(zip(values, ints)):
        if is_int and not _INT64[0] <= int(v) <= _INT64[1]:
            raise ValueError(f"StepTable.{name}[{i}] = {int(v)} is outside the int64 range; use smaller integer "
                             f"keys or pass them as strings (hashed stably)")
        if v is None and none_key is None:
            raise ValueError(f"StepTable.{name}[{i}] is None; every row needs a {name} key (a string or an int)")
    if all(ints):
        return torch.tensor([int(v) for v in values], dtype=torch.int64)
    try:
        return torch.from_numpy(stable_hash_many(values))
    except (TypeError, ValueError, UnicodeError) as e:
        raise ValueError(f"StepTable.{name} has a key that cannot be hashed: {e}") from None


def _as_keys(name: str, values: ArrayLike, none_key: int | None = None) -> torch.Tensor:
    """int64 key column from integer tensors/arrays, or stable hashes of anything else. ``None`` rows are an error,
    or ``none_key`` where the field has a "missing" value (``action``: -1)."""
    if isinstance(values, torch.Tensor):
        values = _plain_tensor(name, values)
        if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            raise ValueError(f"StepTable.{name} must hold integer or string keys, got a {values.dtype} tensor; "
                             f"cast it with .long() or pass the original keys")
        return values.reshape(-1).to(torch.int64)
    if not isinstance(values, np.ndarray):  # a Python sequence: ints, strings, None, arrays or dicts per row
        return _key_list(name, list(values), none_key)
    if values.ndim != 1:
        raise ValueError(f"StepTable.{name} must be 1-D (one key per row), got shape {values.shape}; pass a list "
                         f"with one key (str, int, array or dict) per row")
    if values.dtype.kind == "u" and values.size and int(values.max()) > _INT64[1]:
        raise ValueError(f"StepTable.{name} holds unsigned keys above the int64 range; pass them as strings")
    if values.dtype.kind in "iu":
        return torch.from_numpy(values.astype(np.int64, copy=False))
    if values.dtype.kind in "fc":
        raise ValueError(f"StepTable.{name} must hold integer or string keys, got floats; cast them to int")
    if values.dtype.kind == "b":
        raise ValueError(f"StepTable.{name} must hold integer or string keys, got bools")
    return _key_list(name, values.tolist(), none_key)


def _as_tensor(name: str, values: ArrayLike, dtype: torch.dtype) -> torch.Tensor:
    """A numeric column as ``dtype``, without silent coercions: integer columns (``t``) must hold integral values,
    flag columns (``success``, ``truncated``) only 0/1, and float32 columns (``reward``) values float32 can hold
    (a NaN/inf reward is reported by the caller with its row)."""
    try:
        if isinstance(values, torch.Tensor):
            out = _plain_tensor(name, values).reshape(-1)
        else:
            arr = np.asarray(values)
            if arr.dtype == object:
                arr = arr.astype(np.float64)
            if arr.dtype.kind not in "biuf":
                raise TypeError(f"got {arr.dtype} values")
            out = torch.from_numpy(np.ascontiguousarray(arr.reshape(-1)))
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"StepTable.{name} could not be read as {dtype}: {e}") from None
    if out.is_complex():
        raise ValueError(f"StepTable.{name} holds complex values; pass real numbers")
    if dtype == torch.bool and out.dtype != torch.bool:
        bad = ~((out == 0) | (out == 1))
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(f"StepTable.{name}[{i}] = {out[i].item()} is not a flag; give True/False (or 1/0)")
    elif not dtype.is_floating_point and out.is_floating_point():
        bad = ~torch.isfinite(out) | (out != torch.round(out))
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(f"StepTable.{name}[{i}] = {out[i].item()} is not an integer; {name} must hold whole "
                             f"numbers")
    elif dtype == torch.float32 and out.is_floating_point():
        big = torch.isfinite(out) & (out.to(torch.float64).abs() > _FLOAT32_MAX)
        if bool(big.any()):
            i = int(big.nonzero()[0])
            raise ValueError(f"StepTable.{name}[{i}] = {out[i].item():g} does not fit in float32 (|x| <= "
                             f"{_FLOAT32_MAX:.3g}); rescale the {name}s")
    return out.to(dtype)


def list_block(values: Sequence[Sequence[Any]]) -> np.ndarray:
    """An ``[S, A]`` extras block from one list per row (the bridges' per-row extras: ASCT's tables, MVPO's
    milestones): bool if every value is a bool, int64 if every value is an int, float64 otherwise; rows of different
    lengths are right-padded with 0 / False."""
    flat = [x for v in values for x in v]
    if all(isinstance(x, (bool, np.bool_)) for x in flat):
        dtype: Any = bool
    elif all(isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)) for x in flat):
        dtype = np.int64
    else:
        dtype = np.float64
    out = np.zeros((len(values), max((len(v) for v in values), default=0)), dtype=dtype)
    for i, v in enumerate(values):
        out[i, :len(v)] = v
    return out


def _extra_column(name: str, col: ArrayLike) -> torch.Tensor:
    """An extras block as a tensor: numeric ``[S, ...]`` as it is, a 1-D column of strings/objects as stable keys;
    anything else (ragged rows, 2-D strings) is a ``ValueError`` naming the extra."""
    field = f"extras[{name!r}]"
    if isinstance(col, torch.Tensor):
        return _plain_tensor(field, col)
    try:
        arr = np.asarray(col) if not isinstance(col, np.ndarray) else col
    except ValueError as e:  # ragged nested lists
        raise ValueError(f"StepTable.{field} is ragged ({e}); pad every row to the same length (list_block does "
                         f"that for lists)") from None
    if arr.dtype.kind in "OUS":
        if arr.ndim != 1:
            raise ValueError(f"StepTable.{field} holds {arr.dtype} values in shape {arr.shape}; only a 1-D column of "
                             f"keys (one string per row) can be non-numeric, give numbers for a block")
        return _as_keys(field, arr, none_key=-1)
    if arr.dtype.kind not in "biuf":
        raise ValueError(f"StepTable.{field} holds {arr.dtype} values; give numbers or one key per row")
    return torch.from_numpy(np.ascontiguousarray(arr))


class StepTable:
    """A batch of agent steps, sorted by ``(traj, t)``, with the derived views estimators share.

    Args:
        group, traj, t: required; see the module docstring.
        state, action: anchor and action keys (ints or strings). ``state`` is required by step-level methods.
        reward: per-step reward r_t. The episode return ``R_i = sum_t r_t`` is what trajectory-level terms use.
        success, truncated: per-row flags of the trajectory: constant within it, or False everywhere except its
            last row (gym-style, broadcast from that row); see the module docstring.
        extras: optional blocks for the methods that need them, ``{name: column}`` with first dimension S:
            string/object columns become stable int64 keys (e.g. MVPO's ``signature``), numeric ones stay tensors
            (``[S]`` or ``[S, ...]``, e.g. ``milestones`` ``[S, M]`` or token-level ``logp_old`` ``[S, L]``).
            Read them back, sorted like every column, with :meth:`extra` (``extra(name, None)`` for an optional one).

    All columns must have the same length S. Errors are ``ValueError`` messages that name the field and the fix.
    """

    FIELDS = ("group", "traj", "t", "state", "action", "reward", "success", "truncated")

    def __init__(self, *, group: ArrayLike, traj: ArrayLike, t: ArrayLike, reward: ArrayLike,
                 state: ArrayLike | None = None, action: ArrayLike | None = None,
                 success: ArrayLike | None = None, truncated: ArrayLike | None = None,
                 extras: dict[str, ArrayLike] | None = None):
        cols: dict[str, torch.Tensor | None] = {
            "group": _as_keys("group", group),
            "traj": _as_keys("traj", traj),
            "t": _as_tensor("t", t, torch.int64),
            "state": None if state is None else _as_keys("state", state),
            "action": None if action is None else _as_keys("action", action, none_key=-1),
            "reward": _as_tensor("reward", reward, torch.float32),
            "success": None if success is None else _as_tensor("success", success, torch.bool),
            "truncated": None if truncated is None else _as_tensor("truncated", truncated, torch.bool),
        }
        n = cols["traj"].numel()
        for name, col in cols.items():
            if col is not None and col.numel() != n:
                raise ValueError(f"StepTable.{name} has {col.numel()} rows but traj has {n}; every column needs one "
                                 f"entry per step row")
        self._extras: dict[str, torch.Tensor] = {}
        for name, col in (extras or {}).items():
            col = _extra_column(name, col)
            if col.ndim == 0 or col.shape[0] != n:
                raise ValueError(f"StepTable.extras[{name!r}] has first dimension "
                                 f"{tuple(col.shape)[:1] or '()'} but traj has {n} rows; give one entry per step row")
            self._extras[name] = col
        self._given = frozenset(k for k, v in cols.items() if v is not None) | frozenset(self._extras)
        # the state values as given (input order), kept by reference for similarity anchors (:meth:`anchor_at`)
        self._state_values = None if state is None or isinstance(state, torch.Tensor) or (
            isinstance(state, np.ndarray) and state.dtype.kind in "biuf") else state
        self._similar: dict[float, tuple[torch.Tensor, int]] = {}
        bad = ~torch.isfinite(cols["reward"])
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(f"StepTable.reward has {int(bad.sum())} non-finite value(s), first at input row {i} "
                             f"(= {float(cols['reward'][i])}); replace NaN/inf rewards (e.g. with the env's failure "
                             f"reward) before building the table")
        if cols["state"] is not None:
            for key in RESERVED_KEYS:
                if bool((cols["state"] == key).any()):
                    raise ValueError(f"StepTable.state uses the reserved boundary key {key}; hash states with "
                                     f"credit_plugins.stable_hash, which never returns it")

        # one sort by (traj, t); `order[p]` is the input row at sorted position p
        traj_ids, n_traj = dense_ids(cols["traj"])
        t_col = cols["t"]
        if n and int(t_col.min()) < 0:
            raise ValueError("StepTable.t has negative step indices; t is the 0-based step index in a trajectory")
        span = int(t_col.max()) + 1 if n else 1
        order = torch.sort(traj_ids * span + t_col, stable=True).indices
        self.order = order
        self.n_steps = n
        self.n_traj = n_traj
        self.row_traj = traj_ids[order]
        for name, col in cols.items():
            setattr(self, "_" + name, None if col is None else col[order])
        self._extras = {name: col[order] for name, col in self._extras.items()}

        self._validate_trajectories()
        # group ids are made dense per trajectory (N << S keys to sort), then broadcast to the rows
        self.traj_group, self.n_groups = dense_ids(self._group[self.first_row])
        self.row_group = self.traj_group[self.row_traj]
        spans = self._group != self._group[self.first_row][self.row_traj]
        if bool(spans.any()):
            i = int(spans.nonzero()[0])
            raise ValueError(f"StepTable.group: trajectory {int(self._traj[i])} spans two groups; every row of a "
                             f"trajectory must carry the group (uid) of its task")
        for name in ("success", "truncated"):
            col = getattr(self, "_" + name)
            if col is not None:
                setattr(self, "_" + name, self._trajectory_flag(name, col))

    # ---- validation -------------------------------------------------------------------------------------------
    def _validate_trajectories(self) -> None:
        if self.n_steps == 0:
            return
        t = self._t
        new_traj = torch.ones(self.n_steps, dtype=torch.bool)
        new_traj[1:] = self.row_traj[1:] != self.row_traj[:-1]
        expected = torch.zeros_like(t)
        expected[1:] = t[:-1] + 1
        expected[new_traj] = 0
        wrong = t != expected
        if bool(wrong.any()):
            i = int(wrong.nonzero()[0])
            traj = int(self._traj[i])
            if not bool(new_traj[i]) and int(t[i]) == int(t[i - 1]):
                raise ValueError(f"StepTable: duplicate (traj, t) = ({traj}, {int(t[i])}); each step of a trajectory "
                                 f"must appear once (check that rows were not gathered twice)")
            raise ValueError(f"StepTable.t of trajectory {traj} jumps to {int(t[i])} where {int(expected[i])} was "
                             f"expected; t must run 0, 1, 2, ... without gaps (keep every step of the rollout, or "
                             f"renumber after filtering)")

    def _trajectory_flag(self, name: str, col: torch.Tensor) -> torch.Tensor:
        """The sorted flag column ``col`` broadcast from each trajectory's last row (module docstring).

        Valid iff every row before the last equals the first row and the last row is not False after True rows:
        then the body is all False (gym-style: the last row decides) or all equal to the last row (constant).
        """
        first = col[self.first_row][self.row_traj]
        bad = torch.where(self.is_last, first & ~col, col != first)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(f"StepTable.{name} changes inside trajectory {int(self._traj[i])} at t={int(self._t[i])}; "
                             f"it is a per-trajectory flag: give the final value on every row, or only on the "
                             f"last row (True at t = max t, False before)")
        return col[self.is_last][self.row_traj]

    def require(self, *fields: str, by: str = "this estimator") -> None:
        """Raise ``ValueError`` naming each of ``fields`` that was not given at construction."""
        missing = [f for f in fields if f not in self._given]
        if missing:
            raise ValueError(f"{by} needs StepTable field(s) {missing}; pass them to StepTable(...) (in verl: set "
                             f"them in each AgentLoopOutput's extra_fields, see agentcredit.verl)")

    def with_extras(self, extras: dict[str, ArrayLike]) -> StepTable:
        """A new table of the same rows, in the same input order, with ``extras`` added to (or replacing) these."""
        inv = self.inverse
        cols = {name: getattr(self, "_" + name)[inv] for name in self.FIELDS if name in self._given}
        out = StepTable(**cols, extras={**{k: v[inv] for k, v in self._extras.items()}, **extras})
        out._state_values = self._state_values  # same rows in the same input order: the state texts carry over
        return out

    def extra(self, name: str, default: Any = _REQUIRED) -> Any:
        """The block ``name`` given in ``extras``, sorted by ``(traj, t)`` like every column.

        Without ``default`` the extra is required: a missing one is a ``ValueError`` naming it and the extras given.
        With a ``default`` (typically ``None``) the extra is optional and ``default`` is returned when it is absent.
        """
        if name not in self._extras:
            if default is not _REQUIRED:
                return default
            raise ValueError(f"StepTable has no extras[{name!r}]; pass extras={{{name!r}: ...}} to StepTable(...) "
                             f"(given: {sorted(self._extras)})")
        return self._extras[name]

    # ---- columns (sorted by (traj, t)) ---------------------------------------------------------------------
    @property
    def group(self) -> torch.Tensor:
        return self._group

    @property
    def traj(self) -> torch.Tensor:
        return self._traj

    @property
    def t(self) -> torch.Tensor:
        return self._t

    @property
    def state(self) -> torch.Tensor:
        self.require("state")
        return self._state

    @property
    def reward(self) -> torch.Tensor:
        return self._reward

    @cached_property
    def action(self) -> torch.Tensor:
        return self._action if self._action is not None else torch.full((self.n_steps,), -1, dtype=torch.int64)

    @cached_property
    def success(self) -> torch.Tensor:
        if self._success is not None:
            return self._success
        return (self.returns > 0)[self.row_traj]

    @cached_property
    def truncated(self) -> torch.Tensor:
        if self._truncated is not None:
            return self._truncated
        return torch.zeros(self.n_steps, dtype=torch.bool)

    # ---- derived views ----------------------------------------------------------------------------------------
    @cached_property
    def is_last(self) -> torch.Tensor:
        """[S] bool: the row is the final step of its trajectory."""
        out = torch.ones(self.n_steps, dtype=torch.bool)
        out[:-1] = self.row_traj[:-1] != self.row_traj[1:]
        return out

    @cached_property
    def first_row(self) -> torch.Tensor:
        """[N] sorted-row index of each trajectory's step 0."""
        return (self._t == 0).nonzero().reshape(-1)

    @cached_property
    def traj_len(self) -> torch.Tensor:
        """[N] number of steps of each trajectory."""
        return torch.bincount(self.row_traj, minlength=self.n_traj)

    @cached_property
    def returns(self) -> torch.Tensor:
        """[N] float64 episode return ``R_i = sum_t r_t`` per trajectory."""
        return segment_sum(self._reward.to(torch.float64), self.row_traj, self.n_traj)

    @cached_property
    def traj_success(self) -> torch.Tensor:
        """[N] bool terminal success per trajectory."""
        return self.success[self.first_row]

    def reward_to_go(self, gamma: float) -> torch.Tensor:
        """[S] float64 discounted return ``R_t = sum_{k>=t} gamma^(k-t) r_k`` within each trajectory."""
        return discounted_cumsum(self._reward, self.is_last, gamma)

    @cached_property
    def anchor(self) -> tuple[torch.Tensor, int]:
        """Dense ids of the anchor groups ``(group, state)`` and their count: GiGPO's step groups (Eq. 6).

        A batch in which no anchor repeats is valid (every step-level term is then 0); it is logged at DEBUG.
        """
        ids, n = dense_ids(self.row_group, self.state)
        if n == self.n_steps > 0:
            logger.debug("StepTable: none of the %d anchor states repeats within its group; step-level credit terms "
                         "are 0 for this batch (check that state keys exclude history and formatting)", n)
        return ids, n

    def anchor_at(self, threshold: float | None, by: str = "similarity_thresh") -> tuple[torch.Tensor, int]:
        """:attr:`anchor` with near-identical states merged: within each group, states whose texts reach the difflib
        ratio ``threshold`` share an anchor (:mod:`credit_plugins.similarity`; order-invariant). ``threshold`` None
        or 1 is :attr:`anchor` itself. Needs the ``state`` column as strings (hashes cannot be compared); ``by``
        names the parameter in the error."""
        threshold = check_threshold(threshold, by)
        if threshold is None or threshold >= 1.0:
            return self.anchor
        if threshold not in self._similar:
            anchor, n = self.anchor
            rep = torch.full((n,), self.n_steps, dtype=torch.int64).scatter_reduce(
                0, anchor, torch.arange(self.n_steps), "amin")  # one row per exact anchor
            rows = self.order[rep].tolist()  # input rows
            values = self._state_values
            bad = next((i for i in rows if not isinstance(values[i], str)), None) if values is not None else \
                (rows[0] if rows else None)
            if bad is not None:
                got = ("hashed keys (a tensor or integers)" if values is None
                       else f"a non-text key ({type(values[bad]).__name__})")
                raise ValueError(f"{by}={threshold} merges states by their text, but StepTable.state holds {got} "
                                 f"(input row {bad}); pass the state texts (strings) as the state column, or "
                                 f"{by}=None for exact anchors")
            keys = similar_anchor_keys([values[i] for i in rows], self.row_group[rep].numpy(), threshold)
            self._similar[threshold] = dense_ids(self.row_group, torch.from_numpy(keys)[anchor])
        return self._similar[threshold]

    @cached_property
    def inverse(self) -> torch.Tensor:
        """[S] sorted position of each input row (the inverse of ``order``)."""
        inv = torch.empty_like(self.order)
        inv[self.order] = torch.arange(self.n_steps)
        return inv

    def has(self, name: str) -> bool:
        """Whether the table was given the column or extra ``name``."""
        return name in self._given

    @cached_property
    def in_input_order(self) -> bool:
        """Whether the rows were given already sorted by ``(traj, t)`` (``order`` is the identity)."""
        return bool(torch.equal(self.order, torch.arange(self.n_steps)))

    def to_input_order(self, values: torch.Tensor) -> torch.Tensor:
        """Reorder a per-row result (first dim S, in sorted order) back to the rows' input order."""
        return values[self.inverse]

    def __len__(self) -> int:
        return self.n_steps

    def __repr__(self) -> str:
        return (f"StepTable(steps={self.n_steps}, trajectories={self.n_traj}, groups={self.n_groups}, "
                f"fields={sorted(self._given)})")
