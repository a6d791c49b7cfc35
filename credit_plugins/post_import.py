"""Lazy patches of a framework's modules: run a patch when (or, if already imported, as soon as) a module loads."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from types import ModuleType

logger = logging.getLogger("agentcredit")


def install_post_import_hooks(targets: Mapping[str, Callable[[ModuleType], None]], consequence: str) -> None:
    """Register ``targets`` (module name -> patch) with ``wrapt``; a failing patch is logged with ``consequence``
    (what the user loses) and re-raised, since verl hides plugin errors at DEBUG level."""
    import wrapt

    for module_name, patch in targets.items():
        wrapt.register_post_import_hook(_loud(patch, consequence), module_name)


def _loud(patch, consequence: str):
    @functools.wraps(patch)
    def run(module):
        try:
            patch(module)
        except Exception:
            logger.exception("agentcredit: could not hook %s; %s", module.__name__, consequence)
            raise

    return run
