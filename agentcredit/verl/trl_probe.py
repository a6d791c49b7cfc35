"""verl + TRL 1.16 in one environment: make verl's TRL probe in ``apply_monkey_patch`` see the truth.

The crash (verl 0.9.1, GPU and CPU alike): ``verl/models/transformers/monkey_patch.py`` ``apply_monkey_patch`` (run
when the FSDP engine builds the actor, ``workers/engine/fsdp/transformer_impl.py``) does::

    if is_trl_available():
        try:
            from trl.experimental.ppo import AutoModelForCausalLMWithValueHead
        except ImportError:
            from trl import AutoModelForCausalLMWithValueHead
        AutoModelForCausalLMWithValueHead.state_dict = ...   # a patch for TRL's value-head wrapper only

``is_trl_available()`` only asks whether a package named ``trl`` exists. TRL 1.16 (agentcredit's ``[trl]`` extra) has
that class in neither place, so every real verl run in such an environment dies at model build with
``ImportError: cannot import name 'AutoModelForCausalLMWithValueHead' from 'trl'``.

The fix, the narrowest there is: the name ``is_trl_available`` *inside that one module* is rebound to
:func:`trl_value_head_available`, which answers the question the code behind it really asks: "can TRL's
``AutoModelForCausalLMWithValueHead`` be imported?". With TRL 1.16 the answer is no and verl skips a patch that has
nothing to patch; with an older TRL that has the class (verl's own ``[fsdp]`` extra pins trl 0.27) nothing changes.
verl's source and every other use of ``is_trl_available`` (``verl.utils.model.load_valuehead_model``, which needs the
class anyway) are untouched. It is installed by the ``verl.plugins`` entry point (:mod:`agentcredit.verl`) in every
verl process, when verl imports ``monkey_patch`` (a ``wrapt`` post-import hook).

Start-up check (:func:`check_probe_site`): before rebinding, the source of ``apply_monkey_patch`` must still call
``is_trl_available()`` and import ``AutoModelForCausalLMWithValueHead`` from ``trl.experimental.ppo`` and ``trl``, and
the module must bind ``is_trl_available`` by name; otherwise :class:`~._compat.VerlInternalsChanged` says so (the fix
would be answering code that no longer exists, or missing the new one).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import warnings
from types import ModuleType

from ._compat import SUPPORTED, VerlInternalsChanged

logger = logging.getLogger("agentcredit")

MODULE = "verl.models.transformers.monkey_patch"
#: the lines of ``apply_monkey_patch`` the rebinding answers (whitespace-insensitive)
PROBE_LINES = (
    "if is_trl_available():",
    "from trl.experimental.ppo import AutoModelForCausalLMWithValueHead",
    "from trl import AutoModelForCausalLMWithValueHead",
)
_MARK = "__agentcredit_trl_probe__"
CLASS = "AutoModelForCausalLMWithValueHead"


@functools.cache
def trl_value_head_available() -> bool:
    """Whether TRL's ``AutoModelForCausalLMWithValueHead`` can be imported where verl looks for it."""
    if importlib.util.find_spec("trl") is None:
        return False
    for module in ("trl.experimental.ppo", "trl"):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # TRL warns on any import from trl.experimental
                mod = importlib.import_module(module)
        except ImportError:
            continue
        try:
            found = getattr(mod, CLASS, None) is not None
        except ImportError:  # a lazy module whose entry fails to import
            continue
        if found:
            return True
    return False


setattr(trl_value_head_available, _MARK, True)


def _squash(text: str) -> str:
    return " ".join(text.split())


def check_probe_site(module: ModuleType) -> None:
    """Raise :class:`VerlInternalsChanged` unless ``module`` still has the TRL probe this fix answers."""
    fn = getattr(module, "apply_monkey_patch", None)
    if fn is None or not hasattr(module, "is_trl_available"):
        raise VerlInternalsChanged(f"agentcredit: {MODULE} no longer has apply_monkey_patch / is_trl_available, "
                                   f"whose TRL probe agentcredit.verl.trl_probe answers; this bridge supports "
                                   f"{SUPPORTED}")
    source = _squash(inspect.getsource(fn))
    missing = [line for line in PROBE_LINES if _squash(line) not in source]
    if missing:
        raise VerlInternalsChanged(f"agentcredit: verl's apply_monkey_patch no longer contains {missing}; the TRL "
                                   f"probe fix (agentcredit.verl.trl_probe) does not know this code; this bridge "
                                   f"supports {SUPPORTED}")


def patch(module: ModuleType) -> None:
    """Check the probe site and rebind ``module.is_trl_available`` to :func:`trl_value_head_available` (once)."""
    if getattr(module.is_trl_available, _MARK, False):
        return
    check_probe_site(module)
    module.is_trl_available = trl_value_head_available
    if importlib.util.find_spec("trl") is not None and not trl_value_head_available():
        logger.info("agentcredit: this TRL has no AutoModelForCausalLMWithValueHead; verl's value-head state_dict "
                    "patch is skipped (agentcredit.verl.trl_probe)")
