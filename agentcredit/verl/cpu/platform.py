"""verl's ``cpu`` platform (``PlatformRegistry``), selected with ``VERL_PLATFORM=cpu``.

verl 0.9.1 registers nvidia / huawei / amd only, falls back to nvidia when none is found
(``plugin/platform/platform_manager.py``) and asks ``get_torch_device()`` for a ``torch.cuda``-like module everywhere.
:data:`DEVICE_MODULE` is that module for the CPU: ``torch.cpu`` plus no-op ``set_device`` / ``synchronize`` /
``empty_cache`` / ``ipc_collect``, one "device", the CPU RNG, and memory figures from ``psutil``.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

NAME = "cpu"


def _memory() -> tuple[int, int]:
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


DEVICE_MODULE = types.SimpleNamespace(
    __name__="agentcredit.verl.cpu.device",
    is_available=lambda: True,
    device_count=lambda: 1,
    current_device=lambda: "cpu",
    set_device=_noop,
    synchronize=_noop,
    empty_cache=_noop,
    ipc_collect=_noop,
    set_per_process_memory_fraction=_noop,
    manual_seed=torch.manual_seed,
    manual_seed_all=torch.manual_seed,
    get_rng_state=lambda *a, **k: torch.get_rng_state(),
    set_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
    mem_get_info=lambda *a, **k: _memory(),
    memory_allocated=lambda *a, **k: _rss(),
    memory_reserved=lambda *a, **k: _rss(),
    max_memory_allocated=lambda *a, **k: _rss(),
    max_memory_reserved=lambda *a, **k: _rss(),
    reset_peak_memory_stats=_noop,
    get_device_name=lambda *a, **k: "cpu",
    current_stream=torch.cpu.current_stream,
    stream=torch.cpu.stream,
    Stream=torch.cpu.Stream,
    Event=torch.cpu.Event,
)


@PlatformRegistry.register(platform=NAME)
class CPUPlatform(PlatformBase):
    """The host CPU as verl's accelerator: ``device_name`` ``cpu``, gloo collectives, Ray's logical ``GPU``
    resource for placement (give ``ray_init.num_gpus``), no IPC, no profiler."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self):
        return DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return False  # never auto-detected: only VERL_PLATFORM=cpu selects it

    def current_device(self) -> str:
        # verl moves tensors with ``.to(get_device_id())``; an int would mean cuda:N, "cpu" keeps them here
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"  # a logical Ray resource: ray_init.num_gpus=N makes N placement slots on a CPU machine

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None
