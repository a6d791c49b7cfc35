"""Distillation losses and loss schedulers (on-policy distillation mixed with RL).

Schedulers register through the ``agentcredit_schedulers`` hook of :mod:`credit_plugins.hookspecs` (the built-ins
``fixed``, ``opw``, ``lsd``, ``tide`` from :mod:`distill_plugins.builtin`); this package mirrors the credit API:
:func:`get`, :func:`available` and :func:`create`::

    sched = distill_plugins.create("tide", zeta=0.02)
    out = sched.on_batch(step, metrics, batch)     # ScheduleOutput(w_opd, w_rl, combine, route, token_weights, ...)

The per-token OPD estimators are in :mod:`distill_plugins.losses`.
"""

from typing import Any

from credit_plugins import registry


def available() -> list[str]:
    return registry.available("schedulers")


def get(name: str):
    return registry.get(name, kind="schedulers")


def create(name: str, **params: Any):
    """A fresh scheduler ``name`` with ``params``; unknown names or parameters are a ``ValueError`` listing the valid
    ones."""
    return get(name).create(**params)
