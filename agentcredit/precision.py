"""Training precision chosen by the hardware: bf16 autocast only where the device computes bf16 natively.

On a CPU without native bf16 (AVX2 only, most laptops and many cloud CPUs) oneDNN emulates bf16 matmuls, which are
then 25-60x *slower* than fp32: measured on a 2-core AMD EPYC (AVX2), a 512x576 @ 576x1536 matmul takes 32 ms in
fp32, 831 ms in bf16 and 727 ms under bf16 autocast. With native bf16 (AVX512-BF16 or AMX-BF16, e.g. Sapphire Rapids,
Zen 4) bf16 autocast trains the demo 2-2.5x faster than fp32. So a recipe's ``bf16: auto`` (the shipped recipes'
setting) resolves to:

* CUDA: ``torch.cuda.is_bf16_supported()``;
* CPU: ``torch.cpu.get_capabilities()`` reports ``avx512_bf16`` or ``amx_bf16`` (x86) or a ``bf16`` extension (Arm);
* anything else: fp32.

``bf16: true`` / ``false`` in a recipe (or ``bf16=true`` on the command line) forces the choice either way.
"""

from __future__ import annotations

from typing import Any

__all__ = ["native_bf16", "resolve_bf16", "AUTO"]

AUTO = "auto"
_CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16")


def _cpu_capabilities() -> dict[str, Any]:
    import torch

    try:
        return dict(torch.cpu.get_capabilities())
    except (AttributeError, RuntimeError):  # an older torch or an unknown CPU: assume no native bf16
        return {}


def native_bf16(device: str = "cpu", capabilities: dict[str, Any] | None = None) -> bool:
    """Whether ``device`` ("cpu" or "cuda") computes bf16 natively; ``capabilities`` overrides the CPU's flags."""
    import torch

    if device.startswith("cuda"):
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    caps = _cpu_capabilities() if capabilities is None else capabilities
    return any(bool(caps.get(flag)) for flag in _CPU_BF16_FLAGS)


def resolve_bf16(value: Any, device: str | None = None, capabilities: dict[str, Any] | None = None
                 ) -> tuple[bool, str]:
    """``(bf16, reason)`` for a recipe's ``bf16`` value: ``True`` / ``False`` as given, ``"auto"`` (or None) by
    :func:`native_bf16` on ``device`` (default: CUDA when available, else the CPU)."""
    if isinstance(value, bool):
        return value, f"bf16={'true' if value else 'false'} set by the recipe"
    if value is not None and (not isinstance(value, str) or value.strip().lower() != AUTO):
        raise ValueError(f"bf16 must be true, false or 'auto', got {value!r}")
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if capabilities is None and device == "cpu":
        capabilities = _cpu_capabilities()  # read once: for the decision and the message
    if native_bf16(device, capabilities):
        return True, f"bf16 autocast: {device} has native bf16"
    name = (capabilities or {}).get("cpu_name") or device
    return False, (f"fp32: {name} has no native bf16 (no avx512_bf16/amx_bf16), where bf16 matmuls run 25-60x "
                   f"slower than fp32; force it with bf16=true")
