"""Hydra search-path plugin: makes ``--config-name agentcredit_ppo`` visible to verl's ``main_ppo``.

``agentcredit_ppo.yaml`` is verl's ``ppo_trainer`` plus an ``algorithm.<estimator>`` block with every agentcredit
estimator's defaults, so ``algorithm.gigpo.step_weight=0.5`` needs no ``+``.

verl's own config folder (``pkg://verl.trainer.config``) is appended too, after ours: ``--config-path DIR`` replaces
main_ppo's primary config folder (verl's), and a config in ``DIR`` (e.g. ``recipes/verl/*.yaml``) that composes
``agentcredit_ppo`` -> ``ppo_trainer`` and its groups (``actor/``, ``data/``, ...) still finds them. When verl's
folder already is the primary one (a plain ``main_ppo`` launch) it is not added a second time.
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

VERL_CONFIG = "pkg://verl.trainer.config"


def _has_verl_config(search_path: ConfigSearchPath) -> bool:
    for element in search_path.get_path():
        path = (element.path or "").rstrip("/")
        if path == VERL_CONFIG or path.replace("\\", "/").endswith("verl/trainer/config"):
            return True
    return False


class AgentCreditSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="agentcredit", path="pkg://agentcredit.verl.config")
        if not _has_verl_config(search_path):
            search_path.append(provider="verl", path=VERL_CONFIG)
