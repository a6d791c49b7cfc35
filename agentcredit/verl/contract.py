"""The step-metadata contract between an agent loop and the credit estimators, and the StepTable it builds.

verl 0.9.1 hands a registered advantage estimator only ``token_level_rewards, response_mask, index, config``.
The step metadata travels in each row's ``AgentLoopOutput.extra_fields`` under these keys:

==================  ========================  ===================================================================
key                 type                      meaning (default when absent)
==================  ========================  ===================================================================
``step_idx``        int                       0-based step of this row in its trajectory (v1: the ``_{i}`` suffix
                                              of the TransferQueue key, i.e. the index in the AgentLoop's output
                                              list)
``anchor_key``      str | int                 canonical state the action was taken in, without history; required
                                              by step-level estimators (gigpo, graphhca, crbc, mvpo); a str
                                              reaches the StepTable as text, which ``similarity_thresh`` needs
``action_key``      str | int | None          the parsed semantic action; None when invalid (-1)
``step_reward``     float                     env reward of this step, the final reward included on the last step
                                              (0 on every step but the last, which gets the row's reward score)
``success``         bool                      terminal success of the trajectory (its reward score > 0)
``truncated``       bool                      the trajectory hit the step limit (False)
``traj_uid``        str                       rollout id (v1: ``{uid}_{session_id}`` from the TransferQueue key;
                                              required on the legacy trainer)
==================  ========================  ===================================================================

An estimator's declared extras (``Estimator.extras``: the required ones, and the optional ones when every row has
them) are read from the ``extra_fields`` keys of the same names as StepTable ``extras`` columns: MVPO reads ``signature`` (str),
``milestones`` (list of 0/1) and ``loop_flag`` (0/1). Rows tagged ``is_padding`` (verl's batch balancing) are dropped and get advantage 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from credit_plugins.steptable import StepTable, list_block

STEP_IDX, ANCHOR, ACTION, STEP_REWARD, SUCCESS, TRUNCATED, TRAJ = (
    "step_idx", "anchor_key", "action_key", "step_reward", "success", "truncated", "traj_uid")
CONTRACT_KEYS = (STEP_IDX, ANCHOR, ACTION, STEP_REWARD, SUCCESS, TRUNCATED, TRAJ)
#: env faults (agentcredit.verl.agent_loop): the episode's fault kind ("" none; "error", "timeout", "dead") and its
#: traceback on every row of the episode; ``env_fault_row`` marks the masked-out placeholder row of an episode whose
#: env failed before its first turn, which is dropped like padding (advantage 0, never in the StepTable)
ENV_ERROR, ENV_ERROR_DETAIL, FAULT_ROW = "env_error", "env_error_detail", "env_fault_row"
# StepTable fields an estimator may require, and the extra_fields key that carries each
FIELD_TO_KEY = {"state": ANCHOR, "action": ACTION, "success": SUCCESS, "truncated": TRUNCATED}


@dataclass
class RowMeta:
    """Per-row metadata of one verl batch, aligned with its rows (v1: with ``KVBatchMeta.keys``)."""

    columns: dict[str, list[Any]]
    is_padding: np.ndarray
    source: str
    stats: dict[str, float] = field(default_factory=dict)
    #: per batch row, an amount added to the advantage of each response token (CCM's distillation term), or None
    token_bonus: list[np.ndarray] | None = None
    #: per batch row, an env-fault placeholder (``env_fault_row``; also in ``is_padding``), or None when none is
    fault_rows: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.is_padding)

    @property
    def batch_padding(self) -> np.ndarray:
        """The rows verl's batch balancing added (``is_padding`` without the env-fault placeholders)."""
        return self.is_padding if self.fault_rows is None else self.is_padding & ~self.fault_rows

    @classmethod
    def from_v1(cls, keys: Sequence[str], tags: Sequence[Mapping[str, Any]] | None,
                extra_fields: Sequence[Mapping[str, Any] | None]) -> RowMeta:
        """From TransferQueue keys ``{uid}_{session}_{i}``, their tags and the rows' ``extra_fields`` dicts."""
        rows = [dict(r or {}) for r in extra_fields]
        pad = np.array([bool((tag or {}).get("is_padding", False)) for tag in (tags or [{}] * len(keys))], dtype=bool)
        # verl's padding rows copy the first row's extra_fields, a placeholder's flag included
        fault = np.array([bool(r.get(FAULT_ROW, False)) for r in rows], dtype=bool) & ~pad
        columns = _columns(rows, skip=fault | pad)
        split = [k.rsplit("_", 2) for k in keys]
        if any(len(s) != 3 for s in split):
            bad = next(k for k, s in zip(keys, split) if len(s) != 3)
            raise ValueError(f"verl batch key {bad!r} is not '{{uid}}_{{session_id}}_{{index}}'; verl's v1 agent-loop "
                             f"key format changed, pin verl>=0.9.1,<0.10")
        columns.setdefault(TRAJ, [f"{u}_{s}" for u, s, _ in split])
        columns.setdefault(STEP_IDX, [int(i) for _, _, i in split])
        return cls(columns=columns, is_padding=pad | fault, source="v1 extra_fields", fault_rows=fault)

    @classmethod
    def from_non_tensor_batch(cls, non_tensor_batch: Mapping[str, np.ndarray]) -> RowMeta | None:
        """From a legacy ``DataProto.non_tensor_batch`` (one column per ``extra_fields`` key); None if it has none."""
        present = [k for k in CONTRACT_KEYS if k in non_tensor_batch]
        if not present:
            return None
        n = len(next(iter(non_tensor_batch.values())))
        columns = {k: list(non_tensor_batch[k]) for k in non_tensor_batch if k not in ("uid",)}
        pad = np.asarray(non_tensor_batch.get("is_padding", np.zeros(n, dtype=bool)), dtype=bool)
        fault = np.asarray(non_tensor_batch.get(FAULT_ROW, np.zeros(n, dtype=bool)), dtype=bool) & ~pad
        return cls(columns=columns, is_padding=pad | fault, source="non_tensor_batch", fault_rows=fault)


def _columns(rows: list[dict[str, Any]], skip: np.ndarray | None = None) -> dict[str, list[Any]]:
    """One list per ``extra_fields`` key that every row carries; the ``skip`` rows (env-fault placeholders, dropped
    like padding) may lack a key, which is then None there."""
    keys = sorted({k for r in rows for k in r})
    out: dict[str, list[Any]] = {}
    for k in keys:
        if all(k in r or (skip is not None and skip[i]) for i, r in enumerate(rows)):
            out[k] = [r.get(k) for r in rows]
        elif k in CONTRACT_KEYS:
            missing = next(i for i, r in enumerate(rows) if k not in r)
            raise ValueError(f"extra_fields[{k!r}] is set on some rows but not on row {missing}; set it on every "
                             f"AgentLoopOutput of the batch, or on none")
    return out


def missing_fields_message(estimator: str, missing: Sequence[str]) -> str:
    return (f"agentcredit estimator {estimator!r} needs per-step metadata that this verl batch does not carry: "
            f"set extra_fields {list(missing)} on every AgentLoopOutput (one output per step), e.g. "
            f"AgentLoopOutput(..., extra_fields={{'anchor_key': canonical_obs, 'step_idx': t, 'action_key': "
            f"parsed_action}}). env_adapters' agent loop does this; see agentcredit.verl.contract"
            + ("; the agentcredit_env loop writes 'descriptor' (TJPO's trajectory descriptors) only with the "
               "agent-loop option descriptors: true" if "descriptor" in missing else ""))


#: extras that name another row by its ``traj_uid`` (a tree node's ``parent``; None = no such row)
ID_EXTRAS = ("parent",)


def _extra_column(values: list[Any], name: str = "") -> Any:
    """A per-row list as a StepTable extras column: lists of numbers (milestones) become a 2-D array; an id column
    (:data:`ID_EXTRAS`) becomes the int64 keys the StepTable gives the named rows' ``traj`` (None: -1). Blocks of
    bools stay bool, of ints int64, anything else float64; rows of different lengths are right-padded with 0/False
    (e.g. ASCT's tables in an env whose legal set varies: only the legal_mask columns are read). Arrays that all
    have one shape are stacked as they are (pooled embeddings, AlignOPSD's ``[K, W]`` cross log-probs)."""
    if name in ID_EXTRAS:
        from credit_plugins.hashing import stable_hash

        return np.asarray([-1 if v is None else stable_hash(str(v)) for v in values], dtype=np.int64)
    if values and all(isinstance(v, np.ndarray) for v in values) and len({v.shape for v in values}) == 1:
        return np.stack(values)  # equal-shaped blocks (embeddings [D], AlignOPSD's logp_cross [K, W])
    if values and isinstance(values[0], (list, tuple, np.ndarray)):
        return list_block(values)
    return values


def build_step_table(meta: RowMeta, token_level_rewards: torch.Tensor, uid: Sequence[Any],
                     requires: Sequence[str], estimator: str, extras: Sequence[str] = ()) -> tuple[StepTable, np.ndarray]:
    """StepTable of the non-padding rows, and the indices (into the batch) of those rows."""
    n = token_level_rewards.shape[0]
    if len(meta) != n:
        raise ValueError(f"agentcredit: metadata for {len(meta)} rows ({meta.source}) but the batch has {n} rows; "
                         f"the rows were reordered or filtered between the agent loop and compute_advantage")
    cols = meta.columns
    missing = [FIELD_TO_KEY[f] for f in requires if f in FIELD_TO_KEY and FIELD_TO_KEY[f] not in cols]
    missing += [k for k in (TRAJ, STEP_IDX) if k not in cols]
    missing += [e for e in extras if e not in cols]
    if missing:
        raise ValueError(missing_fields_message(estimator, missing))
    keep = np.flatnonzero(~meta.is_padding)

    def col(key: str) -> list[Any] | None:
        return None if key not in cols else [cols[key][i] for i in keep]

    for key in (STEP_IDX, TRAJ, ANCHOR, STEP_REWARD, SUCCESS, TRUNCATED):  # action_key None = unknown action (-1)
        values = col(key)
        if values is not None and any(v is None for v in values):
            row = int(keep[next(i for i, v in enumerate(values) if v is None)])
            raise ValueError(f"extra_fields[{key!r}] is None on batch row {row}; every AgentLoopOutput of an "
                             f"agentcredit estimator's batch needs a value there ({estimator!r}; see "
                             f"agentcredit.verl.contract)")
    score = token_level_rewards.detach().to(torch.float64).sum(-1).cpu()[torch.as_tensor(keep, dtype=torch.long)]
    try:
        t = np.asarray(col(STEP_IDX), dtype=np.int64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"extra_fields[{STEP_IDX!r}] must hold integers (the 0-based step): {e}") from None
    traj = col(TRAJ)
    if STEP_REWARD in cols:
        reward = np.asarray(col(STEP_REWARD), dtype=np.float64)
    else:  # the outcome reward on the last step of each trajectory, 0 before it
        traj_ids = np.unique(np.asarray(traj, dtype=object).astype(str), return_inverse=True)[1]
        last_t = np.full(traj_ids.max() + 1 if len(t) else 0, -1, dtype=np.int64)
        np.maximum.at(last_t, traj_ids, t)
        reward = np.where(t == last_t[traj_ids], score.numpy(), 0.0)
    steps = StepTable(
        group=[str(uid[i]) for i in keep], traj=[str(x) for x in traj], t=t, reward=reward,
        state=col(ANCHOR), action=col(ACTION), success=col(SUCCESS), truncated=col(TRUNCATED),
        extras={e: _extra_column(col(e), e) for e in extras} or None,
    )
    return steps, keep
