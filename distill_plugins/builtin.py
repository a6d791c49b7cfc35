"""The built-in loss schedulers and auxiliary terms, registered through the same ``agentcredit_schedulers`` and
``agentcredit_terms`` hooks as any plugin.

Entry point (``pyproject.toml``): ``[project.entry-points.agentcredit] builtin_distill = "distill_plugins.builtin"``.
"""

from credit_plugins.hookspecs import hookimpl

from . import terms
from .schedulers import BUILTIN


@hookimpl
def agentcredit_schedulers():
    return list(BUILTIN)


@hookimpl
def agentcredit_terms():
    return list(terms.BUILTIN)
