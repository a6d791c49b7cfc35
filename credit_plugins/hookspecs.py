"""pluggy hook specifications of agentcredit, in one place (as pytest keeps its ``hookspec.py``).

A third-party package adds estimators, schedulers or environments with a module like::

    from credit_plugins import hookimpl, Estimator

    @hookimpl
    def agentcredit_estimators():
        return [Estimator(name="my_credit", fn=my_credit, params=MyParams, paper="...", formula="...")]

and an entry point in group ``agentcredit``: ``[project.entry-points.agentcredit] my_pkg = "my_pkg.plugin"``.
The built-ins use exactly this path (entry point ``builtin = "credit_plugins.estimators"``).
"""

import pluggy

PROJECT = "agentcredit"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def agentcredit_estimators():
    """Return a list of :class:`credit_plugins.Estimator` (credit estimators, by name)."""


@hookspec
def agentcredit_schedulers():
    """Return a list of objects with a ``name`` attribute: distillation loss schedulers (``distill_plugins``)."""


@hookspec
def agentcredit_terms():
    """Return a list of objects with a ``name`` attribute: auxiliary training terms (``distill_plugins.terms``)."""


@hookspec
def agentcredit_envs():
    """Return a list of objects with a ``name`` attribute: environment adapters (``env_adapters``)."""
