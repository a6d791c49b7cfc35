"""env_adapters' ``verl.plugins`` entry point: makes the ``agentcredit_env`` agent loop (and the
search loops ``agentcredit_counterfactual`` / ``agentcredit_tree``) known to verl by name.

verl imports this module in every process (``import verl``). It stays light: it only asks to import
:mod:`env_adapters.verl` (which registers the loop) once verl's agent-loop module is imported, i.e. in the agent-loop
workers, so ``actor_rollout_ref.rollout.agent.default_agent_loop=agentcredit_env`` works with no config file.
"""

import wrapt


def _register_agent_loop(_module) -> None:
    import env_adapters.verl  # noqa: F401  (its @register("agentcredit_env") runs on import)
    import env_adapters.verl_search  # noqa: F401  (agentcredit_counterfactual, agentcredit_tree)


wrapt.register_post_import_hook(_register_agent_loop, "verl.experimental.agent_loop.agent_loop")
