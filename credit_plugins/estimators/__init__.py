"""The built-in credit estimators, registered through the same ``agentcredit_estimators`` hook as any plugin.

One file per method (``grpo.py``, ``gigpo.py``, ...), each holding its params dataclass, the pure function and an
``ESTIMATOR`` record.
"""

from ..hookspecs import hookimpl
from . import asct, crbc, gigpo, graphhca, grpo, mvpo

BUILTIN = (grpo.ESTIMATOR, gigpo.ESTIMATOR, mvpo.ESTIMATOR, graphhca.ESTIMATOR, crbc.ESTIMATOR, asct.ESTIMATOR)


@hookimpl
def agentcredit_estimators():
    return list(BUILTIN)
