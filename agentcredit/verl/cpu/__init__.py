"""A CPU backend for verl 0.9.1: run a real ``python -m verl.trainer.main_ppo`` on a laptop or in CI.

Loaded only when asked, in every verl process (driver, TaskRunner, Ray workers)::

    VERL_USE_EXTERNAL_MODULES=agentcredit.verl.cpu VERL_PLATFORM=cpu python -m verl.trainer.main_ppo ... \\
        <the overrides of CPU_OVERRIDES>

or simply ``agentcredit verl RECIPE.yaml --cpu-smoke`` (2 steps, a tiny local model, prints the agentcredit step
metrics; :mod:`agentcredit.verl.smoke`). Everything goes through verl's own registries, nothing edits verl:

* platform ``cpu`` (``PlatformRegistry``, :mod:`.platform`): selected by ``VERL_PLATFORM=cpu``, never auto-detected;
* the FSDP engines (``FSDPEngineWithLMHead`` / ``FSDPEngineWithValueHead``) registered for device ``cpu`` too
  (``EngineRegistry``); run them as FSDP2 (FSDP1's ``sync_module_states`` fails with CPU parameters);
* the reference policy's FSDP2 CPU-offload policy built without pinned memory (pinning needs an accelerator);
* a plain ``gloo`` process group: verl asks for ``"cpu:gloo,{device}:{backend}"``, i.e. ``cpu:gloo,cpu:gloo``, which
  torch rejects ("Duplicate device type cpu"); the worker's binding of ``initialize_global_process_group_ray`` gets
  ``backend="gloo"`` when the platform is ``cpu`` and no backend was given;
* rollout backend ``hfcpu`` (``RolloutReplicaRegistry`` + verl's worker-side rollout table, :mod:`.rollout`), also
  as the on-policy-distillation teacher (``distillation.teacher_models.<key>.inference.name=hfcpu``): verl's
  ``DistillationTeacherModelConfig._validate_topk_logprobs`` knows only vllm / sglang for a top-K teacher and gets
  ``hfcpu`` accepted.

:data:`CPU_OVERRIDES` lists the config a CPU run needs besides that (Ray's logical GPU slots, FSDP2, sdpa attention,
no torch.compile, no remove-padding, fp32, one agent-loop worker); :mod:`agentcredit.verl.smoke` adds the small-run sizes.

Limits: a smoke test, not a trainer. Generation is one sequence at a time with HF ``transformers`` (no vLLM features:
no batching, paged attention, prefix caching, LoRA serving, multimodal inputs, partial rollout); training is FSDP2 on
gloo in fp32. A 2-layer test model runs a 2-step recipe in about 2 minutes on 2 cores; SmolLM2-135M is usable for
a few steps; anything bigger belongs on a GPU with ``rollout.name=vllm``.
"""

from __future__ import annotations

import logging
import os

from .._compat import VerlInternalsChanged, install_post_import_hooks, wraps_once
from . import platform  # noqa: F401  (registers the cpu platform)

logger = logging.getLogger("agentcredit")

from ..smoke import CPU_ENV, CPU_OVERRIDES, MODULE, ROLLOUT  # noqa: F401  (documented here)


def on_cpu() -> bool:
    from verl.utils.device import get_device_name

    return get_device_name() == "cpu"


@wraps_once("cpu", "initialize_global_process_group_ray(timeout_second, backend)", ("timeout_second", "backend"))
def wrap_init_process_group(orig):
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        if backend is None and on_cpu():
            backend = "gloo"
        return orig(timeout_second=timeout_second, backend=backend)

    return initialize_global_process_group_ray


def _patch_engine_workers(module) -> None:
    module.initialize_global_process_group_ray = wrap_init_process_group(module.initialize_global_process_group_ray)


def _unpinned_offload_policy(orig):
    """verl builds a forward-only engine (the reference policy) with ``CPUOffloadPolicy(pin_memory=True)``; pinning
    needs an accelerator, so on the cpu platform the policy is built unpinned (the parameters live on the CPU
    anyway)."""

    def CPUOffloadPolicy(*args, **kwargs):  # noqa: N802 - stands in for the class of the same name
        if on_cpu():
            kwargs["pin_memory"] = False
            args = ()
        return orig(*args, **kwargs)

    CPUOffloadPolicy.agentcredit_wrapped = orig
    return CPUOffloadPolicy


def _register_fsdp_for_cpu(module) -> None:
    from verl.workers.engine.base import EngineRegistry

    policy = getattr(module, "CPUOffloadPolicy", None)
    if policy is None:
        raise VerlInternalsChanged("agentcredit: verl.workers.engine.fsdp.transformer_impl.CPUOffloadPolicy is gone; "
                                   "the CPU backend cannot build the reference policy")
    if not hasattr(policy, "agentcredit_wrapped"):
        module.CPUOffloadPolicy = _unpinned_offload_policy(policy)

    for model_type, cls in (("language_model", module.FSDPEngineWithLMHead),
                            ("value_model", module.FSDPEngineWithValueHead)):
        for backend in ("fsdp", "fsdp2"):
            if "cpu" not in EngineRegistry._engines.get(model_type, {}).get(backend, {}):
                EngineRegistry.register(model_type=model_type, backend=backend, device="cpu")(cls)


@wraps_once("cpu", "DistillationTeacherModelConfig._validate_topk_logprobs(self, use_topk, topk)",
            ("self", "use_topk", "topk"))
def wrap_validate_topk_logprobs(orig):
    """verl accepts a top-K teacher only on vllm / sglang; ``hfcpu`` computes any top-K per request (no engine-boot
    cap such as vLLM's ``max_logprobs``), so it only needs ``topk`` to be set."""

    def _validate_topk_logprobs(self, use_topk, topk):
        if self.inference.name != ROLLOUT:
            return orig(self, use_topk, topk)
        if use_topk and topk is None:
            raise ValueError("topk must be specified when use_topk is True.")
        return None

    return _validate_topk_logprobs


def _patch_teacher_config(module) -> None:
    cls = module.DistillationTeacherModelConfig
    cls._validate_topk_logprobs = wrap_validate_topk_logprobs(cls.__dict__.get("_validate_topk_logprobs"))


def _load_replica():
    from .rollout import HFCPUReplica

    return HFCPUReplica


def _register_replica(module) -> None:
    module.RolloutReplicaRegistry.register(ROLLOUT, _load_replica)


def _register_worker_rollout(module) -> None:
    # verl's worker-side rollout table is a plain dict (no register function in 0.9.1)
    table = getattr(module, "_ROLLOUT_REGISTRY", None)
    if not isinstance(table, dict):
        raise VerlInternalsChanged("agentcredit: verl.workers.rollout.base._ROLLOUT_REGISTRY is gone; the hfcpu "
                                   "rollout backend cannot register its worker side")
    table[(ROLLOUT, "async")] = f"{MODULE}.rollout.HFCPUServerAdapter"


install_post_import_hooks({
    "verl.workers.engine_workers": _patch_engine_workers,
    "verl.workers.engine.fsdp.transformer_impl": _register_fsdp_for_cpu,
    "verl.workers.rollout.replica": _register_replica,
    "verl.workers.rollout.base": _register_worker_rollout,
    "verl.workers.config.distillation": _patch_teacher_config,
}, "the CPU backend is incomplete")

if os.environ.get("VERL_PLATFORM", "").strip().lower() != "cpu":
    logger.warning("agentcredit.verl.cpu is loaded but VERL_PLATFORM is not 'cpu'; set VERL_PLATFORM=cpu to use it")
