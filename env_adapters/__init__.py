"""Environment adapters: one ``AgentEnv`` protocol, environments that emit the step metadata estimators need.

Environments register through the ``agentcredit_envs`` hook of :mod:`credit_plugins.hookspecs`; :func:`make` builds
one by name with keyword options, :func:`available` lists them. The built-in adapters (Sokoban, MiniGrid,
TextWorld, ALFWorld) arrive with the environment work; until then the registry is empty.
"""

from credit_plugins import registry


def available() -> list[str]:
    return registry.available("envs")


def make(name: str, **options):
    """Build the environment ``name`` with ``options`` (the registered item is called as a factory)."""
    return registry.get(name, kind="envs")(**options)
