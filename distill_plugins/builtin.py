"""The built-in loss schedulers, registered through the same ``agentcredit_schedulers`` hook as any plugin.

Entry point (``pyproject.toml``): ``[project.entry-points.agentcredit] builtin_distill = "distill_plugins.builtin"``.
"""

from credit_plugins.hookspecs import hookimpl

from .schedulers import BUILTIN


@hookimpl
def agentcredit_schedulers():
    return list(BUILTIN)
