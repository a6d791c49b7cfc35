"""The one place that knows which TRL internals agentcredit relies on (trl>=1.16,<1.17).

* :func:`check_trl`: the version range and the ``GRPOTrainer`` hooks the mixins override (names, signatures, and
  ``_compute_loss`` keeping ``[B, T]`` advantages); :class:`TRLInternalsChanged` names what is missing.
* :func:`grpo_trainer`, :func:`grpo_config`, :func:`model_config`: TRL's classes, imported on first use, for the app
  (``agentcredit train``, the recipe loader), which never imports ``trl`` itself.
* :func:`checkpoint_folder`: the ``checkpoint-N`` folder ``Trainer._save_checkpoint`` just wrote.
* :func:`cpu_vllm_engine`: on vLLM's CPU build, the engine settings TRL's colocated ``LLM`` needs
  (:mod:`agentcredit.vllm_cpu`).
"""

from __future__ import annotations

import inspect
import os

SUPPORTED = "trl>=1.16,<1.17"
_RANGE = ((1, 16), (1, 17))

#: GRPOTrainer methods the mixins override, with the leading parameters they pass on
HOOKS = {"_generate_and_score_completions": ["self", "inputs"],
         "_calculate_rewards": ["self", "inputs", "prompts", "completions", "completion_ids_list"],
         "_compute_loss": ["self", "model", "inputs"]}


class TRLInternalsChanged(RuntimeError):
    """The installed TRL lacks an internal the bridge relies on (it is pinned to ``trl>=1.16,<1.17``)."""


def cpu_vllm_engine() -> bool:
    """On vLLM's CPU build (:mod:`agentcredit.vllm_cpu`), the colocated engine TRL builds in
    ``trl.generation.vllm_generation`` gets eager mode and fp32 unless given (TRL passes neither); the weight patch
    reaches it through vLLM's own plugin loading in this process. A no-op without the CPU build."""
    from .. import vllm_cpu

    if not vllm_cpu.cpu_build_installed():
        return False
    import trl.generation.vllm_generation as module

    return vllm_cpu.engine_defaults(module, "LLM")


def grpo_trainer() -> type:
    """``trl.GRPOTrainer``."""
    from trl import GRPOTrainer

    return GRPOTrainer


def grpo_config() -> type:
    """``trl.GRPOConfig``."""
    from trl import GRPOConfig

    return GRPOConfig


def model_config() -> type:
    """``trl.ModelConfig``."""
    from trl import ModelConfig

    return ModelConfig


def check_trl(base: type | None = None) -> None:
    """Check that ``base`` (default ``trl.GRPOTrainer``) has the hooks the mixin overrides, with the signatures
    and the ``[B, T]``-advantage branch it relies on; raise :class:`TRLInternalsChanged` naming what is missing."""
    import trl

    if base is None:
        base = trl.GRPOTrainer
    problems = []
    version = tuple(int(p) for p in trl.__version__.split(".")[:2] if p.isdigit())
    if not (_RANGE[0] <= version < _RANGE[1]):
        problems.append(f"trl {trl.__version__} is outside the supported range {SUPPORTED[3:]}")
    for name, params in HOOKS.items():
        fn = getattr(base, name, None)
        if fn is None:
            problems.append(f"{base.__name__}.{name} is missing")
            continue
        got = list(inspect.signature(fn).parameters)
        if got[:len(params)] != params:
            problems.append(f"{base.__name__}.{name}{tuple(got)} no longer takes {tuple(params)}")
    try:
        src = inspect.getsource(base._compute_loss)
    except (OSError, TypeError, AttributeError):
        src = ""
    if "advantages.dim() == 1" not in src:
        problems.append(f"{base.__name__}._compute_loss no longer keeps [B, T] advantages "
                        "('if advantages.dim() == 1: advantages = advantages.unsqueeze(1)')")
    if problems:
        raise TRLInternalsChanged("agentcredit's TRL bridge cannot work with this TRL: " + "; ".join(problems)
                                  + f". Install {SUPPORTED} (pip install 'agentcredit[trl]').")


def checkpoint_folder(trainer, trial=None) -> str:
    """The ``checkpoint-N`` folder ``Trainer._save_checkpoint(model, trial)`` has just written (N = global step)."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    return os.path.join(trainer._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}")
