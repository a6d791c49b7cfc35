"""agentcredit's core: the StepTable, the plugin registry and the credit estimators.

    >>> import credit_plugins as cp
    >>> steps = cp.StepTable(group=[0, 0], traj=[0, 1], t=[0, 0], state=["s", "s"], reward=[10.0, 0.0])
    >>> cp.get("gigpo")(steps, gamma=0.95).shape
    torch.Size([2])

Importing this package needs neither verl nor TRL; the bridges live in ``agentcredit.verl`` and
``agentcredit.trl``.
"""

from .estimator import Estimator, param
from .hashing import stable_hash
from .hookspecs import hookimpl
from .registry import available, describe, get, register_plugin
from .steptable import StepTable

__all__ = ["StepTable", "Estimator", "param", "stable_hash", "hookimpl", "get", "available", "describe",
           "register_plugin"]
__version__ = "0.1.0"
