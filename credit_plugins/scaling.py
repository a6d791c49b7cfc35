"""Advantage scale: one batch statistic that puts every estimator's advantages on the same scale.

Each estimator returns advantages on its own scale (GRPO's z-scores are about 1 in magnitude; an estimator with a
step term of weight 5 gives several times that), so at a fixed learning rate switching the estimator changes the
step size. Both bridges take ``adv_scale`` (:data:`ADV_SCALES`) and divide the estimator's output by one number
computed over the batch's scored decisions (the valid step rows of ``[S]`` advantages, the ``mask`` tokens of
``[S, L]`` ones; never padding), after the estimator and before the trainer's loss. The formulas are
:data:`FORMULA`.

``batch_std`` does not re-centre: an estimator's advantages are already centred where its method says so (GRPO per
task group, GiGPO per anchor group); subtracting the batch mean on top would move them and could flip the sign of
small ones. Dividing by a positive number keeps every sign, so a batch whose advantages are all 0 stays all 0. The
std is floored at :data:`STD_FLOOR` times the rms, so a batch whose advantages are (nearly) all equal is not
multiplied by ``1/eps``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["ADV_SCALES", "DEFAULT_ADV_SCALE", "EPS", "STD_FLOOR", "FORMULA", "check_adv_scale", "adv_scale_factor",
           "scale_advantages"]

#: the valid values of ``adv_scale``
ADV_SCALES = ("none", "batch_rms", "batch_std")
#: what both bridges and the recipe loader use when ``adv_scale`` is not given (or is null)
DEFAULT_ADV_SCALE = "none"
#: added to the statistic before dividing (as GRPO adds it to the group std)
EPS = 1e-6
#: ``batch_std`` divides by at least this share of the batch rms
STD_FLOOR = 0.1

FORMULA = """\
D = the batch's scored decisions (valid step rows of [S]; mask tokens of [S, L]), n = |D|
none:       A' = A
batch_rms:  A' = A / (rms + eps),            rms = sqrt(mean_D A^2)
batch_std:  A' = A / (max(std, 0.1 rms) + eps),  std = sqrt(mean_D (A - mean_D A)^2)   (not re-centred)
factor = 1 when D is empty or every A in D is 0; eps = 1e-6
"""


def check_adv_scale(value: object, where: str = "adv_scale") -> str:
    """``value`` as a valid ``adv_scale`` (None: :data:`DEFAULT_ADV_SCALE`); a ``ValueError`` naming ``where`` and the
    valid values otherwise."""
    if value is None:
        return DEFAULT_ADV_SCALE
    if not isinstance(value, str) or value not in ADV_SCALES:
        raise ValueError(f"{where}={value!r} is not an advantage scale; valid: {', '.join(ADV_SCALES)} (none: the "
                         f"estimator's own scale; batch_rms / batch_std: divide by the batch's rms / std)")
    return value


def _decisions(adv: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The scored values of ``adv`` (float64, flat), checked finite."""
    if not isinstance(adv, torch.Tensor):
        raise ValueError(f"adv_scale: advantages must be a torch.Tensor, got {type(adv).__name__}")
    if adv.dim() not in (1, 2):
        raise ValueError(f"adv_scale: advantages must be [S] (per step) or [S, L] (per token), got shape "
                         f"{tuple(adv.shape)}")
    if not adv.is_floating_point():
        raise ValueError(f"adv_scale: advantages must be a floating-point tensor, got {adv.dtype}")
    values = adv.detach().to("cpu", torch.float64)
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(adv.shape):
            shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"adv_scale: mask must be a tensor of the advantages' shape {tuple(adv.shape)}, got "
                             f"{shape}")
        m = mask.detach().to("cpu")
        if m.dtype != torch.bool:
            if bool(((m != 0) & (m != 1)).any()):
                raise ValueError("adv_scale: mask must hold 0/1 or bools (1: a scored decision, 0: padding)")
            m = m != 0
        values = values[m]
    values = values.reshape(-1)
    bad = ~torch.isfinite(values)
    if bool(bad.any()):
        raise ValueError(f"adv_scale: {int(bad.sum())} of {values.numel()} scored advantage(s) are NaN or inf (the "
                         f"first: {values[bad][0].item()}); the estimator's output is broken, nothing to scale")
    return values


def adv_scale_factor(adv: torch.Tensor, adv_scale: str = DEFAULT_ADV_SCALE, mask: torch.Tensor | None = None,
                     eps: float = EPS) -> float:
    """The number ``adv_scale`` multiplies the advantages by (:data:`FORMULA`), from the ``mask`` entries of ``adv``
    (``[S]`` or ``[S, L]``; ``mask`` None: every entry). 1 for ``none``, an empty batch or an all-zero one."""
    mode = check_adv_scale(adv_scale)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"adv_scale: eps must be a finite number >= 0, got {eps!r}")
    values = _decisions(adv, mask)
    if mode == "none" or values.numel() == 0:
        return 1.0
    peak = float(values.abs().max())
    if peak == 0.0:
        return 1.0
    x = values / peak  # in [-1, 1]: the moments neither overflow nor underflow
    rms = peak * math.sqrt(float(x.square().mean()))
    if mode == "batch_rms":
        scale = rms
    else:
        std = peak * math.sqrt(float((x - x.mean()).square().mean()))
        scale = max(std, STD_FLOOR * rms)
    return 1.0 / (scale + eps)


def scale_advantages(adv: torch.Tensor, adv_scale: str = DEFAULT_ADV_SCALE, mask: torch.Tensor | None = None,
                     eps: float = EPS) -> tuple[torch.Tensor, float]:
    """``(adv * factor, factor)`` with :func:`adv_scale_factor`'s factor; same shape and dtype as ``adv`` (entries
    outside ``mask`` are multiplied too, but never change the factor)."""
    factor = adv_scale_factor(adv, adv_scale, mask, eps)
    if factor == 1.0:
        return adv, factor
    return (adv.to(torch.float64) * factor).to(adv.dtype), factor  # a factor past float32's range (eps=0) stays exact
