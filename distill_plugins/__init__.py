"""Distillation losses and loss schedulers (on-policy distillation mixed with RL).

Schedulers register through the ``agentcredit_schedulers`` hook of :mod:`credit_plugins.hookspecs`; this package
mirrors the credit API: :func:`get` and :func:`available`. The built-in schedulers (fixed, OPW, LSD, TIDE) arrive
with the distillation work; until then the registry is empty and ``agentcredit list`` says so.
"""

from credit_plugins import registry


def available() -> list[str]:
    return registry.available("schedulers")


def get(name: str):
    return registry.get(name, kind="schedulers")
