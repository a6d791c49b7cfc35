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
back in the caller's order.

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

__all__ = ["StepTable", "list_block"]

logger = logging.getLogger("agentcredit")

_REQUIRED: Any = object()  # StepTable.extra without a default: the extra is required

ArrayLike = torch.Tensor | np.ndarray | Sequence[Any]


def _as_keys(name: str, values: ArrayLike) -> torch.Tensor:
    """int64 key column from integer tensors/arrays, or stable hashes of anything else."""
    if isinstance(values, torch.Tensor):
        if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            raise ValueError(f"StepTable.{name} must hold integer or string keys, got a {values.dtype} tensor; "
                             f"cast it with .long() or pass the original keys")
        return values.detach().reshape(-1).to(torch.int64).cpu()
    if not isinstance(values, np.ndarray):  # a Python sequence: ints, strings, None, arrays or dicts per row
        values = list(values)
        if all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in values):
            return torch.tensor(values, dtype=torch.int64)
        return torch.from_numpy(stable_hash_many(values))
    if values.ndim != 1:
        raise ValueError(f"StepTable.{name} must be 1-D (one key per row), got shape {values.shape}; pass a list "
                         f"with one key (str, int, array or dict) per row")
    if values.dtype.kind in "iu":
        return torch.from_numpy(values.astype(np.int64, copy=False))
    if values.dtype.kind in "fc":
        raise ValueError(f"StepTable.{name} must hold integer or string keys, got floats; cast them to int")
    if values.dtype.kind == "b":
        raise ValueError(f"StepTable.{name} must hold integer or string keys, got bools")
    return torch.from_numpy(stable_hash_many(values.tolist()))


def _as_tensor(name: str, values: ArrayLike, dtype: torch.dtype) -> torch.Tensor:
    try:
        if isinstance(values, torch.Tensor):
            out = values.detach().reshape(-1).cpu()
        else:
            arr = np.asarray(values)
            if arr.dtype == object:
                arr = arr.astype(np.float64 if dtype.is_floating_point else np.int64)
            out = torch.from_numpy(np.ascontiguousarray(arr.reshape(-1)))
    except (TypeError, ValueError) as e:
        raise ValueError(f"StepTable.{name} could not be read as {dtype}: {e}") from None
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
            "action": None if action is None else _as_keys("action", action),
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
            if isinstance(col, torch.Tensor):
                col = col.detach().cpu()
            else:
                arr = np.asarray(col) if not isinstance(col, np.ndarray) else col
                col = (_as_keys(f"extras[{name!r}]", arr) if arr.dtype.kind in "OUS" and arr.ndim == 1
                       else torch.from_numpy(np.ascontiguousarray(arr)))
            if col.ndim == 0 or col.shape[0] != n:
                raise ValueError(f"StepTable.extras[{name!r}] has first dimension "
                                 f"{tuple(col.shape)[:1] or '()'} but traj has {n} rows; give one entry per step row")
            self._extras[name] = col
        self._given = frozenset(k for k, v in cols.items() if v is not None) | frozenset(self._extras)
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
        return StepTable(**cols, extras={**{k: v[inv] for k, v in self._extras.items()}, **extras})

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

    @cached_property
    def inverse(self) -> torch.Tensor:
        """[S] sorted position of each input row (the inverse of ``order``)."""
        inv = torch.empty_like(self.order)
        inv[self.order] = torch.arange(self.n_steps)
        return inv

    def to_input_order(self, values: torch.Tensor) -> torch.Tensor:
        """Reorder a per-row result (first dim S, in sorted order) back to the rows' input order."""
        return values[self.inverse]

    def __len__(self) -> int:
        return self.n_steps

    def __repr__(self) -> str:
        return (f"StepTable(steps={self.n_steps}, trajectories={self.n_traj}, groups={self.n_groups}, "
                f"fields={sorted(self._given)})")
