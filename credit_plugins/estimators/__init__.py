"""The built-in credit estimators, registered through the same ``agentcredit_estimators`` hook as any plugin.

One file per method (``grpo.py``, ``gigpo.py``, ...), each holding its params dataclass, the pure function and an
``ESTIMATOR`` record.
"""

from ..hookspecs import hookimpl
from . import (
    alignopsd,
    asct,
    crbc,
    gigpo,
    graphhca,
    grpo,
    mix,
    mvpo,
    sipo,
    tjpo,
    treerl,
    turn_level,
    uniopsd,
)

BUILTIN = (grpo.ESTIMATOR, gigpo.ESTIMATOR, mvpo.ESTIMATOR, graphhca.ESTIMATOR, crbc.ESTIMATOR, asct.ESTIMATOR,
           uniopsd.ESTIMATOR, sipo.AT2PO_ESTIMATOR, sipo.ESTIMATOR, treerl.ESTIMATOR, treerl.TREE_GRPO_ESTIMATOR,
           alignopsd.ESTIMATOR, tjpo.ESTIMATOR, turn_level.MT_GRPO_ESTIMATOR, turn_level.GTPO_ESTIMATOR)
BUILTIN = BUILTIN + (mix.build(BUILTIN),)  # mix passes on every extra its parts may read


@hookimpl
def agentcredit_estimators():
    return list(BUILTIN)
