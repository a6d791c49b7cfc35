"""The plugin registry: one pluggy ``PluginManager("agentcredit")`` shared by estimators, schedulers and envs.

Plugins are found through the entry-point group ``agentcredit`` (the built-ins included) or registered in code with
:func:`register_plugin`. Names are global per kind: two providers of one name is an error naming both.
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from typing import Any

import pluggy

from . import hookspecs

__all__ = ["plugin_manager", "register_plugin", "unregister_plugin", "collect", "get", "available", "describe"]

#: The built-ins' entry points (``[project.entry-points.agentcredit]`` in pyproject.toml; a test keeps the two equal),
#: loaded by module name when the distribution is not installed (a source tree on ``sys.path``).
BUILTIN_ENTRY_POINTS = {"builtin": "credit_plugins.estimators", "builtin_envs": "env_adapters.builtin",
                        "builtin_distill": "distill_plugins.builtin"}


@lru_cache(maxsize=1)
def plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.load_setuptools_entrypoints(hookspecs.PROJECT)
    # running from a source tree without `pip install`: the entry points are absent, load the built-ins directly
    for name, module in BUILTIN_ENTRY_POINTS.items():
        if pm.get_plugin(name) is None:
            pm.register(importlib.import_module(module), name=name)
    return pm


def register_plugin(plugin: object, name: str | None = None) -> str:
    """Register a module or object that implements ``agentcredit_*`` hooks; returns its plugin name."""
    pm = plugin_manager()
    out = pm.register(plugin, name=name)
    _collect.cache_clear()
    return out


def unregister_plugin(name: str) -> None:
    """Remove the plugin registered as ``name`` (the inverse of :func:`register_plugin`)."""
    plugin_manager().unregister(name=name)
    _collect.cache_clear()


def _provider(pm: pluggy.PluginManager, plugin_name: str) -> str:
    for plugin, dist in pm.list_plugin_distinfo():
        if pm.get_name(plugin) == plugin_name:
            return f"{dist.project_name} (entry point {plugin_name!r})"
    return f"plugin {plugin_name!r}"


@lru_cache(maxsize=None)
def _collect(kind: str) -> dict[str, tuple[Any, str]]:
    pm = plugin_manager()
    hook = getattr(pm.hook, f"agentcredit_{kind}")
    found: dict[str, tuple[Any, str]] = {}
    for impl in hook.get_hookimpls():
        provider = _provider(pm, impl.plugin_name)
        for item in impl.function() or ():
            name = item.name
            if name in found:
                raise ValueError(f"{kind[:-1]} name {name!r} is provided twice: by {found[name][1]} and by {provider}; "
                                 f"uninstall one of them or rename its {kind[:-1]}")
            found[name] = (item, provider)
    return found


def collect(kind: str) -> dict[str, tuple[Any, str]]:
    """``{name: (item, provider)}`` for ``kind`` in ``estimators``, ``schedulers``, ``terms``, ``envs``."""
    return dict(_collect(kind))


def available(kind: str = "estimators") -> list[str]:
    """Sorted names of the registered items of ``kind`` (default: credit estimators)."""
    return sorted(_collect(kind))


def get(name: str, kind: str = "estimators") -> Any:
    """The registered item ``name`` (an :class:`~credit_plugins.Estimator` for the default kind)."""
    items = _collect(kind)
    if name not in items:
        raise ValueError(f"unknown {kind[:-1]} {name!r}; available: {sorted(items)}")
    return items[name][0]


def describe(name: str) -> str:
    """Paper, formula, parameters with defaults and required StepTable fields of estimator ``name``."""
    return get(name).describe()
