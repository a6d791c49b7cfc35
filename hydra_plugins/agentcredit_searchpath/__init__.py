"""Hydra search-path plugin: makes ``--config-name agentcredit_ppo`` visible to verl's ``main_ppo``.

``agentcredit_ppo.yaml`` is verl's ``ppo_trainer`` plus an ``algorithm.<estimator>`` block with every agentcredit
estimator's defaults, so ``algorithm.gigpo.step_weight=0.5`` needs no ``+``.
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class AgentCreditSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="agentcredit", path="pkg://credit_plugins.verl.config")
