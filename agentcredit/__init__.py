"""agentcredit's integration and app layer: the verl bridge (:mod:`agentcredit.verl`), the TRL bridge
(:mod:`agentcredit.trl`) and the ``agentcredit`` command (:mod:`agentcredit.cli`, recipes, ``train``, ``sft``).

The plugins themselves live in the pure packages below this one, which import neither verl nor TRL:
:mod:`credit_plugins` (StepTable, registry, credit estimators), :mod:`distill_plugins` (distillation losses and
schedulers) and :mod:`env_adapters` (environments). Importing ``agentcredit`` imports neither verl nor TRL either:
each bridge loads its framework when it is used.
"""

__version__ = "0.1.0"
