"""The functions verl calls: one per agentcredit estimator, with verl's advantage-estimator signature.

``compute_advantage`` calls ``fn(token_level_rewards, response_mask, index, config)``; the step metadata is not in
those arguments. The trainer hooks (:mod:`agentcredit.verl.hooks`) publish it for the duration of the call in
the context variable :data:`CURRENT`, aligned with the batch rows. If a future verl forwards ``non_tensor_batch``
(verl-project/verl#7473) it is read from there.

``algorithm.agentcredit_adv_scale`` (:data:`ADV_SCALE_KEY`; ``none``, ``batch_rms``, ``batch_std``, unset: the
default of :mod:`credit_plugins.scaling`) divides the estimator's advantages by one statistic over the batch's
scored decisions (non-padding rows; their response tokens for per-token estimators) before they reach verl's loss,
and before CCM's distillation term is added; ``agentcredit/adv_scale_factor`` logs the factor, ``agentcredit/adv_*``
the advantages before it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from credit_plugins.diagnostics import NoSignalWarning, credit_diagnostics
from credit_plugins.estimator import Estimator
from credit_plugins.scaling import adv_scale_factor, check_adv_scale
from ._compat import algorithm_entry
from .contract import RowMeta, build_step_table, missing_fields_message
from .hindsight import COLUMNS as HINDSIGHT_COLUMNS

CURRENT: contextvars.ContextVar[RowMeta | None] = contextvars.ContextVar("agentcredit_row_meta", default=None)
#: Stateful estimators (MVPO, ...) live for the trainer process: ``{name: (params, instance)}``. The trainer hooks
#: save their ``state_dict()`` with each verl checkpoint and restore it on resume.
INSTANCES: dict[str, tuple[Any, Any]] = {}


def instance_for(estimator: Estimator, params: Any):
    """The process's instance of a stateful ``estimator`` with ``params`` (a new one when the params change)."""
    held = INSTANCES.get(estimator.name)
    if held is None or held[0] != params:
        held = INSTANCES[estimator.name] = (params, estimator.create(**vars(params)))
    return held[1]


def state_dicts() -> dict[str, Any]:
    return {name: inst.state_dict() for name, (_, inst) in INSTANCES.items()}


def load_state_dicts(states: Mapping[str, Any]) -> None:
    """Restore saved states; an estimator not created yet gets its state when it is first created."""
    PENDING.update(states)
    for name, (_, inst) in INSTANCES.items():
        if name in PENDING:
            inst.load_state_dict(PENDING.pop(name))


PENDING: dict[str, Any] = {}


@contextlib.contextmanager
def publish(meta: RowMeta | None) -> Iterator[RowMeta | None]:
    """Make ``meta`` visible to the estimator functions called inside the block (no-op for ``None``)."""
    if meta is None:
        yield CURRENT.get()
        return
    token = CURRENT.set(meta)
    try:
        yield meta
    finally:
        CURRENT.reset(token)


def estimator_params(config: Any, name: str) -> dict[str, Any]:
    """``algorithm.<name>.*`` of verl's algorithm config (a DictConfig, a dict or None) as a plain dict."""
    if config is None:
        return {}
    sub = config.get(name, None) if hasattr(config, "get") else getattr(config, name, None)
    if sub is None:
        return {}
    if not isinstance(sub, dict):  # a DictConfig (nested ListConfigs too) becomes plain dicts and lists
        try:
            from omegaconf import OmegaConf

            sub = OmegaConf.to_container(sub, resolve=True)
        except Exception as e:  # pragma: no cover - only for exotic config objects
            raise ValueError(f"algorithm.{name} must be a mapping of parameters, got {type(sub).__name__}") from e
    return dict(sub)


#: ``algorithm.<this key>``: the advantage scale (:mod:`credit_plugins.scaling`) applied after the estimator
ADV_SCALE_KEY = "agentcredit_adv_scale"


def adv_scale_mode(config: Any) -> str:
    """``algorithm.agentcredit_adv_scale`` checked (unset or null: the default); a ``ValueError`` naming it."""
    return check_adv_scale(algorithm_entry(config, ADV_SCALE_KEY), where=f"algorithm.{ADV_SCALE_KEY}")


#: why a hindsight estimator's batch has no hindsight columns (they are computed by the v1 trainer wrap only)
HINDSIGHT_NOT_SCORED = (
    "agentcredit estimator {name!r} credits tokens by the policy's own log-probs under a hindsight prompt (a successful "
    "sibling's actions): extras {missing} are computed by agentcredit's wrap of the v1 trainer's "
    "PPOTrainer._compute_advantage (agentcredit.verl.hindsight) and are missing from this batch ({source}). Run the v1 "
    "trainer (trainer.use_v1=True, verl's default) with agentcredit.verl loaded in the trainer process "
    "(VERL_USE_EXTERNAL_MODULES=agentcredit.verl shows why not); the legacy trainer has no such step")


def _padded(rows: list[np.ndarray], like: torch.Tensor) -> torch.Tensor:
    """Per-row arrays right-padded (with 0) or cut to ``like``'s ``[B, L]``."""
    out = torch.zeros(like.shape, dtype=torch.float64)
    if len(rows) != like.shape[0]:
        raise ValueError(f"agentcredit: a per-token advantage term for {len(rows)} rows but the batch has "
                         f"{like.shape[0]}")
    for i, r in enumerate(rows):
        n = min(len(r), like.shape[-1])
        out[i, :n] = torch.as_tensor(r[:n], dtype=torch.float64)
    return out


def make_verl_estimator(estimator: Estimator):
    """A verl advantage-estimator function that runs ``estimator`` on the batch's steps."""

    # estimators whose step credit comes from revisited states warn once when it stays silent (see the module)
    silence = NoSignalWarning(estimator.name) if "state" in estimator.requires else None

    def compute(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: np.ndarray | None = None,
                config: Any = None, non_tensor_batch: Mapping[str, np.ndarray] | None = None, **_: Any):
        params = estimator_params(config, estimator.name)
        p = estimator.make_params(**params)  # fail on a typo before touching the batch
        scale_mode = adv_scale_mode(config)
        hindsight = "hindsight" in estimator.sources()
        meta = CURRENT.get()
        if meta is None and non_tensor_batch is not None:
            meta = RowMeta.from_non_tensor_batch(non_tensor_batch)
        if hindsight and meta is not None and any(c not in meta.columns for c in HINDSIGHT_COLUMNS):
            raise ValueError(HINDSIGHT_NOT_SCORED.format(name=estimator.name, source=meta.source, missing=[
                c for c in HINDSIGHT_COLUMNS if c not in meta.columns]))
        if meta is None:
            raise ValueError(missing_fields_message(estimator.name, ["step_idx", "anchor_key", "traj_uid"]) +
                             " (no agentcredit metadata reached the estimator: is agentcredit.verl loaded in the "
                             "trainer process? set VERL_USE_EXTERNAL_MODULES=agentcredit.verl to see why not)")
        if index is None:
            raise ValueError("verl passed no `index` (uid) to the estimator; the batch needs a 'uid' column")
        extras = estimator.extra_names(required=True)
        extras += tuple(e for e in estimator.extra_names(required=False) if e in meta.columns)
        steps, keep = build_step_table(meta, token_level_rewards, index, estimator.requires, estimator.name, extras)
        stats: Mapping[str, Any] = {}
        if getattr(estimator, "stateful", None) is not None:
            est = instance_for(estimator, p)
            if estimator.name in PENDING:
                est.load_state_dict(PENDING.pop(estimator.name))
            per_step = est(steps)
            stats = getattr(est, "stats", None) or {}
        else:
            per_step = estimator(steps, **vars(p))
        rows = torch.as_tensor(keep, dtype=torch.long)
        if per_step.ndim == 2:  # token-level (UniOPSD): [S, L] over the right-padded response tokens of the rows
            width = response_mask.shape[-1]
            scores = torch.zeros(token_level_rewards.shape[0], width, dtype=torch.float32)
            cols = min(width, per_step.shape[-1])
            scores[rows, :cols] = per_step[:, :cols].to(torch.float32)
        else:
            scores = torch.zeros(token_level_rewards.shape[0], dtype=torch.float32)
            scores[rows] = per_step
        if per_step.ndim == 2:  # token level: the means run over the rows' response tokens only
            weight = response_mask.detach().to("cpu", torch.float32)[rows]
            values = scores[rows]
        else:
            weight, values = torch.ones_like(per_step, dtype=torch.float32), per_step.to(torch.float32)
        total = float(weight.sum())
        factor = adv_scale_factor(values, scale_mode, weight > 0 if per_step.ndim == 2 else None)
        meta.stats.update({
            "agentcredit/steps": float(steps.n_steps),
            "agentcredit/trajectories": float(steps.n_traj),
            "agentcredit/padding_rows": float(meta.batch_padding.sum()),
            "agentcredit/adv_mean": float((values * weight).sum()) / total if total else 0.0,
            "agentcredit/adv_abs_mean": float((values.abs() * weight).sum()) / total if total else 0.0,
            "agentcredit/adv_scale_factor": factor,
        })
        diag = credit_diagnostics(steps, per_step)  # is there anything for step credit to work with?
        meta.stats.update({f"agentcredit/diag_{k}": v for k, v in diag.items()})
        if silence is not None:
            silence.update(diag)
        # a stateful estimator's statistics (MVPO's kappa and route fractions, SIPO's a2, ...), as TRL logs them
        meta.stats.update({f"agentcredit/{k}": float(v) for k, v in stats.items()
                           if isinstance(v, (int, float)) and v == v})
        scores = (scores * factor).to(response_mask.device)  # adv_scale: the estimator's advantages only, not CCM's
        adv = (scores if scores.ndim == 2 else scores.unsqueeze(-1)) * response_mask
        if meta.token_bonus is not None:  # CCM's distillation term (agentcredit.verl.ccm), on the response tokens
            adv = adv + _padded(meta.token_bonus, response_mask).to(device=adv.device, dtype=adv.dtype) * response_mask
        return adv, adv

    compute.__name__ = f"agentcredit_{estimator.name}"
    compute.__doc__ = estimator.describe()
    compute.agentcredit_estimator = estimator
    return compute
