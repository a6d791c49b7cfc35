"""agentcredit's TRL integration: everything that touches TRL or transformers training lives in this package.

    from agentcredit.trl import make_trainer
    Trainer = make_trainer(credit="gigpo", schedule="tide", teacher="runs/teacher")   # a GRPOTrainer subclass

Modules: :mod:`.credit` (``CreditMixin``, ``make_trainer``), :mod:`.distill` (``DistillMixin``, teachers),
:mod:`.rollouts` (``TurnRollout``, ``environment_factory``, evaluation), :mod:`.search_rollouts`
(``CounterfactualRollout``, ``TreeRollout``), :mod:`.privileged` and :mod:`.hindsight` (hindsight scoring for
UniOPSD/AlignOPSD), :mod:`.callbacks` (metrics JSONL and the learning-curve PNG). The TRL internals they rely on are
checked in one place, :mod:`._compat`. Importing this package does not import TRL.
"""

from ._compat import SUPPORTED, TRLInternalsChanged, check_trl, grpo_config, grpo_trainer, model_config
from .credit import CreditMixin, make_trainer

__all__ = ["make_trainer", "CreditMixin", "check_trl", "TRLInternalsChanged", "SUPPORTED", "grpo_trainer",
           "grpo_config", "model_config"]
