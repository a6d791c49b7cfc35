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
from .scaling import ADV_SCALES, DEFAULT_ADV_SCALE, adv_scale_factor, scale_advantages
from .steptable import StepTable

__all__ = ["StepTable", "Estimator", "param", "stable_hash", "hookimpl", "get", "available", "describe",
           "register_plugin", "scale_advantages", "adv_scale_factor", "ADV_SCALES", "DEFAULT_ADV_SCALE"]
__version__ = "0.1.0"
