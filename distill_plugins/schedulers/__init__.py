"""Loss schedulers (DISTILL §11): ``fixed``, ``opw``, ``lsd``, ``tide``; the interface is in :mod:`.base`."""

from . import fixed, lsd, opw, tide
from .base import LossScheduler, ScheduleOutput, SchedulerSpec
from .fixed import FixedSchedule
from .lsd import LSDSchedule, decay_from_half_life, ema_update, length_scaling_tax
from .opw import OPWSchedule
from .tide import TIDESchedule

BUILTIN = (fixed.SPEC, opw.SPEC, lsd.SPEC, tide.SPEC)

__all__ = ["LossScheduler", "ScheduleOutput", "SchedulerSpec", "FixedSchedule", "OPWSchedule", "LSDSchedule",
           "TIDESchedule", "decay_from_half_life", "ema_update", "length_scaling_tax", "BUILTIN"]
